"""H2OModel: a captured, rewritten model plus its static-shape H2O state; ``optimize`` builds one."""

from __future__ import annotations

import dataclasses
import warnings
from typing import Optional, Union

import torch
from torch import Tensor, nn

from ..config import H2OConfig, check_served, resolve_config
from ..graph.capture import build_graph
from ..graph.passes import (LayerSpec, cache_rotary_tables, copy_graph_module, last_position_logits,
                            runtime_recent_graph, set_h2o_params, split_kv_heads, weight_major_linears)
from ..graph.support import ModelLimits, check_capped_fits, check_rolling_fits, text_config
from ..graph.tensor_parallel import shard_model
from ..ops.dispatch import backend_for, compile_mode, eager_step_plan, freezes_weights
from . import generation
from .allocation import attention_curves, layer_split
from .cache_plan import CachePlan, head_groups, layer_positions, layer_shares, layer_sinks
from .compiling import check_compile, check_regional_compile, compile_step, compile_step_by_layer, decode_step_graph
from .hf_interface import CausalLMInterface, register_for_pipelines
from .stream import Stream


def _positive_ints(name: str, values) -> list[int]:
    values = [values] if isinstance(values, int) else list(values)
    bad = [v for v in values if isinstance(v, bool) or not isinstance(v, int) or v < 1]
    if bad or not values:
        raise ValueError(f"{name}={values!r} must be ints >= 1")
    return values


