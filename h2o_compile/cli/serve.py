"""``h2o-compile serve``: an OpenAI-compatible server (transformers' own) over H2O continuous batching
(integrations/serving.py)."""

from __future__ import annotations

from .arguments import COMPILE_CHOICES, COMPILE_HELP, MODEL_HELP, compile_choice, require


def add_serve_parser(sub, add_h2o_args, config_of) -> None:
    srv = sub.add_parser("serve", help="an OpenAI-compatible server (chat, completions, streaming) over H2O "
                                       "continuous batching")
    srv.add_argument("--model", required=True, help=MODEL_HELP)
    srv.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0: every interface)")
    srv.add_argument("--port", type=int, default=8000)
    srv.add_argument("--max-batch-size", type=int, default=8, help="rows: requests decoding at once")
    srv.add_argument("--max-seq-len", type=int, default=None,
                     help="the longest prompt + max_tokens a request may take; sizes the rows of a float budget "
                          "(default: none with an int budget)")
    srv.add_argument("--dtype", choices=("auto", "float32", "float16", "bfloat16"), default="auto")
    srv.add_argument("--compile", choices=COMPILE_CHOICES, default="auto", help=COMPILE_HELP)
    srv.add_argument("--log-level", choices=("debug", "info", "warning", "error"), default="info")
    add_h2o_args(srv)
    srv.set_defaults(func=lambda args: cmd_serve(args, config_of(args)))


def cmd_serve(args, config) -> int:
    require("serve", "fastapi", "uvicorn", "openai")
    from ..integrations.serving import ServeSettings, serve

    settings = ServeSettings(config.to_string(), compile_choice(args.compile), args.max_batch_size, args.max_seq_len)
    settings.check()  # a bad setting fails before the server starts
    serve(args.model, settings, host=args.host, port=args.port, dtype=args.dtype, log_level=args.log_level)
    return 0
