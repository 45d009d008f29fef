"""The decode-benchmark contenders: transformers' own caches and H2OModel, behind one small protocol.

    prepare(batch, total, context, seed)  allocate a cache sized for ``total`` tokens and fill it synthetically
                                          with ``context`` tokens (random keys/values, see ``synthetic_kv``)
    restore()                             put the cache back to those ``context`` tokens after a timed block
    cached_tokens()                       how many tokens the cache says it has seen (a fairness check)
    step(tokens [B, 1], position) -> [B, V]   one decode step, logits of the new token
    prefill(prompt [1, P], total) -> float    seconds of a real forward over a prompt into a fresh cache
    cache_bytes()                         bytes the cache holds, from tensor sizes
    kv_read_bytes(context)                bytes of cache the attention reads in one step at ``context`` tokens
    release()                             drop the cache

Why synthetic fill: a real 4k-token prefill at batch 8 per contender costs minutes on a small CPU, and the
decode step's cost does not depend on the cached values: transformers' step reads every cached key/value, and
the H2O step is static-shape and branch-free (attend over C slots, argmin, scatter). So every contender gets
the same random keys/values (one generator seed per layer), HF caches through their ``update`` API and H2O by
writing its state buffers in place, with positions and scores set as a real run would leave them.
"""

from __future__ import annotations

import inspect
import math
import time

import torch
from torch import Tensor, nn

from .machine import synchronize
from ..kernels.quantized import quantize
from ..runtime import optimize
from ..runtime.compiling import compile_step


def kv_geometry(model: nn.Module) -> tuple[int, int, int]:
    """(layers, KV heads, head dim) of a transformers decoder from its config."""
    cfg = model.config
    heads = cfg.num_attention_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    return cfg.num_hidden_layers, getattr(cfg, "num_key_value_heads", None) or heads, head_dim


def synthetic_kv(layer: int, batch: int, kv_heads: int, context: int, head_dim: int, value_dim: int,
                 dtype: torch.dtype, seed: int, device=None) -> tuple[Tensor, Tensor]:
    """Random keys [B, Hkv, context, D] and values [B, Hkv, context, Dv]; the same for every contender. Drawn on
    ``device`` with its own generator: a GPU run fills large batches in milliseconds, not minutes."""
    gen = torch.Generator(device=device or "cpu").manual_seed(seed * 100_003 + layer)
    keys = torch.randn(batch, kv_heads, context, head_dim, generator=gen, device=device).to(dtype)
    values = torch.randn(batch, kv_heads, context, value_dim, generator=gen, device=device).to(dtype)
    return keys, values


def synthetic_positions(policy: str, capacity: int, recent: int, context: int, batch: int, kv_heads: int,
                        seed: int, device=None) -> Tensor:
    """Positions [B, Hkv, n] (n = min(C, context), sorted) a cache of C slots holds after ``context`` tokens.

    ``h2o``: the recent window plus C - R heavy hitters drawn at random from the older tokens (which ones
    depends on attention, not on the cost of the step); ``full``: every token; other policies: the newest C.
    """
    n = min(capacity, context)
    if n == context:
        return torch.arange(context, device=device).expand(batch, kv_heads, context).clone()
    if policy == "h2o":
        gen = torch.Generator(device=device or "cpu").manual_seed(seed + 7)
        older = context - recent
        draws = torch.rand(batch, kv_heads, older, generator=gen, device=device)
        heavy = draws.argsort(-1)[..., :n - recent].sort(-1).values
        newest = torch.arange(older, context, device=device).expand(batch, kv_heads, recent)
        return torch.cat([heavy, newest], dim=-1)
    return torch.arange(context - n, context, device=device).expand(batch, kv_heads, n).clone()