class H2OModel(CausalLMInterface, nn.Module):
    """A causal LM whose KV cache holds at most C slots per layer and KV head (see H2OConfig).

    Use it as a transformers causal LM (``generate``, ``pipeline("text-generation", model=...)``,
    ``model(input_ids, labels=...)`` scoring as H2O decodes, ``save_pretrained`` / ``from_pretrained``,
    ``.to()``; h2o_compile/runtime/hf_interface.py), or drive the cache yourself: ``reset(batch_size, max_seq_len)``
    then ``step(input_ids, attention_mask)`` once per block (a prompt, then one token at a time).
    """

    def __init__(self, model: nn.Module, graph: torch.fx.GraphModule, layers: list[LayerSpec], config: H2OConfig,
                 limits: ModelLimits, compile: Union[str, bool] = "auto", regional_compile: bool = False,
                 rank_heads: Optional[tuple[int, int]] = None):
        super().__init__()
        register_for_pipelines(type(self))
        check_compile(compile)
        check_regional_compile(regional_compile)
        self.model = model  # kept for .config / .generation_config; the graph shares its weights
        self.graph = runtime_recent_graph(graph)  # forward(input_ids, position_ids, valid, *state, *recent)
        self.layers = layers
        self.h2o_config = config
        self.limits = limits
        self.compile_mode = compile
        self.regional_compile = regional_compile
        self.stream: Optional[Stream] = None   # the state of the last reset(), runtime/stream.py
        self.rank_heads = rank_heads  # tensor parallelism: (first KV head of this rank, ranks), else None
        # Sinks and rule per layer, and the seed, are the same for every request: constants of the graph, set once.
        set_h2o_params(self.graph, sinks=[layer_sinks(config, spec.window) for spec in layers],
                       policy=config.layer_rules([spec.window for spec in layers]), seed=config.seed)
        # What eager calls run: the graph with its rotary tables (rolling / capped positions) computed once per
        # table size; the compiled step derives from self.graph and fuses them instead.
        self._eager_graph = cache_rotary_tables(self.graph)
        self._compiled_step = None      # built on the first compiled decode step
        self._eager_step_graph = None   # built on the first eager CPU decode step that needs it (_eager_decode_step)
        self._eager_step_native = False  # whether its linears are the native rows_linear
        self._last_logits_graph = None  # built on demand from the graph

    # -- state ---------------------------------------------------------------------------------------------

    @classmethod
    def from_model(cls, model: nn.Module, **kwargs) -> "H2OModel":
        """:func:`optimize` (``from_pretrained`` and ``.to()`` build through it)."""
        return optimize(model, **kwargs)

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    @property
    def config(self):
        return self.model.config

    @property
    def vocab_size(self) -> int:
        return int(text_config(self.model).vocab_size)

    def reset(self, batch_size: int, max_seq_len: Optional[int] = None, *, capacity: Optional[int] = None) -> None:
        """Allocate empty caches for ``batch_size`` rows.

        ``reset(B, max_seq_len)``: C = capacity(max_seq_len) slots for a sequence of at most that many tokens.
        ``reset(B, capacity=C)``: a stream with no end: C slots (sliding-window layers: their window, or
        min(C, W) with compress_sliding) whatever the length fed; memory stays at C plus one block. With
        ``positions="rolling"`` or ``"capped"`` the stream may run forever (distances stay below C + block, or
        at most max(max_distance, block - 1)); with true
        positions a rotary model warns when the stream passes max_position_embeddings, a model with learned
        positions stops there (ValueError).
        """
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"batch_size={batch_size!r} must be an int >= 1")
        if (max_seq_len is None) == (capacity is None):
            raise ValueError(f"give reset() either max_seq_len (a bounded sequence) or capacity (a stream), "
                             f"not {'both' if capacity is not None else 'neither'}")
        if self.rank_heads is None:
            plan = CachePlan.build(self.h2o_config, self.layers, self.limits, max_seq_len=max_seq_len,
                                   capacity=capacity)
        else:
            plan = CachePlan.for_rank(self.h2o_config, self.layers, self.limits, *self.rank_heads,
                                      max_seq_len=max_seq_len, capacity=capacity)
        self.stream = Stream(plan, batch_size, self.device)

    def state(self) -> list[Tensor]:
        """The flat state, per cache (a layer, or a group of a layer's KV heads: ``self.layers[i].layer``): key
        [B, Hkv, C, D], value, score [B, Hkv, C] fp32, position int64 (and with kv_dtype="int8" the key and value
        scales; cache_plan.py)."""
        return self._stream().tensors()

    def layer_states(self) -> list[list[Tensor]]:
        """The state tensors of each cache (cache_plan.py's order), in graph order: one per layer, or per group of
        KV heads of a layer split by heads (``self.layers[i].layer`` and ``.heads`` say which)."""
        return self._stream().layer_states()

    def _stream(self) -> Stream:
        if self.stream is None:
            raise RuntimeError("no cache yet: call reset(batch_size, max_seq_len) or generate() first")
        return self.stream

    def kept_positions(self, layer: int) -> Tensor:
        """LongTensor [B, Hkv, C_layer]: the token position held by each slot of ``layer``, -1 = empty slot (a layer
        split by KV heads: C_layer is its largest group's slots, the smaller groups' rows padded with -1)."""
        return layer_positions(self.layers, [state[3] for state in self.layer_states()], layer)

    def kv_cache_bytes(self) -> int:
        """Bytes held by the H2O state (keys, values, scores, positions, and int8 scales) of all layers."""
        return sum(self._stream().layer_nbytes())

    def layer_cache_bytes(self) -> list[int]:
        """Bytes of each layer's H2O state (keys, values, scores, positions, and int8 scales), in layer order."""
        per_layer = [0] * self.limits.num_layers
        for spec, nbytes in zip(self.layers, self._stream().layer_nbytes()):
            per_layer[spec.layer] += nbytes
        return per_layer

    def full_cache_bytes(self, batch_size: int, seq_len: int) -> int:
        """Bytes a KV cache holding every token of every layer (keys and values) needs for the same model."""
        return sum(self._kv_bytes(s, batch_size, seq_len) for s in self.layers)

    def hf_cache_bytes(self, batch_size: int, seq_len: int) -> int:
        """Bytes transformers' own ``DynamicCache(config=model.config)`` holds after ``seq_len`` tokens: every
        token on full-attention layers, the last W - 1 on sliding-window layers (it keeps what the next query
        can see besides itself)."""
        return sum(self._kv_bytes(s, batch_size, min(seq_len, s.window - 1) if s.window else seq_len)
                   for s in self.layers)

    @staticmethod
    def _kv_bytes(spec: LayerSpec, batch_size: int, tokens: int) -> int:
        return batch_size * spec.kv_heads * tokens * (spec.head_dim + spec.value_dim) * spec.dtype.itemsize

    # -- running -------------------------------------------------------------------------------------------

    def _run_graph(self, input_ids: Tensor, positions: Tensor, valid: Tensor, *state: Tensor,
                   query_from: Optional[Tensor] = None) -> Tensor:
        return self._eager_graph(input_ids, positions, valid, *state, *self.stream.recent, query_from)

    def resolved_compile_mode(self) -> Optional[str]:
        """The torch.compile mode of the decode step on this model's device, or None when it runs eagerly."""
        return compile_mode(self.compile_mode, self.device)

    def _decode_fn(self):
        """The one-token step: the graph itself, or, when compilation is on, one compiled step for every batch
        size and capacity (dynamic shapes; the recent windows are int inputs, see passes.runtime_recent_graph)."""
        mode = self.resolved_compile_mode()
        if mode is None:
            return self._eager_decode_step if self.device.type == "cpu" else self._run_graph
        if self._compiled_step is None:
            # Compile the GraphModule itself (decode_step_graph: what the step runs), not a method of this class:
            # dynamo counts recompiles per code object, and every graph has its own generated forward, so
            # many H2OModels in one process (an eval sweep) never share one recompile limit.
            step_graph = decode_step_graph(self.graph, mode, self.device)
            if self._compiles_by_layer(mode):
                self._compiled_step, _ = compile_step_by_layer(step_graph, mode, self.device)
            else:
                self._compiled_step = compile_step(step_graph, mode, self.device, dynamic=True)
        compiled, recent = self._compiled_step, self.stream.recent
        return lambda *inputs: compiled(*inputs, *recent, None)  # query_from: decode tokens score as usual

    def _compiles_by_layer(self, mode: str) -> bool:
        """Whether the compiled step is split at its layers (``regional_compile``, CPU only)."""
        if self.regional_compile and self.device.type != "cpu":
            raise ValueError(f"regional_compile=True on {self.device.type}: compiling by layer is built and measured "
                             "for the CPU step; elsewhere the step compiles whole (on CUDA: one CUDA graph); use "
                             "regional_compile=False")
        if self.regional_compile and freezes_weights(mode, self.device):
            raise ValueError(f"regional_compile=True with compile={mode!r}: that mode freezes the weights into "
                             "the step, which then compiles whole; use regional_compile=False")
        return self.regional_compile

    def _eager_decode_step(self, input_ids: Tensor, positions: Tensor, valid: Tensor, *state: Tensor) -> Tensor:
        """The eager one-token step on CPU, its linear layers as ops/dispatch.py's ``eager_step_plan`` says."""
        plan = eager_step_plan(input_ids.shape[0])
        if not plan.weight_major:
            return self._run_graph(input_ids, positions, valid, *state)
        if self._eager_step_graph is None or self._eager_step_native != plan.native:
            self._eager_step_graph = copy_graph_module(self._eager_graph)  # shares the weights
            self._eager_step_native = plan.native
            weight_major_linears(self._eager_step_graph, native=plan.native)
        return self._eager_step_graph(input_ids, positions, valid, *state, *self.stream.recent, None)

    @torch.no_grad()
    def warmup(self, batch_sizes=(1,), max_seq_lens=(256,), *, progress: bool = True) -> int:
        """Compile the decode step ahead of the requests a server will see, like the CUDA-graph capture sizes
        of serving engines: one decode step for every (batch size, max_seq_len) pair. On CPU the first pair
        compiles the one step every later shape shares; on GPU each pair also records its CUDA graph.

        Args:
            batch_sizes: ints >= 1; max_seq_lens: ints >= 1 (prompt + new tokens, as generate sizes them).
            progress: show a progress bar.
        Returns:
            how many graphs dynamo compiled (0 when compilation is off, or already warm).
        The cache holds no request afterwards: call ``reset`` or ``generate`` next.
        """
        from torch._dynamo.utils import counters
        from tqdm.auto import tqdm

        pairs = [(b, n) for b in _positive_ints("batch_sizes", batch_sizes)
                 for n in _positive_ints("max_seq_lens", max_seq_lens)]
        if self.resolved_compile_mode() is None:
            return 0
        before = counters["stats"]["unique_graphs"]
        for batch, total in tqdm(pairs, desc="warmup", unit="shape", disable=not progress):
            self.reset(batch, total)
            self.step(torch.zeros(batch, 1, dtype=torch.long, device=self.device))
        self.stream = None
        return counters["stats"]["unique_graphs"] - before

    @torch.no_grad()
    def step(self, input_ids: Tensor, attention_mask: Optional[Tensor] = None, *, logits_to_keep: int = 0) -> Tensor:
        """Append a block of tokens and return its logits.

        Args:
            input_ids: [B, T] (B as given to reset).
            attention_mask: [B, T], 0 for (left) padding, or None for all ones.
            logits_to_keep: 0 = the logits of every position, 1 = of the last one only (as transformers'
                argument: a prompt's [B, T, V] logits are never built, which for a large vocabulary is most
                of the prefill's memory).
        Returns:
            logits [B, T, V] (or [B, 1, V]); padding positions hold meaningless values.
        """
        if logits_to_keep not in (0, 1) or isinstance(logits_to_keep, bool):
            raise ValueError(f"logits_to_keep={logits_to_keep!r}; allowed: 0 (every position) or 1 (the last)")
        state, stream = self.state(), self.stream
        limit = torch.iinfo(torch.int64).max if stream.max_seq_len is None else stream.max_seq_len
        if isinstance(input_ids, Tensor) and input_ids.dim() == 2:  # before place_block advances stream.seen
            self._check_positions(input_ids.shape[1])
        input_ids, valid, positions = generation.place_block(stream.seen, stream.fed, limit, input_ids,
                                                             attention_mask, self.device, self.vocab_size)
        if stream.fed == 0 and self.h2o_config.splits_by_prompt and input_ids.shape[1] > 1:
            stream = self._split_by_prompt(input_ids, valid)
            state = stream.tensors()
            self._check_positions(input_ids.shape[1])  # rolling positions: the split's largest layer decides
        query_from = self._prompt_query_from(valid) if stream.fed == 0 else None
        t = input_ids.shape[1]
        stream.fed += t
        if t == 1:  # a one-token prompt scores as any token: its query counts, and pooling one key keeps it
            return self._decode_fn()(input_ids, positions, valid, *state)
        chunk = self.h2o_config.prefill
        chunk = t if chunk == "full" else chunk
        blocks = [slice(i, i + chunk) for i in range(0, t, chunk)]
        if logits_to_keep == 1:
            last = self._last_logits()
            for block in blocks[:-1]:
                last(input_ids[:, block], positions[:, block], valid[:, block], *state, *stream.recent, query_from)
            block = blocks[-1]
            return last(input_ids[:, block], positions[:, block], valid[:, block], *state, *stream.recent,
                        query_from)
        return torch.cat([self._run_graph(input_ids[:, block], positions[:, block], valid[:, block], *state,
                                          query_from=query_from) for block in blocks], dim=1)

    def _split_by_prompt(self, input_ids: Tensor, valid: Tensor) -> Stream:
        """allocation "prompt" / "prompt-heads": the fresh stream re-planned with the split this prompt's attention
        asks for (runtime/allocation.py) between its caches, its rows' token counts kept."""
        old = self.stream
        layer_curves = attention_curves(self.model, input_ids, valid.long())  # [Hkv, T + 1] per layer
        curves = [layer_curves[spec.layer][list(spec.heads)].mean(dim=0) if spec.heads else
                  layer_curves[spec.layer].mean(dim=0) for spec in self.layers]  # each cache's heads' mean
        shares = layer_split(self.h2o_config, [spec.window for spec in self.layers], curves, old.max_seq_len,
                             old.capacity, heads=[spec.kv_heads for spec in self.layers])
        plan = CachePlan.build(self.h2o_config, self.layers, self.limits, max_seq_len=old.max_seq_len,
                               capacity=None if old.max_seq_len is not None else old.capacity, shares=shares)
        self.stream = Stream(plan, int(old.seen.shape[0]), self.device)
        self.stream.seen.copy_(old.seen)
        return self.stream

    def _prompt_query_from(self, valid: Tensor) -> Optional[Tensor]:
        """[B] int64 for the prompt block (the first after reset) when the score rule treats the prompt
        specially: the first position whose query adds to the scores (prompt_window w: the row's prompt
        length - w; pooling alone: 0). None when it does not, so the prompt scores as any block."""
        cfg = self.h2o_config
        if not cfg.scores_prompt_specially:
            return None
        lengths = valid.sum(dim=1)                                                # [B]
        window = cfg.rule.prompt_window
        return lengths - window if window is not None else torch.zeros_like(lengths)

    def _check_positions(self, t: int) -> None:
        """The positions a block of ``t`` tokens will use must be ones the model knows: true positions up to
        max_position_embeddings (a stream of a rotary model may go on, with a warning: it extrapolates),
        rolling ones below max(C) + block, capped distances at most max(max_distance, block - 1)."""
        known, stream = self.limits.max_positions, self.stream
        if known is None:
            return
        chunk = t if self.h2o_config.prefill == "full" else min(t, self.h2o_config.prefill)
        if self.h2o_config.positions == "capped":  # distances stay at most max(D, block - 1)
            check_capped_fits(self.limits, chunk)
        elif self.h2o_config.positions == "rolling":  # the last block of this call decides
            check_rolling_fits(self.limits, stream.plan.largest_slots, stream.fed + t - chunk, chunk)
        elif stream.fed + t > known:
            if stream.max_seq_len is not None or not self.limits.rotary:
                raise ValueError(f"the stream reaches {stream.fed + t} tokens, beyond the model's "
                                 f"max_position_embeddings={known} (keys keep their true positions; "
                                 + ("positions='rolling' or 'capped' keeps them inside)" if self.limits.rotary else
                                    "the graph shows no rotary embedding, so the model's positions are taken "
                                    "to end there)"))
            if not stream.warned_positions:
                stream.warned_positions = True
                warnings.warn(f"the stream passes the model's max_position_embeddings={known} with true "
                              "positions: the model extrapolates to distances it never saw (positions='rolling' "
                              "or 'capped' keeps every distance inside)", stacklevel=3)

    def _last_logits(self):
        """The graph variant that projects only the block's last position through the output embeddings."""
        if self._last_logits_graph is None:
            head = self.model.get_output_embeddings() if hasattr(self.model, "get_output_embeddings") else None
            path = next((name for name, module in self.model.named_modules() if module is head), None)
            try:
                self._last_logits_graph = last_position_logits(self._eager_graph, f"model.{path}")
            except ValueError:  # no recognisable output projection: slice the full logits instead
                self._last_logits_graph = lambda *inputs: self._eager_graph(*inputs)[:, -1:]
        return self._last_logits_graph

    def generate(self, input_ids: Tensor, attention_mask: Optional[Tensor] = None, generation_config=None,
                 logits_processor=None, stopping_criteria=None, streamer=None, **kwargs):
        """transformers' ``generate`` (greedy and sampling) with the H2O cache sized for prompt + new tokens.

        The arguments are transformers': the model's generation_config, overridden by ``generation_config``
        and the keyword arguments (``max_new_tokens``, ``do_sample``, ``temperature``, ``top_k``, ``top_p``,
        ``repetition_penalty``, ``no_repeat_ngram_size``, ``bad_words_ids``, ``min_new_tokens``,
        ``stop_strings`` with ``tokenizer=``, ``eos_token_id``, ``num_return_sequences``,
        ``return_dict_in_generate``, ``output_scores``, ``output_logits``, ...); sampling draws from torch's
        global generator, so ``torch.manual_seed`` makes it repeatable. Beam search and the other modes
        raise ValueError naming the argument (see :mod:`h2o_compile.runtime.generation_setup`).
        Returns [B, P + n] (the prompt followed by up to max_new_tokens new tokens) or a
        GenerateDecoderOnlyOutput.
        """
        return generation.generate(self, input_ids, attention_mask, generation_config, logits_processor,
                                   stopping_criteria, streamer, **kwargs)


