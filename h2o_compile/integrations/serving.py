"""``h2o-compile serve``: transformers' own OpenAI-compatible server (``transformers serve``: chat completions,
completions, streaming, model listing) with the model optimized by this library and decoded by H2O continuous
batching.

The hook is the one transformers offers: its ``Serve`` builds a ``ModelLoader`` and hands it to its
``ModelManager``, whose model process calls ``loader.load_model_and_processor(model_id)``. :class:`H2OServe` swaps
that loader for :class:`H2OModelLoader` before the server runs; nothing of the server is copied. The model process
(started with ``spawn``, so the loader is pickled) then gets a :class:`ServedModel`, whose
``init_continuous_batching`` returns a :class:`ServedManager`: this library's manager with the few attributes
transformers' batching runner reads (per-request sampling keys, the worker's status, the rows in use).

Memory is fixed up front: ``max_batch_size`` rows of C slots per layer (C: an int budget, or a float budget x
``max_seq_len``); a request whose prompt + max_tokens passes ``max_seq_len`` is refused (400), never paged.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace
from typing import Optional

import torch
from transformers.cli.serve import Serve
from transformers.cli.serving.model_manager import ModelLoader

from ..config import H2OConfig
from ..runtime import optimize
from ..runtime.continuous_batching import ContinuousBatchingManager
from ..zoo.loading import transformers_id


@dataclass(frozen=True)
class ServeSettings:
    """What the model process needs to build the H2O model: the config as a rule string (it pickles as text),
    the compile choice and the rows' sizing."""

    config: str
    compile: object = "auto"
    max_batch_size: int = 8
    max_seq_len: Optional[int] = None

    def check(self) -> H2OConfig:
        """The H2OConfig, and the sizing checked before any model loads (ValueError naming the bad value)."""
        config = H2OConfig.parse(self.config)
        if isinstance(self.max_batch_size, bool) or not isinstance(self.max_batch_size, int) or self.max_batch_size < 1:
            raise ValueError(f"max_batch_size={self.max_batch_size!r} must be an int >= 1")
        if self.max_seq_len is not None and (isinstance(self.max_seq_len, bool) or not isinstance(self.max_seq_len, int)
                                             or self.max_seq_len < 2):
            raise ValueError(f"max_seq_len={self.max_seq_len!r} must be an int >= 2 (prompt + max_tokens) or None")
        if self.max_seq_len is None and (isinstance(config.budget, float) or config.policy == "full"):
            raise ValueError(f"budget={config.budget!r} is a share of a length: give --max-seq-len (the longest "
                             "prompt + max_tokens a request may take) or an int budget (slots per row)")
        if config.splits_by_prompt:
            raise ValueError(f"allocation={config.allocation!r} sizes each request's cache from its prompt; the "
                             "server's rows share one state: serve a calibrated split (h2o-compile calibrate)")
        return config


class H2OModelLoader(ModelLoader):
    """transformers' ModelLoader (its device, dtype and attention settings) whose models come back optimized."""

    def __init__(self, base: ModelLoader, settings: ServeSettings):
        self.__dict__.update(vars(base))
        self.settings = settings

    def load_config(self, model_id: str):
        return super().load_config(transformers_id(model_id))

    def load_processor(self, model_id: str):
        return super().load_processor(transformers_id(model_id))

    def _load_model(self, model_id: str, tqdm_class=None, progress_callback=None):
        model = super()._load_model(transformers_id(model_id), tqdm_class=tqdm_class,
                                    progress_callback=progress_callback)
        opt = optimize(model.eval(), config=self.settings.check(), compile=self.settings.compile)
        return ServedModel(opt, self.settings)


