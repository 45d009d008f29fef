"""How H2OModel compiles its decode step: torch.compile settings shared with the benchmarks."""

from __future__ import annotations

import contextlib

import torch
from torch import nn

from ..graph.passes import fuse_decode_bookkeeping, weight_major_linears
from ..graph.passes.layer_regions import regional_graph
from ..kernels import native_cpu
from ..ops.dispatch import compiled_step_plan, freezes_weights

_COMPILE_MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")
_COMPILE_CHOICES = ("auto", True, False) + _COMPILE_MODES


# The decode step's sizes that change between requests, as dynamo names the inputs of H2OModel's graph: the
# recent windows (ints), the cache slots (dim 2 of every state tensor) and the batch (dim 0 of every input) are
# dynamic; compile_step makes the batch size-oblivious, so that a batch of one does not get a graph of its own.
# Everything else (head counts, head dims, the one-token block) stays static, as do the weights.
DYNAMIC_SOURCES = (r"L\['recent\d+'\],L\['layer\d+_.*'\]:2,L\['(input_ids|position_ids|valid|layer\d+_.*)'\]:0,"
                   # compiled by layer (passes/layer_regions.py): values one region passes to another
                   r"L\['act\d+'\]:0")


def decode_step_graph(graph: torch.fx.GraphModule, mode: str, device: torch.device) -> torch.fx.GraphModule:
    """The graph H2OModel compiles for its one-token step in ``mode``, as ops/dispatch.py's
    :func:`~h2o_compile.ops.dispatch.compiled_step_plan` says: a copy sharing the weights whose eviction
    bookkeeping is plain torch ops Inductor fuses, and whose linear layers are weight-major
    (passes/weight_major_linear.py); the graph itself where the backend fuses the step on its own (Triton)."""
    plan = compiled_step_plan(mode, device)
    if not plan.fuse_bookkeeping:
        return graph
    step = fuse_decode_bookkeeping(graph, native=plan.native)
    if plan.weight_major:
        weight_major_linears(step, native=plan.native)
    return step


def compile_step(fn, mode: str, device: torch.device, dynamic: bool = False):
    """``fn`` under torch.compile (fullgraph) in ``mode``, as H2OModel compiles its decode step; ``dynamic``
    compiles one graph for every size of its inputs (H2OModel: batch and cache slots, see ``_decode_fn``).

    On CPU, ``"max-autotune"`` also freezes the weights: they become constants of the compiled step, which
    lets Inductor prepack them for its GEMM templates (the small-batch decode matmuls are what this speeds up;
    the packed copy costs a second copy of the weights in memory, and changing the weights afterwards needs
    a new compile)."""
    compiled = torch.compile(fn, fullgraph=True, dynamic=False, options=_options(fn, mode))
    return _under(_patches(mode, device, dynamic), compiled)


def compile_step_by_layer(gm: torch.fx.GraphModule, mode: str, device: torch.device):
    """The decode step ``gm`` split at its decoder layers (passes/layer_regions.py), each distinct layer
    compiled once (dynamic shapes, as :func:`compile_step`) and run for every layer of its kind. Returns the
    step and the number of distinct regions compiled. Raises ValueError where the split does not apply: a
    mode that freezes the weights (they are a region's inputs here) or a graph whose layers interleave."""
    if freezes_weights(mode, device):
        raise ValueError(f"mode={mode!r} freezes the weights into the step; it compiles whole, not by layer")
    options = _options(None, mode)

    def compile_region(region: torch.fx.GraphModule):
        return torch.compile(region, fullgraph=True, dynamic=False, options=options)

    step, distinct = regional_graph(gm, compile_region)
    return _under(_patches(mode, device, dynamic=True), step), distinct


def _options(fn, mode: str) -> dict:
    options = dict(torch._inductor.list_mode_options(mode))
    skip_module_guards = getattr(torch.compiler, "skip_guard_on_all_nn_modules_unsafe", None)  # torch >= 2.8
    if isinstance(fn, nn.Module) and skip_module_guards is not None:
        # The graph's weights never change under a compiled step: skip re-checking every parameter per call.
        options["guard_filter_fn"] = skip_module_guards
    return options


def _patches(mode: str, device: torch.device, dynamic: bool) -> list:
    patches = []
    if dynamic:
        patches.append(torch.compiler.config.patch(dynamic_sources=DYNAMIC_SOURCES))
        patches.append(torch.fx.experimental._config.patch(use_duck_shape=False, backed_size_oblivious=True))
    if freezes_weights(mode, device):
        patches.append(torch._inductor.config.patch(freezing=True))
    if device.type == "cpu" and native_cpu.available():
        # Inductor asks which vector instruction sets the C++ compiler can build for by compiling and loading a
        # probe per set, on the first compile of every process (a cold compile's largest fixed cost on CPU).
        # The native ops were built with -march=native for this CPU and loaded, which answers that question:
        # trust the CPU's flags.
        patches.append(torch._inductor.config.patch({"cpp.vec_isa_ok": True}))
    return patches


def _under(patches: list, compiled):
    if not patches:
        return compiled

    def patched_step(*args, **kwargs):
        # Dynamo and Inductor read these configs when they compile, which happens lazily at a call, so every
        # call runs under the patches (~30 us each).
        with contextlib.ExitStack() as stack:
            for patch in patches:
                stack.enter_context(patch)
            return compiled(*args, **kwargs)

    return patched_step


def check_compile(compile) -> None:
    """``compile`` of optimize / H2OModel: "auto" (eager on CPU, CUDA graphs on GPU), a bool, or a mode."""
    if isinstance(compile, bool) or (isinstance(compile, str) and compile in _COMPILE_CHOICES):
        return
    raise ValueError(f"compile={compile!r}; allowed: 'auto', True, False or a torch.compile mode "
                     f"({', '.join(map(repr, _COMPILE_MODES))})")


def check_regional_compile(regional_compile) -> None:
    """``regional_compile`` of optimize / H2OModel: a bool."""
    if not isinstance(regional_compile, bool):
        raise ValueError(f"regional_compile={regional_compile!r}; allowed: True or False")