def optimize(model: nn.Module, budget: Union[float, int, None] = None, *, config: Union[H2OConfig, str, None] = None,
             compile: Union[str, bool] = "auto", regional_compile: bool = False, tp=False, **options) -> H2OModel:
    """Turn a transformers causal LM into an :class:`H2OModel` whose KV cache keeps ``budget`` of the sequence.

    Args:
        budget: float in (0, 1] (fraction of prompt + new tokens) or int (cache slots); None = the config's
            (0.2 unless it says otherwise).
        config: an :class:`H2OConfig`, a preset name (``"paper"``, the default; ``"recommended"``; every name
            of ``h2o_compile.PRESETS``) or a rule string (``"max+decay=0.99"``, h2o_compile/config/rule_string.py).
        **options: any H2OConfig or ScoreRule field, applied on top of ``config`` (``H2OConfig.replace``):
            ``optimize(model, 0.1, config="recommended", kv_dtype="int8")``.
        compile: ``True`` compiles the decode step with torch.compile (fullgraph; CUDA graphs on GPU) once
            for every batch size and capacity (dynamic shapes; :meth:`H2OModel.warmup` compiles it ahead).
            ``"auto"`` does so on CUDA only: on CPU the one cold compile takes tens of seconds and pays back
            only after many thousands of generated tokens (docs/results/compile_shapes.md), so eager is the
            better default for a script that calls generate a few times, ``compile=True`` for a long-running
            server. A torch.compile mode (``"default"``, ``"reduce-overhead"``, ...) compiles with that mode. On
            CPU ``"max-autotune"`` also freezes the weights (see :func:`compile_step`): the fastest CPU decode,
            after a longer first compile.
        regional_compile: with ``compile`` on CPU, compile the step one decoder layer at a time, each kind of
            layer once, its code run for every layer of that kind (passes/layer_regions.py): a shorter first
            compile, each step after it slower by a compiled call per layer
            (docs/results/compile_regions_cpu/compile_regions.md); for processes that compile often and decode
            little. Not with a mode that freezes the weights, nor on CUDA (ValueError).
        tp: ``True`` (the default process group) or a torch.distributed ProcessGroup: tensor parallelism. Call
            it on every rank (``torchrun``) with the same model: it shards ``model`` in place (attention heads
            and MLP, h2o_compile/graph/tensor_parallel.py) before the capture, so each rank's H2O state holds
            num_key_value_heads / N KV heads, and every rank returns the same tokens (sampling: the same seed
            on every rank). ValueError for head counts not divisible by N, MQA among them.
    Raises:
        UnsupportedModelError for a model it cannot serve; ValueError / TypeError naming a bad option, or a
        setting the model's backend does not serve (h2o_compile/config/capabilities.py).
    """
    config = resolve_config(config, budget, options)
    check_compile(compile)
    device = next(model.parameters()).device if isinstance(model, nn.Module) and any(True for _ in model.parameters()) \
        else torch.device("cpu")
    check_served(config, "Triton" if backend_for(device) == "triton" else "reference")
    rank_heads = None
    if tp is not False and tp is not None:
        if config.splits_by_prompt:
            raise ValueError(f"allocation={config.allocation!r} with tp: each rank would read only its own heads' "
                             "attention and size its layers apart; calibrate the split once (h2o_compile.calibrate) "
                             "and pass it")
        shard = shard_model(model, tp, settings=config.to_string())  # each rank captures its own shard below
        rank_heads = (shard.rank * shard.kv_heads, shard.world)
    graph, layers, limits = build_graph(model, positions=config.positions, quantized=config.quantized,
                                        max_distance=config.max_distance)
    rank_config = config
    if rank_heads is not None:  # the split's head counts checked for the whole model on every rank, then narrowed
        head_groups(config, [dataclasses.replace(s, kv_heads=s.kv_heads * rank_heads[1]) for s in layers])
        rank_config = _rank_split(config, rank_heads[0], layers[0].kv_heads)
    layers = split_kv_heads(graph, layers, head_groups(rank_config, layers))
    layer_shares(rank_config, [s.window for s in layers], specs=layers)  # a share the layers cannot take fails here
    check_regional_compile(regional_compile)
    return H2OModel(model, graph, layers, config, limits, compile=compile, regional_compile=regional_compile,
                    rank_heads=rank_heads)


def _rank_split(config: H2OConfig, first: int, kv_heads: int) -> H2OConfig:
    """A tensor-parallel rank's config: a split by KV heads narrowed to the rank's heads first..first+kv_heads-1
    (each KV head's slots travel with it)."""
    if not isinstance(config.allocation, tuple):
        return config
    return config.replace(allocation=tuple(entry[first:first + kv_heads] if isinstance(entry, tuple) else entry
                                           for entry in config.allocation))
