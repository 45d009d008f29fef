"""Tensor-parallel H2O decode (h2o_compile/graph/tensor_parallel.py) with 2 gloo processes on CPU, spawned here.

Each rank runs every scenario twice in its own process: unsharded (``optimize`` without ``tp``: the one-process
run, the reference) and sharded (``tp=True``), plus transformers' unsharded model decoding greedily with its
full cache. The ranks save what they saw; the tests compare: tokens equal to one process with a covering cache
and with eviction, rank r's kept positions equal the one-process run's for its heads, per-rank state bytes
exactly 1/N. One spawn serves every scenario (each process imports torch and captures models, the slow part);
a second spawn checks that a failing rank makes every rank raise instead of hanging (process-group timeout).
"""

from __future__ import annotations

import datetime
import os
import time
import traceback

import pytest
import torch
import torch.multiprocessing as mp

WORLD = 2
PROMPT, NEW = 12, 14     # 26 tokens: more than the 16-token sliding window of the hybrid configs
SLOTS = 6                # the evicting budget, in slots
COVER = 64               # a stream of 64 slots never evicts these 26 tokens
PG_TIMEOUT_S = 60        # a collective that waits longer raises on that rank

# name -> (architecture of tests/runtime/arch_configs.py, optimize options). Between them: every registered
# score, a decay, SnapKV's prompt window and pooling, int8 entries, rolling positions, chunked prefill,
# compressed sliding-window layers, GQA (8 query / 2 KV heads) and learned attention sinks.
SCENARIOS = {
    "llama": ("llama", dict()),
    "llama_max_int8": ("llama", dict(score="max", decay=0.9, prompt_window=4, prompt_pool=3, kv_dtype="int8")),
    "gemma3": ("gemma3", dict()),
    "gemma3_rolling": ("gemma3", dict(compress_sliding=True, positions="rolling", score="mean", prefill=4)),
    "gpt_oss_knorm": ("gpt_oss", dict(score="knorm", sink_tokens=1)),
    "gemma3_calibrated_split": ("gemma3", dict(compress_sliding=True, allocation=(0.5, 1.5, 1.0))),  # 3, 9, 6 slots
    # Split by KV heads: each rank keeps its own heads' slots (rank 0: 3 on layer 0, rank 1: 9).
    "llama_head_split": ("llama", dict(allocation=((0.5, 1.5), (1.25, 0.75)))),
}


def _prompt():
    ids = torch.randint(0, 96, (2, PROMPT), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[1, :3] = 0  # a left-padded row
    return ids, mask


def _greedy(opt, ids, new):
    """Greedy tokens [B, new] from a stream of COVER slots fed token by token; and the last step's logits."""
    opt.reset(ids.shape[0], capacity=COVER)
    logits = opt.step(ids)[:, -1]
    out = []
    for _ in range(new):
        out.append(logits.argmax(-1, keepdim=True))
        logits = opt.step(out[-1])[:, -1]
    return torch.cat(out, dim=1), logits


def _hf_greedy(model, ids, new):
    """transformers' own model, whole sequence re-run each token (no cache at all): greedy tokens [B, new]."""
    out = ids
    with torch.no_grad():
        for _ in range(new):
            out = torch.cat([out, model(out).logits[:, -1].argmax(-1, keepdim=True)], dim=1)
    return out[:, ids.shape[1]:]


def _heads_per_layer(opt):
    return [sum(s.kv_heads for s in opt.layers if s.layer == layer) for layer in range(opt.limits.num_layers)]


def _scenario(name, arch, options, rank):
    import h2o_compile
    from tests.runtime.arch_configs import build

    ids, mask = _prompt()
    ref = h2o_compile.optimize(build(arch), SLOTS, **options)
    model = build(arch)
    tp = h2o_compile.optimize(model, SLOTS, tp=True, **options)
    r = {"kv_heads": _heads_per_layer(tp), "ref_kv_heads": _heads_per_layer(ref),
         "config_kv_heads": model.config.num_key_value_heads}
    with torch.no_grad():  # the sharded transformers model (its all-reduce hooks) against the unsharded one
        r["hf_logits"], r["ref_hf_logits"] = model(ids).logits, build(arch)(ids).logits
    r["cover"], r["cover_logits"] = _greedy(tp, ids, NEW)
    r["ref_cover"], r["ref_cover_logits"] = _greedy(ref, ids, NEW)
    r["hf_cover"] = _hf_greedy(build(arch), ids, NEW)
    for key, opt in (("evict", tp), ("ref_evict", ref)):
        r[key] = opt.generate(ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False)
        r[key + "_kept"] = [opt.kept_positions(i) for i in range(opt.limits.num_layers)]
        r[key + "_bytes"] = opt.layer_cache_bytes()
        r[key + "_norms"] = [layer[0].float().norm(dim=-1) for layer in opt.layer_states()]  # [B, Hkv, C]
    if name == "llama":  # sampling: the same seed on every rank
        for key, opt in (("sample", tp), ("ref_sample", ref)):
            torch.manual_seed(7)
            r[key] = opt.generate(ids, max_new_tokens=NEW, do_sample=True, top_k=0)
    return r


def _declines(rank):
    """What optimize(tp=True) says about models it cannot split: MQA and fused projections."""
    import h2o_compile
    from tests.runtime.arch_configs import build

    said = {}
    for arch in ("qwen2", "phi3"):  # qwen2's config here has 1 KV head; phi3 fuses q/k/v into qkv_proj
        model = build(arch)
        before = {k: v.clone() for k, v in model.state_dict().items()}
        try:
            h2o_compile.optimize(model, SLOTS, tp=True)
            said[arch] = None
        except ValueError as exc:
            said[arch] = str(exc)
        said[arch + "_untouched"] = all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    return said


def _init(rank, init, timeout_s):
    import torch.distributed as dist

    torch.set_num_threads(1)  # one core per rank
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=WORLD,
                            timeout=datetime.timedelta(seconds=timeout_s))


