"""Eviction rules tried outside the library: ``h2o-compile`` (usually ``eval``) with one rule patched into the
torch bookkeeping, to learn whether a rule earns a place in every backend before it is built there.

    python research/score_rule_probes.py --probe value-norm -- eval --model gemma3-270m --budgets 0.2 ...

Probes (each changes what policy ``h2o`` computes; every other argument means what it means to the CLI):

    value-norm      A[p] = ||v_p||_1 x the accumulated mass: a key whose value vector is small changes the
                    output little however much attention it draws (value-aware token pruning).
    group-max       a KV head's mass is the max over its query heads' probabilities instead of their sum
                    (decode steps; the prompt block keeps the sum). Runs the reference attention
                    (H2O_COMPILE_NATIVE_CPU=0), so it is slower.
    pyramid=B,T     per-layer budgets on a line from B x C (first layer) to T x C (last layer), C the
                    budget's slots (mean about C), a sliding layer at most its window (PyramidKV's shape).
    global=G        full-attention layers G x C slots, the sliding-window layers what keeps the mean at C
                    (hybrid models with every layer compressed, e.g. Gemma 3 with --compress-sliding). Measured
                    here first; the library now has it (H2OConfig.global_share, the eval rule "global=G").

Results: docs/results/eval_gemma3/probes/README.md.
"""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import os
import sys

import torch


def value_norm() -> None:
    from h2o_compile.kernels import reference
    from h2o_compile.kernels import reference_decode
    from h2o_compile.kernels.state import H2OState

    evict, compress = reference_decode.evict_and_write_, reference.compress

    def norm(v):
        return torch.linalg.vector_norm(v.float(), ord=1, dim=-1)                # [B, Hkv, S]

    def weighted_evict(state, k, v, new_pos, newest, valid, mass_cache, mass_new, **options):
        return evict(state, k, v, new_pos, newest, valid, mass_cache * norm(state.value_cache), mass_new * norm(v),
                     **options)

    def weighted_compress(entries, newest, cap, **options):
        if entries.pos_cache[..., :cap].max() < 0:  # the prompt into an empty cache: weight the prompt's mass
            entries = H2OState(entries.key_cache, entries.value_cache,
                               entries.score_cache * norm(entries.value_cache), entries.pos_cache)
        return compress(entries, newest, cap, **options)

    reference_decode.evict_and_write_, reference.compress = weighted_evict, weighted_compress


def group_max() -> None:
    os.environ["H2O_COMPILE_NATIVE_CPU"] = "0"
    from h2o_compile.kernels import reference_decode

    source = inspect.getsource(reference_decode.attend_decode)
    if "probs.sum(dim=2)" not in source:
        raise SystemExit("reference_decode.attend_decode no longer sums its mass as probs.sum(dim=2); update the probe")
    code = compile(source.replace("probs.sum(dim=2)", "probs.amax(dim=2)"), reference_decode.__file__, "exec")
    exec(code, reference_decode.__dict__)


def layer_shares(shares) -> None:
    """Each layer's slots = its planned slots x ``shares(plan)[layer]`` (a sliding layer at most its window)."""
    from h2o_compile.runtime.cache_plan import CachePlan, LayerPlan

    build = CachePlan.build.__func__

    def shaped(cls, config, specs, limits, **options):
        plan = build(cls, config, specs, limits, **options)
        if plan.max_seq_len is None or plan.capacity >= plan.max_seq_len:  # streams and the full cache as they are
            return plan
        layers = []
        for layer, share in zip(plan.layers, shares(plan)):
            slots = max(2, round(layer.slots * share))
            slots = min(slots, layer.spec.window) if layer.spec.window else slots
            layers.append(LayerPlan(layer.spec, slots, config.recent_window(slots), layer.sinks))
        return dataclasses.replace(plan, layers=tuple(layers))

    CachePlan.build = classmethod(shaped)


def pyramid(bottom: float, top: float) -> None:
    layer_shares(lambda plan: [bottom + (top - bottom) * i / max(1, len(plan.layers) - 1)
                               for i in range(len(plan.layers))])


def global_share(share: float) -> None:
    def shares(plan):
        full = sum(1 for layer in plan.layers if not layer.spec.window)
        sliding = len(plan.layers) - full
        if not sliding:
            raise SystemExit(f"global={share}: the model has no sliding-window layers to take the other share from")
        rest = (len(plan.layers) - share * full) / sliding
        if rest <= 0:
            raise SystemExit(f"global={share}: {full} full-attention layers x {share} leave no slots to the others")
        return [rest if layer.spec.window else share for layer in plan.layers]

    layer_shares(shares)


def apply(probe: str) -> None:
    """Patch ``probe`` in; a ValueError names an unknown one."""
    if probe == "value-norm":
        value_norm()
    elif probe == "group-max":
        group_max()
    elif probe.startswith("pyramid="):
        try:
            bottom, top = (float(x) for x in probe.partition("=")[2].split(","))
        except ValueError:
            raise ValueError(f"--probe {probe!r}: pyramid takes two numbers, pyramid=BOTTOM,TOP") from None
        if min(bottom, top) <= 0:
            raise ValueError(f"--probe {probe!r}: both ends must be > 0")
        pyramid(bottom, top)
    elif probe.startswith("global="):
        try:
            share = float(probe.partition("=")[2])
        except ValueError:
            raise ValueError(f"--probe {probe!r}: global takes one number, global=SHARE") from None
        if share <= 0:
            raise ValueError(f"--probe {probe!r}: the share must be > 0")
        global_share(share)
    else:
        raise ValueError(f"--probe {probe!r}; allowed: value-norm, group-max, pyramid=BOTTOM,TOP, global=SHARE")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--probe", required=True, help="value-norm, group-max, pyramid=BOTTOM,TOP or global=SHARE")
    parser.add_argument("cli", nargs=argparse.REMAINDER, help="-- then the h2o-compile arguments")
    args = parser.parse_args(argv)
    try:
        apply(args.probe)
    except ValueError as error:
        parser.error(str(error))
    from h2o_compile.cli import main as cli_main

    return cli_main(args.cli[1:] if args.cli[:1] == ["--"] else args.cli)


if __name__ == "__main__":
    sys.exit(main())
