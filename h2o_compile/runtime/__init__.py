"""The runtime: :class:`H2OModel` (its stream, generation, compilation, the transformers interface and
continuous batching) and :func:`optimize`, which builds one."""

from .compiling import decode_step_graph
from .allocation import calibrate
from .model import H2OModel, optimize

__all__ = ["H2OModel", "calibrate", "decode_step_graph", "optimize"]