def _worker(rank, init, out):
    import torch.distributed as dist

    try:
        _init(rank, init, PG_TIMEOUT_S)
        results = {name: _scenario(name, arch, options, rank) for name, (arch, options) in SCENARIOS.items()}
        results["declines"] = _declines(rank)
        torch.save(results, os.path.join(out, f"rank{rank}.pt"))
        dist.destroy_process_group()
    except BaseException:
        with open(os.path.join(out, f"rank{rank}.err"), "w") as f:
            f.write(traceback.format_exc())
        raise


def _failing_worker(rank, init, out):
    """Rank 1 builds another model (caught by optimize on every rank), then dies before a step: rank 0's
    all-reduce must raise (peer gone, or the process-group timeout), not hang."""
    import h2o_compile
    from tests.runtime.arch_configs import build

    _init(rank, init, 10)
    said = {}
    try:
        h2o_compile.optimize(build("llama", seed=rank), SLOTS, tp=True)
    except ValueError as exc:
        said["mismatch"] = str(exc)
    opt = h2o_compile.optimize(build("llama"), SLOTS, tp=True)
    if rank == 1:
        torch.save(said, os.path.join(out, f"rank{rank}.pt"))
        raise RuntimeError("rank 1 fails on purpose")
    try:
        opt.generate(_prompt()[0], max_new_tokens=NEW, do_sample=False)
        said["step"] = None
    except Exception as exc:  # what gloo raises: the peer closed its connection, or the timeout
        said["step"] = f"{type(exc).__name__}: {exc}"
    torch.save(said, os.path.join(out, f"rank{rank}.pt"))
    raise SystemExit(3)


def _spawn(fn, out, deadline_s):
    """Run ``fn(rank, init, out)`` in WORLD fresh processes; (exit codes, ranks still running at the deadline,
    which are then killed)."""
    ctx = mp.get_context("spawn")
    init = f"file://{out}/rendezvous"
    procs = [ctx.Process(target=fn, args=(rank, init, str(out))) for rank in range(WORLD)]
    for p in procs:
        p.start()
    end = time.monotonic() + deadline_s
    for p in procs:
        p.join(max(0.0, end - time.monotonic()))
    hung = [rank for rank, p in enumerate(procs) if p.is_alive()]
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join()
    return [p.exitcode for p in procs], hung


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    out = tmp_path_factory.mktemp("tp")
    codes, hung = _spawn(_worker, out, deadline_s=240)
    errors = "".join(f"rank {r}:\n{(out / f'rank{r}.err').read_text()}" for r in range(WORLD)
                     if (out / f"rank{r}.err").exists())
    assert not hung and codes == [0] * WORLD, f"exit codes {codes}, hung ranks {hung}\n{errors}"
    return [torch.load(out / f"rank{r}.pt") for r in range(WORLD)]


@pytest.mark.parametrize("name", SCENARIOS)
def test_tokens_equal_one_process_covering(ranks, name):
    for rank, results in enumerate(ranks):
        r = results[name]
        assert torch.equal(r["ref_cover"], r["hf_cover"]), "the one-process reference itself differs from transformers"
        assert torch.equal(r["cover"], r["ref_cover"]), f"rank {rank}"
        torch.testing.assert_close(r["cover_logits"], r["ref_cover_logits"], atol=1e-4, rtol=1e-4)
    # Every rank holds the same logits bit for bit (one all-reduce result, a replicated output projection).
    assert torch.equal(ranks[0][name]["cover_logits"], ranks[1][name]["cover_logits"])


