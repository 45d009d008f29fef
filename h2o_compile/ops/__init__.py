"""The op boundary: ``torch.ops.h2o.*`` (registered on import, ops/library.py), its schema declared once
(ops/schema.py) and the choice of the kernels behind it (ops/dispatch.py)."""

from .library import check_inputs, decode_fusable_
from .schema import H2O_ATTENTION, PARAMS, PARAMS_AT

__all__ = ["H2O_ATTENTION", "PARAMS", "PARAMS_AT", "check_inputs", "decode_fusable_"]
