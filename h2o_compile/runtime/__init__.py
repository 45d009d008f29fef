"""The runtime: :class:`H2OModel` (its stream, generation, compilation, the transformers interface and
continuous batching) and :func:`optimize`, which builds one."""

from .compiling import decode_step_graph
from .model import H2OModel, optimize, resolve_config

__all__ = ["H2OModel", "decode_step_graph", "optimize", "resolve_config"]