@pytest.mark.parametrize("name", SCENARIOS)
def test_eviction_tokens_and_kept_positions_per_head(ranks, name):
    for rank, results in enumerate(ranks):
        r = results[name]
        assert torch.equal(r["evict"], r["ref_evict"]), f"rank {rank}"
        for layer, (kept, ref_kept) in enumerate(zip(r["evict_kept"], r["ref_evict_kept"])):
            h = kept.shape[1]
            assert h * WORLD == ref_kept.shape[1]
            assert (kept >= 0).any(), "nothing kept"
            ref_kept = ref_kept[:, rank * h:(rank + 1) * h]
            # A layer split by KV heads pads its smaller groups with -1 up to its largest: the rank's heads hold
            # only their own slots.
            assert (ref_kept[..., kept.shape[-1]:] == -1).all()
            ref_kept = ref_kept[..., :kept.shape[-1]]
            if SCENARIOS[name][1].get("score") == "knorm" and not torch.equal(kept, ref_kept):
                _check_knorm_ties(kept, ref_kept, r["evict_norms"][layer],
                                  r["ref_evict_norms"][layer][:, rank * h:(rank + 1) * h])
                continue
            assert torch.equal(kept, ref_kept), f"rank {rank} layer {layer}"
        assert any(k.shape[-1] < PROMPT + NEW for k in r["evict_kept"]), "a cache that holds every token"


def _check_knorm_ties(kept, ref_kept, norms, ref_norms):
    """knorm ranks keys by their L2 norm, which RoPE preserves: on the first layer a key's norm depends on its
    token only, so a repeated token ties with itself and float rounding (not the same in a sharded matmul)
    breaks the tie. Where the kept sets of a (row, head) differ, the keys only one run kept must tie:
    the same norms within rounding."""
    for b, h in zip(*torch.nonzero(~(kept.sort(-1).values == ref_kept.sort(-1).values).all(-1), as_tuple=True)):
        mine, theirs = set(kept[b, h].tolist()), set(ref_kept[b, h].tolist())
        only_mine = [norms[b, h, i] for i, p in enumerate(kept[b, h].tolist()) if p not in theirs]
        only_ref = [ref_norms[b, h, i] for i, p in enumerate(ref_kept[b, h].tolist()) if p not in mine]
        torch.testing.assert_close(torch.stack(only_mine).sort().values, torch.stack(only_ref).sort().values,
                                   atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("name", SCENARIOS)
def test_state_bytes_per_rank_are_one_nth(ranks, name):
    for results in ranks:
        r = results[name]
        if any(isinstance(e, tuple) for e in SCENARIOS[name][1].get("allocation", ())):  # its own heads' slots
            assert [sum(layer) for layer in zip(*(rr[name]["evict_bytes"] for rr in ranks))] == r["ref_evict_bytes"]
        else:
            assert [b * WORLD for b in r["evict_bytes"]] == r["ref_evict_bytes"]
        assert [h * WORLD for h in r["kv_heads"]] == r["ref_kv_heads"]
        assert r["config_kv_heads"] * WORLD == r["ref_kv_heads"][0]


@pytest.mark.parametrize("name", SCENARIOS)
def test_sharded_transformers_model_equals_unsharded(ranks, name):
    for results in ranks:
        torch.testing.assert_close(results[name]["hf_logits"], results[name]["ref_hf_logits"], atol=1e-4, rtol=1e-4)


def test_sampling_with_one_seed_draws_the_same_tokens_on_every_rank(ranks):
    assert torch.equal(ranks[0]["llama"]["sample"], ranks[1]["llama"]["sample"])
    assert torch.equal(ranks[0]["llama"]["sample"], ranks[0]["llama"]["ref_sample"])


def test_mqa_and_fused_projections_decline_by_name(ranks):
    for results in ranks:
        said = results["declines"]
        assert said["qwen2"] is not None and "num_key_value_heads=1" in said["qwen2"] and "MQA" in said["qwen2"]
        assert said["phi3"] is not None and "qkv_proj" in said["phi3"]
        assert said["qwen2_untouched"] and said["phi3_untouched"], "a declined model was changed"


def test_tp_without_torch_distributed_raises():
    import h2o_compile
    from tests.runtime.arch_configs import build

    with pytest.raises(ValueError, match="torch.distributed"):
        h2o_compile.optimize(build("llama"), SLOTS, tp=True)
    with pytest.raises(TypeError, match="tp="):
        h2o_compile.optimize(build("llama"), SLOTS, tp="yes")


def test_a_failing_rank_raises_on_every_rank(tmp_path):
    codes, hung = _spawn(_failing_worker, tmp_path, deadline_s=120)
    assert not hung, f"ranks {hung} hung"
    assert codes == [3, 1], codes  # rank 0 raised in its step and reached its own exit; rank 1 failed
    said = [torch.load(tmp_path / f"rank{r}.pt") for r in range(WORLD)]
    for r in range(WORLD):
        assert "same model and settings on every rank" in said[r]["mismatch"]
    assert said[0]["step"] is not None, "rank 0 decoded although rank 1 was gone"