class HFContender:
    """transformers' decoder with DynamicCache (eager forward) or StaticCache (forward under torch.compile,
    the gpt-fast recipe: fullgraph, static shapes; the prefill stays eager as in transformers' generate)."""

    def __init__(self, model: nn.Module, static: bool, compile: bool | str = True, window: float | None = None,
                 name: str | None = None):
        """``compile``: True (torch.compile's default mode) or a torch.compile mode such as "reduce-overhead"
        (CUDA graphs). ``name`` overrides the contender's name (one model timed in several modes).
        ``window``: a StaticCache of only ceil(window x total) slots holding the newest tokens, without any
        eviction logic: what attention over an H2O-sized cache costs in transformers, a floor for H2O's step
        (not a method: it simply forgets everything older than the window, and is timed like the others)."""
        self.model, self.static, self.compile = model, static or window is not None, compile and static
        self.window = window
        self.name = "hf-static-compile" if static else "hf-dynamic"
        self.mode = compile if isinstance(compile, str) else None
        self.label = (("transformers StaticCache + torch.compile" if self.compile else
                       "transformers StaticCache (not compiled)") if static else "transformers eager DynamicCache")
        if window is not None:
            self.name += f"@{window:g}"
            self.label += f" over only {window:g} of the sequence (cost floor, no eviction)"
        if self.mode:
            self.label += f" (mode {self.mode})"
        self.name = name or self.name
        self.policy, self.capacity = "full", None
        self.prefill_supported = window is None
        self.cache = None
        self._fn = None
        # transformers renamed forward's past_key_values to cache (5.24); pass whichever this version takes.
        params = inspect.signature(model.forward).parameters
        self._cache_arg = "cache" if "cache" in params else "past_key_values"
        self._offset = 0  # harness positions - cache positions (nonzero for a window)

    def _new_cache(self, total: int):
        from transformers import DynamicCache, StaticCache

        if self.static:
            return StaticCache(config=self.model.config, max_cache_len=total)
        return DynamicCache(config=self.model.config)

    def prepare(self, batch: int, total: int, context: int, seed: int) -> None:
        layers, kv_heads, head_dim = kv_geometry(self.model)
        weight = next(self.model.parameters())
        if self.window is not None:
            slots = math.ceil(self.window * total)
            if slots <= total - context:
                raise ValueError(f"window {self.window} of {total} tokens leaves no room for {total - context} steps")
            self._offset = context - (slots - (total - context))
            total, context = slots, slots - (total - context)
        self.cache = self._new_cache(total)
        for i in range(layers):
            keys, values = synthetic_kv(i, batch, kv_heads, context, head_dim, head_dim, weight.dtype, seed,
                                        weight.device)
            self.cache.update(keys, values, i)
        self.batch, self.total, self.context, self.capacity = batch, total, context, total
        if self._fn is None:
            self._fn = (compile_step(self.model.forward, self.mode or "default", weight.device) if self.compile
                        else self.model.forward)

    def cached_tokens(self) -> int:
        return int(self.cache.get_seq_length()) + self._offset

    def restore(self) -> None:
        extra = int(self.cache.get_seq_length()) - self.context
        if extra <= 0:
            return
        try:
            self.cache.crop(-extra)  # static: rewinds the write index; dynamic: drops the appended tokens
        except AttributeError:
            # Older transformers (< 5.24) have no StaticLayer.crop: rewind the write index it keeps itself.
            for layer in self.cache.layers:
                if not hasattr(layer, "cumulative_length"):
                    raise
                layer.cumulative_length.sub_(extra)

    @torch.no_grad()
    def step(self, tokens: Tensor, position: int) -> Tensor:
        tokens = tokens.to(self.model.device)
        pos = torch.full_like(tokens, position - self._offset)                  # [B, 1]
        kwargs = {self._cache_arg: self.cache}
        return self._fn(input_ids=tokens, position_ids=pos, use_cache=True, **kwargs).logits[:, -1]

    @torch.no_grad()
    def prefill(self, prompt: Tensor, total: int) -> float:
        cache = self._new_cache(total)
        prompt = prompt.to(self.model.device)
        start = time.perf_counter()
        logits = self.model(input_ids=prompt, use_cache=True, **{self._cache_arg: cache}).logits
        synchronize(logits.device)
        return time.perf_counter() - start

    def cache_bytes(self) -> int:
        """Keys and values of ``total`` tokens: the static buffer, or what the dynamic cache holds at the end."""
        layers, kv_heads, head_dim = kv_geometry(self.model)
        tokens = self.total
        itemsize = next(self.model.parameters()).dtype.itemsize
        return layers * self.batch * kv_heads * tokens * 2 * head_dim * itemsize

    def kv_read_bytes(self, context: int) -> int:
        """Keys and values SDPA reads: the cached tokens plus the new one (dynamic), the whole buffer (static:
        attention runs over max_cache_len with a mask)."""
        layers, kv_heads, head_dim = kv_geometry(self.model)
        tokens = self.total if self.static else context + 1
        itemsize = next(self.model.parameters()).dtype.itemsize
        return layers * self.batch * kv_heads * tokens * 2 * head_dim * itemsize

    def release(self) -> None:
        self.cache = None


