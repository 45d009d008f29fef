"""``ai.h2o_compile::H2OAttention``: kernels/reference.py ``h2o_attention`` as an ONNX model-local function.

The body uses standard ONNX ops only (opset 18: MatMul, Softmax, TopK, GatherElements, GatherND, ScatterND,
CumSum, Where, ...), so every ONNX Runtime execution provider runs it without a custom-op library, and the
exported graph still shows one readable node per layer.

Signature (shapes as in kernels/reference.py; C = cache slots, S = C + T):

    H2OAttention<scale: float, recent: int, sinks: int, policy: int, seed: int, window: int, softcap: float,
                 rolling: int, score: int, decay: float, max_distance: int>(
        q [B, Hq, T, D], k [B, Hkv, T, D], v [B, Hkv, T, Dv], positions [B, T] int64, valid [B, T] bool,
        key_cache [B, Hkv, C, D], value_cache [B, Hkv, C, Dv], score_cache [B, Hkv, C] f32,
        pos_cache [B, Hkv, C] int64, sink_logits [Hq] float, rope_cos [B', S', R], rope_sin [B', S', R])
    -> out [B, Hq, T, Dv], key_cache', value_cache', score_cache', pos_cache'

``policy`` and ``score`` are the integer codes of the rule registry (rules.POLICY_CODES, each Score's
onnx_code). The body computes the priorities of every policy and selects one with Where: the unused ones cost
a few element-wise ops over [B, Hkv, S], little next to the attention, and one function serves every policy.
The score rule of policy h2o (kernels/rules.py, the torch copy of the same arithmetic): ``score`` sum = the
accumulated sum, mean = the mean over the key's lifetime (A / (newest - p + 1)), max = the peak (A = max(A, a
query's mass summed over the group's heads), an If on the attribute); ``decay`` g weighs query t of the block
by g^(t1 - t) and the carried scores by g^(valid queries of the row), in an If on the attribute that folds away
at g = 1. The prompt window and prompt pooling need a run-time input the exported graph does not have:
export_onnx declines them.

Quantized entries (kv_dtype="int8"): the exporter wraps the call, :func:`dequantized` caches in, the caches
out :func:`quantized` again (the state between steps is int8 plus scales; one function body serves both).

The layer's attention kind (kernels/reference.py): ``window`` W (sliding window, 0 = off), ``softcap`` c
(0 = off) and ``sink_logits``, one learned logit per query head, always present: -inf is "no sink" for that
head (exp(-inf) adds exactly 0 to the denominator), and the exporter passes all -inf for a layer without
sinks. One function with an input that is always there, instead of a second variant, keeps one body and one
schema. Soft-capping and sinks cost nothing when off (their Ifs fold, see "Equivalence" below); an unused
window costs two boolean Ors, over [B, Hkv, 1, T, S] and [B, Hkv, S].

Rolling positions (``rolling`` = 1; kernels/rolling.py): q, k and the cache are unrotated, and ``rope_cos`` /
``rope_sin`` are the model's rotary tables at positions 0..S'-1 (S' >= C + T). The ranks come from one TopK
over the cached positions (exact in fp32 up to 2^24 positions) scattered back to the slots; q, the cached keys
and the block's keys are rotated together, in fp32 (the reference rotates in the tables' dtype, the same for
an fp32 model). With ``max_distance`` D > 0 the keys are numbered by their true distance to the block's newest
valid token capped at max(D, n - 1), n the row's valid tokens, instead (S' >= max(D, T - 1) + 1). With
``rolling`` = 0 the tables are a [1, 1, 2] placeholder and the If folds away.

Precondition (kept by every state this function and reference.empty_state produce): an empty slot
(position -1) holds zero key, value and score.

Equivalence with the reference, step by step:
- attention: the same fp32 masked softmax; cache and block keys are multiplied separately and the logits
  concatenated, which equals attending over the concatenated keys without copying the cache.
- soft-capping: c * tanh(x / c) in the reference's op order, in an If on the attribute: ONNX Runtime inlines
  the function with the attribute as a constant and folds the If, so a layer without it runs no Tanh.
- sink logits: the reference's softmax_with_sink op by op (peak = max(row max, s), exp(x - peak) over
  sum + exp(s - peak)). -inf gives exp(-inf - peak) = 0 with a finite peak (hidden logits are floored at the
  fp32 minimum, never -inf), so no NaN. When every sink is -inf an If takes the plain Softmax instead, equal
  up to rounding; in an exported model the sinks are an initializer, so ONNX Runtime folds that If too.
- sliding window: keys with p <= t - W are hidden from query t; entries with p <= t1 - W are not live, get
  priority -inf like empty slots (before sinks and the recent window protect anything) and are never kept,
  however they rank. Only live entries rank above -inf, so the kept set equals the reference's top-C & live.
- ranking: keeping the top C of S entries by (priority desc, position desc) is evicting the bottom T by
  (priority asc, position asc). ONNX TopK puts the lower index first among equal values, so a TopK that sorts
  by position followed by a TopK(smallest, k=T) over the gathered priorities reproduces the reference's two
  stable sorts. Positions are distinct except -1 (empty / padding), whose priority is -inf and which are
  never kept, so the position sort needs no tie rule.
- the random policy's Lehmer hash is integer Mul/Mod on int64; ONNX Mod with fmod=0 takes the divisor's sign,
  like torch's ``%``, and no intermediate exceeds 2^48, so the result is bit-identical.
- the slot-stable assignment scatters the kept new tokens by rank. Tokens that are not kept go to distinct
  overflow columns T + 1 + t (instead of one shared column as in the reference), so ScatterElements never sees
  duplicate indices, whose order ONNX leaves undefined.
- keys / values: only the slots that change are written (see the comment in the body), with the values the
  reference's gather-and-blend gives them; the other slots are copied. With a window, every slot may change
  (any number of old entries can leave the window when positions jump), so all C are rewritten.
"""

