"""What every backend serves (:data:`CAPABILITIES`): which scores, prompt options, entry dtypes and position
schemes. ``optimize`` and ``export_onnx`` check a configuration against it (:func:`check_served`) before any
work; ops/dispatch.py decides which backend runs."""

from __future__ import annotations

from dataclasses import dataclass

from ..kernels.rules import SCORES


@dataclass(frozen=True)
class Capability:
    """What one backend serves: every registered score (the torch paths call the registry), or with ``onnx_scores``
    those whose registry entry has an ONNX / C++ code;
    ``prompt_options``: SnapKV's prompt window and pooling (they need to know which block is the prompt)."""

    onnx_scores: bool = False  # only the scores with an ``onnx_code`` (the ONNX function and h2o_rule.h compute)
    prompt_options: bool = True
    kv_dtypes: tuple[str, ...] = ("model", "int8")
    positions: tuple[str, ...] = ("true", "rolling", "capped")
    allocations: tuple[str, ...] = ("uniform", "calibrated", "prompt", "prompt-heads")  # a tuple: "calibrated"
    why_not: str = ""  # said with every refusal

    def serves_score(self, score: str) -> bool:
        return not self.onnx_scores or SCORES[score].onnx_code is not None


_ONNX_WHY = ("the exported graph has no input that marks the prompt block, its state is sized from the export's "
             "metadata before any prompt is read, and the rule's arithmetic is written out in ONNX "
             "(export/onnx_function.py) and C++ (export/native/h2o_rule.h) for the scores listed there only")
_ONNX = Capability(onnx_scores=True, prompt_options=False, allocations=("uniform", "calibrated"), why_not=_ONNX_WHY)

# The backends a user can end up on: optimize() runs the first four (by device and compile), export_onnx() the
# last three (H2OOrtModel picks the native op when its library is built). "native CPU ops" compute the attention
# and mass only; the rule around them is the torch code, so they serve what the reference serves.
CAPABILITIES: dict[str, Capability] = {
    "reference": Capability(),
    "compiled CPU step": Capability(),
    "native CPU ops": Capability(),
    "Triton": Capability(),
    "ONNX function": _ONNX,
    "native ORT CPU": _ONNX,
    "native ORT CUDA": _ONNX,
}


def served_by(config) -> list[str]:
    """The backends that serve every setting of ``config`` (an H2OConfig)."""
    return [name for name in CAPABILITIES if not _refusals(config, CAPABILITIES[name])]


def _refusals(config, cap: Capability) -> list[str]:
    rule = config.rule
    scores = [rule.score] + ([rule.sliding_score] if rule.sliding_score else [])
    refused = [f"score={s!r}" for s in scores if config.policy == "h2o" and not cap.serves_score(s)]
    if config.scores_prompt_specially and not cap.prompt_options:
        refused.append(f"prompt_window={rule.prompt_window} / prompt_pool={rule.prompt_pool}")
    if config.kv_dtype not in cap.kv_dtypes:
        refused.append(f"kv_dtype={config.kv_dtype!r}")
    if config.positions not in cap.positions:
        refused.append(f"positions={config.positions!r}")
    allocation = "calibrated" if isinstance(config.allocation, tuple) else config.allocation
    if allocation not in cap.allocations:
        refused.append(f"allocation={allocation!r}")
    return refused


def check_served(config, backend: str) -> None:
    """ValueError naming what ``backend`` does not serve of ``config`` and the backends that serve it."""
    if backend not in CAPABILITIES:
        raise ValueError(f"backend={backend!r}; known: {', '.join(CAPABILITIES)}")
    cap = CAPABILITIES[backend]
    refused = _refusals(config, cap)
    if refused:
        why = f" ({cap.why_not})" if cap.why_not else ""
        raise ValueError(f"{', '.join(refused)} is not served by the {backend}{why}; served by: "
                         f"{', '.join(served_by(config)) or 'no backend'}")


def capability_table() -> str:
    """The table as Markdown: one row per backend, one column per registered score, then the other options."""
    head = ["backend"] + [f"score={s}" for s in SCORES] + ["prompt window / pool", "int8 entries", "positions",
                                                           "allocation"]
    rows = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for name, cap in CAPABILITIES.items():
        cells = [name] + ["yes" if cap.serves_score(s) else "refused" for s in SCORES]
        cells += ["yes" if cap.prompt_options else "refused", "yes" if "int8" in cap.kv_dtypes else "refused",
                  ", ".join(cap.positions), ", ".join(cap.allocations)]
        rows.append("| " + " | ".join(cells) + " |")
    return "\n".join(rows)