class H2OContender:
    """An H2OModel (``optimize(model, budget, policy=...)``) whose one-token decode step is compiled."""

    def __init__(self, model: nn.Module, policy: str, budget: float, compile: bool | str = True,
                 name: str | None = None, kv_dtype: str = "model"):
        """``compile``: as ``optimize`` (True, False or a torch.compile mode); ``name`` overrides the name;
        ``kv_dtype="int8"``: int8 kept entries (name suffix ``+int8``)."""
        self.policy, self.budget, self.quantized = policy, budget, kv_dtype == "int8"
        suffix = "+int8" if self.quantized else ""
        self.name = name or ("h2o-full" if policy == "full" else f"{policy}@{budget:g}") + suffix
        self.label = f"H2OModel {policy}@{budget:g}{suffix}" + (
            f" (compiled, mode {compile})" if isinstance(compile, str) else " (compiled)" if compile else "")
        self.h2o = optimize(model, budget=budget, policy=policy, compile=compile, kv_dtype=kv_dtype)
        self.prefill_supported = True
        self.capacity = None
        self._snapshot: list[tuple[Tensor, Tensor]] = []

    def _layer_state(self, i: int) -> list[Tensor]:
        return self.h2o.layer_states()[i]

    def prepare(self, batch: int, total: int, context: int, seed: int) -> None:
        h = self.h2o
        h.reset(batch, total)
        cap = h.stream.capacity
        recent = h.h2o_config.recent_window(cap)
        self._snapshot = []
        for i, spec in enumerate(h.layers):
            key, value, score, pos, *scales = self._layer_state(i)
            keys, values = synthetic_kv(i, batch, spec.kv_heads, context, spec.head_dim, spec.value_dim,
                                        spec.dtype, seed, key.device)
            kept = synthetic_positions(self.policy, cap, recent, context, batch, spec.kv_heads, seed + i, key.device)
            n = kept.shape[-1]
            kept_keys = keys.gather(2, kept[..., None].expand(-1, -1, -1, spec.head_dim))
            kept_values = values.gather(2, kept[..., None].expand(-1, -1, -1, spec.value_dim))
            if scales:  # int8 entries: stored as the cache stores them
                (kept_keys, scales[0][:, :, :n]), (kept_values, scales[1][:, :, :n]) = (quantize(kept_keys),
                                                                                        quantize(kept_values))
            key[:, :, :n] = kept_keys
            value[:, :, :n] = kept_values
            pos[:, :, :n] = kept
            gen = torch.Generator(device=key.device).manual_seed(seed + 1000 + i)
            score[:, :, :n] = torch.rand(batch, spec.kv_heads, n, generator=gen, device=key.device) * 4.0
            # Kept off the device: a GPU memory measurement must not count the benchmark's own snapshot.
            self._snapshot.append((score.to("cpu", copy=True), pos.to("cpu", copy=True)))
        h.stream.set_length(context)
        self.batch, self.total, self.context, self.capacity = batch, total, context, cap

    def cached_tokens(self) -> int:
        return int(self.h2o.stream.seen[0])

    def restore(self) -> None:
        """Scores and positions back to the filled state; keys/values of the slots written during the block
        stay (the step's cost does not depend on them)."""
        for i, (score0, pos0) in enumerate(self._snapshot):
            _, _, score, pos, *_ = self._layer_state(i)
            score.copy_(score0)
            pos.copy_(pos0)
        self.h2o.stream.set_length(self.context)

    def step(self, tokens: Tensor, position: int) -> Tensor:
        # H2OModel derives the position from its own counter (seen); the harness checks they agree.
        return self.h2o.step(tokens)[:, -1]

    def prefill(self, prompt: Tensor, total: int) -> float:
        self.h2o.reset(prompt.shape[0], total)
        start = time.perf_counter()
        synchronize(self.h2o.step(prompt).device)
        return time.perf_counter() - start

    def cache_bytes(self) -> int:
        return self.h2o.kv_cache_bytes()

    def kv_read_bytes(self, context: int) -> int:
        """The whole state (keys, values, scores, positions of C slots): the static-shape step reads all of it."""
        return self.h2o.kv_cache_bytes()

    def release(self) -> None:
        self._snapshot = []
        self.h2o.stream = None


def build_contenders(model: nn.Module, budgets, local_budget: float, compile: bool = True,
                     only: set | None = None, int8: bool = False) -> list:
    """Every contender of the benchmark, in a fixed base order (the harness alternates it between repeats);
    ``int8`` adds H2O with int8 entries at each budget (``h2o@<b>+int8``)."""
    specs = [("hf-dynamic", lambda: HFContender(model, static=False)),
             ("hf-static-compile", lambda: HFContender(model, static=True, compile=compile)),
             (f"hf-static-compile@{local_budget:g}",
              lambda: HFContender(model, static=True, compile=compile, window=local_budget)),
             ("h2o-full", lambda: H2OContender(model, "full", 1.0, compile)),
             (f"local@{local_budget:g}", lambda: H2OContender(model, "local", local_budget, compile))]
    specs += [(f"h2o@{b:g}", (lambda b=b: H2OContender(model, "h2o", b, compile))) for b in budgets]
    if int8:
        specs += [(f"h2o@{b:g}+int8", (lambda b=b: H2OContender(model, "h2o", b, compile, kv_dtype="int8")))
                  for b in budgets]
    return [make() for name, make in specs if only is None or name in only]