from __future__ import annotations

import onnx
from onnxscript import BOOL, FLOAT, INT8, INT64, script
from onnxscript import opset18 as op
from onnxscript.values import Op, Opset

from ..kernels.rules import POLICY_CODES, SCORES

# The codes the attributes ``policy`` and ``score`` carry: fields of the rule registry (kernels/rules.py).
_POLICY_H2O, _POLICY_RANDOM = POLICY_CODES["h2o"], POLICY_CODES["random"]
_SCORE_MEAN, _SCORE_PEAK = SCORES["mean"].onnx_code, SCORES["max"].onnx_code

DOMAIN = "ai.h2o_compile"
FUNCTION_NAME = "H2OAttention"
H2O_OPSET = Opset(DOMAIN, 1)

# Lehmer hash constants of reference.random_priority, spelled out because the function body cannot import.
# _LEHMER_MOD = 2147483647, _LEHMER_MUL = 48271, position multiplier 2654435761, seed multiplier 7919.


@script(H2O_OPSET, default_opset=op)
def H2OAttention(q, k, v, positions, valid, key_cache, value_cache, score_cache, pos_cache, sink_logits, rope_cos,
                 rope_sin, scale: float, recent: int, sinks: int, policy: int, seed: int, window: int, softcap: float,
                 rolling: int, score: int, decay: float, max_distance: int = 0):
    # ---- shapes (1-D int64 tensors of one element) -----------------------------------------------------
    b = op.Shape(q, start=0, end=1)
    hkv = op.Shape(k, start=1, end=2)
    t = op.Shape(q, start=2, end=3)
    d = op.Shape(q, start=3, end=4)
    dv = op.Shape(v, start=3, end=4)
    cap = op.Shape(pos_cache, start=2, end=3)
    zero_i = op.Constant(value_int=0)
    one_i = op.Constant(value_int=1)
    minus1 = op.Constant(value_int=-1)
    neg_inf = op.Constant(value_float=float("-inf"))
    window_c = op.Constant(value_int=window)
    no_window = op.LessOrEqual(window_c, zero_i)

    # ---- the block: padding tokens get position -1 and are never attended nor cached -------------------
    new_pos = op.Where(valid, positions, minus1)                                       # [B, T]
    newest = op.Unsqueeze(op.ReduceMax(new_pos, [1], keepdims=1), [2])                 # [B, 1, 1]
    new_pos_h = op.Expand(op.Unsqueeze(new_pos, [1]), op.Concat(b, hkv, t, axis=0))    # [B, Hkv, T]
    all_pos = op.Concat(pos_cache, new_pos_h, axis=2)                                  # [B, Hkv, S]
    s = op.Shape(all_pos, start=2, end=3)
    k_new = op.CastLike(k, key_cache)  # the reference stores the block in the cache dtype before attending
    v_new = op.CastLike(v, value_cache)

    # ---- attention in fp32. The query heads of one KV head are rows of one matrix ([B, Hkv, G*T, D],
    # a free reshape of [B, Hq, T, D]), and cache and block are multiplied separately: concatenating them
    # first would copy the whole cache every step.
    qg = op.Reshape(op.Cast(q, to=FLOAT.dtype), op.Concat(b, hkv, [-1], d, axis=0))     # [B, Hkv, G*T, D]
    keys_f = op.Cast(key_cache, to=FLOAT.dtype)                                        # [B, Hkv, C, D]
    block_f = op.Cast(k_new, to=FLOAT.dtype)                                           # [B, Hkv, T, D]
    int_max = op.Constant(value_ints=[9223372036854775807])
    if op.Greater(op.Constant(value_int=rolling), zero_i):  # folded away by ORT: rolling is a constant
        # Rolling positions (kernels/rolling.py): held entries numbered by position, the block's valid
        # tokens after them; q, cached keys and block keys are rotated together, in one [B, Hkv, N, D].
        capped = op.Constant(value_int=max_distance)
        if op.Greater(capped, zero_i):  # folded away by ORT: max_distance is a constant
            # Capped distances: clamp(p - (newest - D'), 0, D') with D' = max(D, valid tokens of the row - 1).
            n_valid = op.Unsqueeze(op.ReduceSum(op.Cast(valid, to=INT64.dtype), [1], keepdims=1), [2])  # [B,1,1]
            limit = op.Max(capped, op.Sub(n_valid, one_i))
            base = op.Sub(newest, limit)                                                # [B, 1, 1]
            cache_rank = op.Min(op.Max(op.Sub(pos_cache, base), zero_i), limit)          # [B, Hkv, C]
            block_rank = op.Min(op.Max(op.Sub(new_pos_h, base), zero_i), limit)          # [B, Hkv, T]
        else:
            held = op.GreaterOrEqual(pos_cache, zero_i)
            empty = op.ReduceSum(op.Cast(op.Not(held), to=INT64.dtype), [2], keepdims=1)  # [B, Hkv, 1]
            _, order = op.TopK(op.Cast(pos_cache, to=FLOAT.dtype), cap, axis=-1, largest=0, sorted=1)
            ramp = op.Expand(op.Sub(op.Range(zero_i, op.Squeeze(cap, [0]), one_i), empty), op.Shape(pos_cache))
            cache_rank = op.Max(op.ScatterElements(op.Mul(ramp, zero_i), order, ramp, axis=2), zero_i)
            valid_rank = op.Max(op.Sub(op.CumSum(op.Cast(valid, to=INT64.dtype), one_i), one_i), zero_i)
            block_rank = op.Add(op.Sub(cap, empty), op.Unsqueeze(valid_rank, [1]))         # [B, Hkv, T]
        group = op.Div(op.Shape(q, start=1, end=2), hkv)
        rank = op.Concat(op.Tile(block_rank, op.Concat([1], [1], group, axis=0)), cache_rank, block_rank, axis=2)
        x = op.Concat(qg, keys_f, block_f, axis=2)                                     # [B, Hkv, G*T+C+T, D]
        width = op.Shape(rope_cos, start=-1)
        flat = op.Unsqueeze(op.Reshape(rank, op.Concat(b, [-1], axis=0)), [2])          # [B, N, 1]
        rows = op.Concat(b, [1], [1], axis=0)  # Expand broadcasts a table of B' = 1 rows to B
        as_3d = op.Concat(op.Shape(rope_cos, start=0, end=1), [-1], width, axis=0)      # [B', S, R]
        table_cos = op.Expand(op.Reshape(rope_cos, as_3d), rows)                          # [B, S, R]
        table_sin = op.Expand(op.Reshape(rope_sin, as_3d), rows)
        by_head = op.Concat(b, hkv, [-1], width, axis=0)
        cos = op.Cast(op.Reshape(op.GatherND(table_cos, flat, batch_dims=1), by_head), to=FLOAT.dtype)
        sin = op.Cast(op.Reshape(op.GatherND(table_sin, flat, batch_dims=1), by_head), to=FLOAT.dtype)
        half = op.Div(width, op.Constant(value_ints=[2]))
        part = op.Slice(x, [0], width, [3])
        turned = op.Concat(op.Neg(op.Slice(part, half, width, [3])), op.Slice(part, [0], half, [3]), axis=3)
        x = op.Concat(op.Add(op.Mul(part, cos), op.Mul(turned, sin)), op.Slice(x, width, int_max, [3]), axis=3)
        gt = op.Shape(qg, start=2, end=3)
        qg_seen = op.Slice(x, [0], gt, [2])
        keys_seen = op.Slice(x, gt, op.Add(gt, cap), [2])
        block_seen = op.Slice(x, op.Add(gt, cap), int_max, [2])
    else:
        qg_seen = op.Identity(qg)
        keys_seen = op.Identity(keys_f)
        block_seen = op.Identity(block_f)
    qg = qg_seen
    keys_t = op.Transpose(keys_seen, perm=[0, 1, 3, 2])                                 # [B, Hkv, D, C]
    block_t = op.Transpose(block_seen, perm=[0, 1, 3, 2])                              # [B, Hkv, D, T]
    logits = op.Concat(op.MatMul(qg, keys_t), op.MatMul(qg, block_t), axis=-1)
    logits = op.Mul(logits, op.Constant(value_float=scale))                           # [B, Hkv, G*T, S]
    cap_c = op.Constant(value_float=softcap)
    if op.Greater(cap_c, op.Constant(value_float=0.0)):  # folded away by ORT: softcap is a constant
        logits = op.Mul(op.Tanh(op.Div(logits, cap_c)), cap_c)
    else:
        logits = op.Identity(logits)
    logits = op.Reshape(logits, op.Concat(b, hkv, [-1], t, s, axis=0))                 # [B, Hkv, G, T, S]
    kp = op.Unsqueeze(all_pos, [2, 3])                                                 # [B, Hkv, 1, 1, S]
    qp = op.Unsqueeze(positions, [1, 2, 4])                                            # [B, 1, 1, T, 1]
    causal = op.LessOrEqual(kp, qp)                                                    # over true positions
    in_window = op.Or(no_window, op.Greater(kp, op.Sub(qp, window_c)))               # t - p < W
    visible = op.And(op.And(op.GreaterOrEqual(kp, zero_i), causal), op.Unsqueeze(valid, [1, 2, 4]))
    visible = op.And(visible, in_window)                                               # [B, Hkv, 1, T, S]
    # A padding query sees nothing: softmax over a finite floor (no NaN), then zeroed by the mask.
    logits = op.Where(visible, logits, op.Constant(value_float=-3.4028234663852886e38))
    # Query head h = KV head h // G, group member h % G: the sinks take the logits' [Hkv, G] layout.
    # The condition reads the [Hq] input alone, so that it folds when the sinks are a constant.
    sink_f = op.Cast(sink_logits, to=FLOAT.dtype)                                      # [Hq]
    sink = op.Reshape(sink_f, op.Concat([1], hkv, [-1], [1], [1], axis=0))             # [1, Hkv, G, 1, 1]
    if op.Greater(op.ReduceMax(sink_f, keepdims=0), neg_inf):
        peak = op.Max(op.ReduceMax(logits, [-1], keepdims=1), sink)
        weights = op.Exp(op.Sub(logits, peak))
        probs = op.Div(weights, op.Add(op.ReduceSum(weights, [-1], keepdims=1), op.Exp(op.Sub(sink, peak))))
    else:
        probs = op.Softmax(logits, axis=-1)
    probs = op.Mul(probs, op.Cast(visible, to=FLOAT.dtype))                            # [B, Hkv, G, T, S]
    decay_c = op.Constant(value_float=decay)
    one_f = op.Constant(value_float=1.0)
    valid_f = op.Cast(valid, to=FLOAT.dtype)                                            # [B, T]
    if op.Less(decay_c, one_f):  # folded away by ORT: decay is a constant
        # Query t counts g^(t1 - t) (0^0 = 1), the carried scores g^(valid queries of the row).
        age = op.Cast(op.Max(op.Sub(op.Squeeze(newest, [2]), positions), zero_i), to=FLOAT.dtype)   # [B, T]
        weight = op.Mul(op.Pow(decay_c, age), valid_f)
        weighted = op.Mul(probs, op.Unsqueeze(weight, [1, 2, 4]))
        carried = op.Mul(score_cache, op.Unsqueeze(op.Pow(decay_c, op.ReduceSum(valid_f, [1], keepdims=1)), [2]))
    else:
        weighted = op.Identity(probs)                                                  # [B, Hkv, G, T, S]
        carried = op.Identity(score_cache)
    is_peak = op.Equal(op.Constant(value_int=score), op.Constant(value_int=_SCORE_PEAK))
    if is_peak:  # score="max", folded away as decay: each query's mass over the group's heads, then the max
        mass = op.ReduceMax(op.ReduceSum(weighted, [2], keepdims=0), [2], keepdims=0)  # [B, Hkv, S]
    else:
        mass = op.ReduceSum(weighted, [2, 3], keepdims=0)
    probs = op.Reshape(probs, op.Concat(b, hkv, [-1], s, axis=0))                      # [B, Hkv, G*T, S]
    out = op.Add(op.MatMul(op.Slice(probs, [0], cap, [3]), op.Cast(value_cache, to=FLOAT.dtype)),
                 op.MatMul(op.Slice(probs, cap, int_max, [3]), op.Cast(v_new, to=FLOAT.dtype)))
    out = op.CastLike(op.Reshape(out, op.Concat(b, [-1], t, dv, axis=0)), q)          # [B, Hq, T, Dv]
    # Only policy h2o reads scores: the others keep them at 0, as the torch backends do.
    mass = op.Mul(mass, op.Cast(op.Equal(op.Constant(value_int=policy), op.Constant(value_int=_POLICY_H2O)),
                                to=FLOAT.dtype))                                                   # [B, Hkv, S]
    grown = op.Concat(carried, op.ConstantOfShape(op.Shape(new_pos_h)), axis=2)
    if is_peak:
        all_scores = op.Max(grown, mass)
    else:
        all_scores = op.Add(grown, mass)

    # ---- eviction priority (larger stays) ------------------------------------------------------------
    pos_f = op.Cast(all_pos, to=FLOAT.dtype)
    lehmer_mod = op.Constant(value_int=2147483647)
    lehmer_mul = op.Constant(value_int=48271)
    salt = op.Add(op.Mul(op.Constant(value_int=seed), op.Constant(value_int=7919)), one_i)
    x = op.Mod(op.Add(op.Mul(all_pos, op.Constant(value_int=2654435761)), salt), lehmer_mod)
    x = op.Mod(op.Mul(x, lehmer_mul), lehmer_mod)
    x = op.Mod(op.Mul(x, lehmer_mul), lehmer_mod)
    code = op.Constant(value_int=policy)
    not_h2o = op.Where(op.Equal(code, op.Constant(value_int=_POLICY_RANDOM)), op.Cast(x, to=FLOAT.dtype), pos_f)
    lifetime = op.Cast(op.Max(op.Add(op.Sub(newest, all_pos), one_i), one_i), to=FLOAT.dtype)   # [B, Hkv, S]
    h2o_key = op.Where(op.Equal(op.Constant(value_int=score), op.Constant(value_int=_SCORE_MEAN)),
                       op.Div(all_scores, lifetime), all_scores)
    by_policy = op.Where(op.Equal(code, op.Constant(value_int=_POLICY_H2O)), h2o_key, not_h2o)
    protected = op.Or(op.Less(all_pos, op.Constant(value_int=sinks)),
                      op.Greater(all_pos, op.Sub(newest, op.Constant(value_int=recent))))
    priority = op.Where(protected, op.Constant(value_float=float("inf")), by_policy)
    # Not live (empty, or out of the window of the newest query): evicted first, whatever its protection.
    live = op.And(op.GreaterOrEqual(all_pos, zero_i),
                  op.Or(no_window, op.Greater(all_pos, op.Sub(newest, window_c))))       # [B, Hkv, S]
    priority = op.Where(live, priority, neg_inf)

    # ---- keep the top C of S by (priority desc, position desc) = evict the bottom T ------------------
    # by (priority asc, position asc): sort by position, then TopK(smallest) keeps that order among ties.
    _, by_pos = op.TopK(pos_f, s, axis=-1, largest=0, sorted=1)                        # [B, Hkv, S]
    _, low = op.TopK(op.GatherElements(priority, by_pos, axis=2), t, axis=-1, largest=0, sorted=1)
    evicted_idx = op.GatherElements(by_pos, low, axis=2)                               # [B, Hkv, T]
    evicted = op.ScatterElements(op.ConstantOfShape(op.Shape(all_pos), value=[0]), evicted_idx,
                                 op.Expand(one_i, op.Shape(evicted_idx)), axis=2)      # [B, Hkv, S]
    keep = op.And(op.Not(op.Cast(evicted, to=BOOL.dtype)), live)  # dead entries beyond the bottom T too

    # ---- slot-stable assignment: the r-th freed slot gets the r-th kept new token ---------------------
    kept_old = op.Slice(keep, [0], cap, [2])                                           # [B, Hkv, C]
    kept_new = op.Slice(keep, cap, int_max, [2])                                       # [B, Hkv, T]
    freed = op.Not(kept_old)
    t_scalar = op.Squeeze(t, [0])
    t_idx = op.Expand(op.Range(zero_i, t_scalar, one_i), op.Shape(new_pos_h))          # [B, Hkv, T]
    new_rank = op.Sub(op.CumSum(op.Cast(kept_new, to=INT64.dtype), [2]), one_i)
    t1 = op.Add(t, one_i)
    dest = op.Where(kept_new, new_rank, op.Add(t_idx, t1))                             # distinct, < 2T+1
    empty = op.ConstantOfShape(op.Concat(b, hkv, op.Add(t, t1), axis=0), value=[-1])   # [B, Hkv, 2T+1]
    source_by_rank = op.ScatterElements(empty, dest, t_idx, axis=2)
    # Column T stays -1: it answers every freed slot beyond the number of kept new tokens.
    source_by_rank = op.Slice(source_by_rank, [0], t1, [2])                           # [B, Hkv, T+1]
    free_rank = op.Sub(op.CumSum(op.Cast(freed, to=INT64.dtype), [2]), one_i)
    free_rank = op.Min(op.Max(free_rank, zero_i), t_scalar)
    source = op.Where(freed, op.GatherElements(source_by_rank, free_rank, axis=2), minus1)   # [B,Hkv,C]
    filled = op.GreaterOrEqual(source, zero_i)

    # ---- the new keys / values: rewrite only the slots that change --------------------------------------
    # A slot changes when it is freed and either receives a new token or held an entry (which is evicted
    # and becomes empty). Freed slots that were already empty hold zeros (every empty slot does, from
    # empty_state and from this function) and stay as they are. Without a window at most 2T slots change
    # (T evictions, T arrivals), so a TopK of min(2T, C) slot indices covers them; the extra indices in that
    # list write back their own value. One scatter then copies the cache once instead of blending all C x D.
    # A window can kill any number of old entries at once, so it takes all C (a count from the data would
    # be a data-dependent TopK k, which a GPU provider must copy to the host).
    changed = op.And(freed, op.Or(filled, op.GreaterOrEqual(pos_cache, zero_i)))      # [B, Hkv, C]
    m = op.Where(no_window, op.Min(op.Add(t, t), cap), cap)
    _, slots = op.TopK(op.Cast(changed, to=FLOAT.dtype), m, axis=-1, largest=1, sorted=1)   # [B,Hkv,M]
    slot_changed = op.Unsqueeze(op.GatherElements(changed, slots, axis=2), [3])         # [B, Hkv, M, 1]
    # Row T of [block; zero row] is the empty entry.
    row = op.Unsqueeze(op.GatherElements(op.Where(filled, source, t_scalar), slots, axis=2), [3])
    slot_rows = op.Unsqueeze(slots, [3])
    zero_k = op.CastLike(op.ConstantOfShape(op.Concat(b, hkv, [1], d, axis=0)), key_cache)
    zero_v = op.CastLike(op.ConstantOfShape(op.Concat(b, hkv, [1], dv, axis=0)), value_cache)
    upd_k = op.Where(slot_changed, op.GatherND(op.Concat(k_new, zero_k, axis=2), row, batch_dims=2),
                     op.GatherND(key_cache, slot_rows, batch_dims=2))                 # [B, Hkv, M, D]
    upd_v = op.Where(slot_changed, op.GatherND(op.Concat(v_new, zero_v, axis=2), row, batch_dims=2),
                     op.GatherND(value_cache, slot_rows, batch_dims=2))               # [B, Hkv, M, Dv]
    # ScatterND (full (b, h, slot) coordinates) copies the cache faster than ScatterElements in ORT.
    grid = op.Shape(slot_rows)                                                         # [B, Hkv, M, 1]
    b_idx = op.Expand(op.Unsqueeze(op.Range(zero_i, op.Squeeze(b, [0]), one_i), [1, 2, 3]), grid)
    h_idx = op.Expand(op.Unsqueeze(op.Range(zero_i, op.Squeeze(hkv, [0]), one_i), [0, 2, 3]), grid)
    coords = op.Concat(b_idx, h_idx, slot_rows, axis=3)                                # [B, Hkv, M, 3]
    new_keys = op.ScatterND(key_cache, coords, upd_k)
    new_values = op.ScatterND(value_cache, coords, upd_v)
    src = op.Add(op.Max(source, zero_i), cap)                                          # index into S
    fresh_scores = op.Where(filled, op.GatherElements(all_scores, src, axis=2), op.Constant(value_float=0.0))
    new_scores = op.Where(kept_old, op.Slice(all_scores, [0], cap, [2]), fresh_scores)
    new_positions = op.Where(kept_old, pos_cache, op.Where(filled, op.GatherElements(all_pos, src, axis=2),
                                                           minus1))
    return out, new_keys, new_values, new_scores, new_positions