class ServedModel:
    """The H2OModel as transformers' model process uses it: its config, device and generation config, and
    ``init_continuous_batching`` building a :class:`ServedManager` of the server's rows."""

    def __init__(self, opt, settings: ServeSettings):
        self.opt, self.settings = opt, settings

    @property
    def config(self):
        return self.opt.config

    @property
    def device(self):
        return self.opt.device

    @property
    def generation_config(self):
        return self.opt.generation_config

    def generate(self, *args, **kwargs):
        """What transformers' one-request-at-a-time runner calls (for a model it does not batch continuously)."""
        return self.opt.generate(*args, **kwargs)

    def init_continuous_batching(self, continuous_batching_config=None, workload_hints=None, **kwargs):
        manager = ServedManager(self.opt, max_batch_size=self.settings.max_batch_size,
                                max_seq_len=self.settings.max_seq_len)
        opt = self.opt
        per_row = sum(opt.stream.layer_nbytes()) / manager.rows
        print(f"H2O continuous batching: {manager.rows} rows x {manager.capacity} slots per layer "
              f"(slots by layer: {opt.stream.slots}); {per_row / 2**20:.2f} MiB of H2O state per row, "
              f"{opt.kv_cache_bytes() / 2**20:.2f} MiB in all", flush=True)
        return manager


_SAMPLING = {"temperature": float, "top_k": int, "top_p": float}


class ServedManager(ContinuousBatchingManager):
    """The manager with what transformers' ``CBGenerateRunner`` reads besides the manager API: the per-request
    sampling settings it may pass (``logit_processor.supported_keys``), the worker's fatal error
    (``background_thread_status``), the rows in use (``batch_processor``, for its stats line)."""

    logit_processor = SimpleNamespace(supported_keys=_SAMPLING)

    @property
    def background_thread_status(self):
        return SimpleNamespace(fatal_error=self.error)

    @property
    def batch_processor(self):
        running = [r for r in self._slots if r is not None]
        free = 1 - len(running) / self.rows
        return SimpleNamespace(cache=SimpleNamespace(compute_free_capacity=lambda: free),
                               scheduler=SimpleNamespace(active_requests=running, waiting_requests=list(self._waiting)))

    def add_request(self, input_ids, request_id: Optional[str] = None, max_new_tokens: Optional[int] = None, *,
                    streaming: bool = False, eos_token_id=None, temperature: Optional[float] = None,
                    top_k: Optional[int] = None, top_p: Optional[float] = None, **kwargs) -> str:
        """transformers' runner passes ``top_k=1`` for greedy, else the request's temperature / top-k / top-p."""
        sampling = {name: value for name, value in (("temperature", temperature), ("top_k", top_k), ("top_p", top_p))
                    if value is not None}
        greedy = sampling.get("top_k") == 1
        options = {"do_sample": False} if greedy else {"do_sample": True, **sampling}
        if eos_token_id is not None:
            options["eos_token_id"] = eos_token_id
        return super().add_request(input_ids, request_id, max_new_tokens, streaming=streaming, **options, **kwargs)


class H2OServe(Serve):
    """transformers' ``Serve`` with :class:`H2OModelLoader` in place of its loader (``Serve`` runs the server
    from ``__init__``: pass its keyword arguments and ``settings``)."""

    def __init__(self, settings: ServeSettings, **kwargs):
        self.h2o_settings = settings
        super().__init__(**kwargs)

    def run(self, socket=None, engine_connection=None) -> None:
        if not isinstance(self.loader, H2OModelLoader):
            self.loader = H2OModelLoader(self.loader, self.h2o_settings)
        super().run(socket, engine_connection)


def serve(model: str, settings: ServeSettings, *, host: str = "127.0.0.1", port: int = 8000, dtype: str = "auto",
          log_level: str = "info") -> None:
    """Run the server (blocks until stopped): transformers' routes, ``model`` its only model, H2O continuous
    batching with ``settings``."""
    settings.check()
    H2OServe(settings, force_model=model, continuous_batching=True, host=host, port=port, dtype=dtype,
             device="auto" if torch.cuda.is_available() else "cpu", log_level=log_level, model_timeout=-1)
