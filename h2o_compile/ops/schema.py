"""The h2o attention op's arguments, declared once.

Everything that speaks the op derives from :data:`H2O_ATTENTION`: the torch.library schemas of
``h2o::attention_`` and ``h2o::attention`` (ops/library.py), their fake implementations, the compiled CPU step's
``decode_fusable_``, the ONNX translation (export/onnx.py) and the graph passes, which read an argument's
position (:meth:`OpSchema.index`) instead of counting. Shapes and meaning: kernels/reference.py.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any

REQUIRED = object()


@dataclass(frozen=True)
class Arg:
    """One argument: its name, its torch schema type (``Tensor``, ``Tensor?``, ``float``, ``SymInt``, ``str``;
    SymInt, as torch.library infers for an ``int``, so a compiled graph keeps a varying int symbolic) and its
    default (:data:`REQUIRED` for none)."""

    name: str
    type: str
    default: Any = REQUIRED


@dataclass(frozen=True)
class OpSchema:
    """An op's arguments in order; ``state``: the tensors the in-place flavour mutates."""

    args: tuple[Arg, ...]
    state: tuple[str, ...]

    def __post_init__(self) -> None:
        # Derived once here, not lazily: the compiled decode step traces bind(), and dynamo cannot trace the lock
        # of a cached_property filled on first use (a step compiled before any eager op call would break).
        derived = {"names": tuple(a.name for a in self.args),
                   "_defaults": {a.name: a.default for a in self.args if a.default is not REQUIRED},
                   "_required": frozenset(a.name for a in self.args if a.default is REQUIRED)}
        derived["_known"] = frozenset(derived["names"])
        for name, value in derived.items():
            object.__setattr__(self, name, value)

    def index(self, name: str) -> int:
        """The position of argument ``name`` in a call."""
        return self.names.index(name)

    def torch_schema(self, returns: str, mutating: bool) -> str:
        """The torch.library schema string; ``mutating`` marks the state tensors as written in place (each its own
        alias set: they never alias each other)."""
        parts = []
        for i, a in enumerate(self.args):
            kind = a.type.replace("Tensor", f"Tensor(a{i}!)", 1) if mutating and a.name in self.state else a.type
            default = "" if a.default is REQUIRED else f"={'None' if a.default is None else a.default}"
            parts.append(f"{kind} {a.name}{default}")
        return f"({', '.join(parts)}) -> {returns}"

    def bind(self, args: tuple, kwargs: dict) -> dict[str, Any]:
        """``{name: value}`` of a call (positional ``args`` in order, then ``kwargs``, then the defaults);
        TypeError for an unknown or missing argument. Every eager op call binds: a dict merge, not
        ``inspect.Signature.bind`` (several times slower), which only words the errors."""
        bound = dict(zip(self.names, args), **kwargs)
        if (len(args) > len(self.args) or len(bound) < len(args) + len(kwargs)  # too many, or one given twice
                or not self._required <= bound.keys() <= self._known):
            self._signature().bind(*args, **kwargs)  # raises the TypeError that names the argument
        return {**self._defaults, **bound}

    def _signature(self) -> inspect.Signature:
        return inspect.Signature([inspect.Parameter(a.name, inspect.Parameter.POSITIONAL_OR_KEYWORD,
                                                    default=inspect.Parameter.empty if a.default is REQUIRED
                                                    else a.default) for a in self.args])


H2O_ATTENTION = OpSchema(
    args=(
        Arg("q", "Tensor"), Arg("k", "Tensor"), Arg("v", "Tensor"),    # the block: [B, Hq | Hkv, T, D]
        Arg("positions", "Tensor"), Arg("valid", "Tensor?"),           # [B, T] int64, bool (False = padding)
        Arg("key_cache", "Tensor"), Arg("value_cache", "Tensor"),      # the layer's state, [B, Hkv, C, ...]
        Arg("score_cache", "Tensor"), Arg("pos_cache", "Tensor"),
        Arg("scale", "float"),
        # the H2O constants, then the layer's attention kind
        Arg("recent", "SymInt"), Arg("sinks", "SymInt"), Arg("policy", "str"), Arg("seed", "SymInt"),
        Arg("window", "SymInt", 0), Arg("softcap", "float", 0.0), Arg("sink_logits", "Tensor?", None),
        Arg("rope_cos", "Tensor?", None), Arg("rope_sin", "Tensor?", None),   # rolling / capped positions
        Arg("query_from", "Tensor?", None),                                   # the prompt block's window
        Arg("key_scale", "Tensor?", None), Arg("value_scale", "Tensor?", None),  # int8 entries
        Arg("max_distance", "SymInt", 0),
    ),
    state=("key_cache", "value_cache", "score_cache", "pos_cache", "key_scale", "value_scale"),
)
# The H2O constants the passes set per layer (passes/h2o_attention.py), a contiguous run of arguments.
PARAMS = ("recent", "sinks", "policy", "seed")
PARAMS_AT = H2O_ATTENTION.index(PARAMS[0])