def dequantized(entries, scales):
    """int8 entries [B, Hkv, C, D] and their scales [B, Hkv, C] f32 -> s * q [B, Hkv, C, D] f32, inline ops.

    Quantized entries (kernels/quantized.py) reach H2OAttention dequantized, in fp32 whatever the model's
    dtype, so that quantizing its output again gives back each kept entry's int8 vector: a kept vector's
    largest |q| is 127, hence max|s * q| / 127 = s up to rounding, and round(s * q / s) = q."""
    return op.Mul(op.Cast(entries, to=FLOAT.dtype), op.Unsqueeze(scales, [3]))


def quantized(x):
    """x [B, Hkv, C, D] -> (int8 [B, Hkv, C, D], scales [B, Hkv, C] f32): s = max|x| / 127 (1 for a zero vector,
    which an empty slot holds), q = clamp(round(x / s), -127, 127), as kernels/quantized.py (Round is half to
    even in ONNX as in torch)."""
    x = op.Cast(x, to=FLOAT.dtype)
    scale = op.Div(op.ReduceMax(op.Abs(x), [3], keepdims=0), op.Constant(value_float=127.0))
    scale = op.Where(op.Greater(scale, op.Constant(value_float=0.0)), scale, op.Constant(value_float=1.0))
    q = op.Clip(op.Round(op.Div(x, op.Unsqueeze(scale, [3]))), op.Constant(value_float=-127.0),
                op.Constant(value_float=127.0))
    return op.Cast(q, to=INT8.dtype), scale


