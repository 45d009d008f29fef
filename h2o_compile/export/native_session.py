"""Choosing the native H2OAttention kernel for an ONNX Runtime session (H2OOrtModel's ``native=`` option).

The same exported file serves both paths: with the custom-op library registered, ONNX Runtime runs the node
with our kernel; without it, it inlines the model-local function (tests/export/test_native_op.py measures
this). A file exported with ``op="native"`` has no function body and needs the library.

In-place state: the kernel reads a (row, KV head)'s whole cache before writing any of it and rewrites only
the slots that change, so when every state input feeds only H2OAttention nodes and every state output comes
straight from one, the past and present tensors can be one buffer (the model binds each state OrtValue as
both input and output): a decode step then copies no cache at all. The function path never does this (its
ops may read a cache after another op wrote the output).
"""

from __future__ import annotations

import logging
from pathlib import Path

from .onnx_function import DOMAIN, FUNCTION_NAME

NATIVE_CHOICES = ("auto", True, False)
_MARK = "h2o_compile.native_library"  # session config entry: the library registered on these options
_log = logging.getLogger(__name__)


def library_for(provider: str) -> Path:
    """The custom-op library for ``provider`` (compiled on first use); NativeBuildError when it cannot be."""
    from .native import build

    if provider == "CUDAExecutionProvider":
        return build.cuda_library_path()
    return build.library_path()


def choose(native, provider: str, meta: dict, session_options):
    """Register the library on ``session_options`` (a new SessionOptions if None) when ``native`` asks for it.

    Returns (session_options, used). native: "auto" = when the provider is CPU and the library builds (else
    the function, with a log line); True = required (NativeBuildError / ValueError otherwise); False = never.
    """
    import onnxruntime as ort

    from .native import NativeBuildError

    if native not in NATIVE_CHOICES:
        raise ValueError(f"native={native!r}; allowed: 'auto', True, False")
    needs = meta.get("op") == "native"
    if native is False and needs:
        raise ValueError("this model was exported with op='native' (no function body): it needs the native op; "
                         "load it with native=True or 'auto', or export again with op='function'")
    want = native is True or needs or (native == "auto" and provider == "CPUExecutionProvider")
    if not want:
        return session_options, False
    try:
        path = library_for(provider)
    except NativeBuildError:
        if native is True or needs:
            raise
        _log.warning("native H2OAttention op unavailable; running the ONNX function", exc_info=True)
        return session_options, False
    if session_options is None:
        session_options = ort.SessionOptions()
    # Registering twice on one SessionOptions adds the domain twice, and ONNX Runtime then refuses to create
    # the session ("Domain already set in registry"): a config entry remembers that this one has it.
    try:
        registered = session_options.get_session_config_entry(_MARK)
    except Exception:  # noqa: BLE001 - a missing entry raises (its type varies across versions)
        registered = ""
    if registered != str(path):
        session_options.register_custom_ops_library(str(path))
        session_options.add_session_config_entry(_MARK, str(path))
    return session_options, True


def state_in_place(model_path: Path, past: list[str], present: list[str]) -> bool:
    """Whether each past state input feeds only H2OAttention nodes (at the state positions 5..8; a Shape node
    may read its shape too) and each
    present output is an H2OAttention state output (1..4): then one buffer can be both (module docstring)."""
    import onnx

    graph = onnx.load(str(model_path), load_external_data=False).graph
    state_in, state_out = set(past), set(present)
    produced, consumed = set(), set()
    for node in graph.node:
        h2o = node.domain == DOMAIN and node.op_type == FUNCTION_NAME
        shape_only = node.op_type == "Shape" and node.domain in ("", "ai.onnx")  # reads no data
        for i, name in enumerate(node.input):
            if name in state_in:
                if not (h2o and 5 <= i <= 8) and not shape_only:
                    return False
                consumed.add(name)
        for i, name in enumerate(node.output):
            if name in state_out:
                if not (h2o and 1 <= i <= 4):
                    return False
                produced.add(name)
    graph_outputs = [o.name for o in graph.output]
    return produced == state_out and consumed <= state_in and len(set(graph_outputs)) == len(graph_outputs)