_INPUTS = (("q", "T"), ("k", "T"), ("v", "T"), ("positions", "tensor(int64)"), ("valid", "tensor(bool)"),
           ("key_cache", "TC"), ("value_cache", "TC"), ("score_cache", "tensor(float)"),
           ("pos_cache", "tensor(int64)"), ("sink_logits", "TS"), ("rope_cos", "TR"), ("rope_sin", "TR"))
_OUTPUTS = (("out", "T"), ("new_key_cache", "TC"), ("new_value_cache", "TC"),
            ("new_score_cache", "tensor(float)"), ("new_pos_cache", "tensor(int64)"))
_ATTRIBUTES = (("scale", "FLOAT"), ("recent", "INT"), ("sinks", "INT"), ("policy", "INT"), ("seed", "INT"),
               ("window", "INT"), ("softcap", "FLOAT"), ("rolling", "INT"), ("score", "INT"), ("decay", "FLOAT"),
               ("max_distance", "INT"))


def _schema() -> onnx.defs.OpSchema:
    """The node's signature, used only while exporting: the exporter builds nodes from an OpSchema, and a
    plain custom-domain node (instead of a call to the onnxscript function) survives the exporter's opset
    conversion, which inlines every model function; export_onnx attaches the function body afterwards."""
    floats = ["tensor(float)", "tensor(float16)", "tensor(bfloat16)"]
    param = onnx.defs.OpSchema.FormalParameter
    return onnx.defs.OpSchema(
        FUNCTION_NAME, DOMAIN, 1, doc=__doc__,
        inputs=[param(name, ty) for name, ty in _INPUTS],
        outputs=[param(name, ty) for name, ty in _OUTPUTS],
        type_constraints=[("T", floats, "attention dtype"), ("TC", floats, "cache dtype"),
                          ("TS", floats, "sink logits dtype"), ("TR", floats, "rotary tables dtype")],
        attributes=[onnx.defs.OpSchema.Attribute(name, getattr(onnx.defs.OpSchema.AttrType, ty), "")
                    for name, ty in _ATTRIBUTES])


H2OAttentionNode = Op(H2O_OPSET, FUNCTION_NAME, _schema())
