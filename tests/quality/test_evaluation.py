"""The quality evaluation on a tiny slice: its numbers agree with transformers, its report is written."""

from __future__ import annotations

import json
import math
import random

import pytest
import torch

import h2o_compile
from h2o_compile.cli import main
from h2o_compile.quality.evaluation import EvalSettings, common_prefix, evaluate, read_tail, rouge_l, streaming_nll
from tests.runtime.arch_configs import build

TEXT = " ".join(f"w{(i * 7 + i // 5) % 90}" for i in range(400))


def lcs_bruteforce(a, b):
    best = 0
    for mask in range(1 << len(a)):
        sub = [x for i, x in enumerate(a) if mask >> i & 1]
        it = iter(b)
        if all(x in it for x in sub):
            best = max(best, len(sub))
    return best


def test_rouge_l_matches_bruteforce_lcs():
    rng = random.Random(0)
    for _ in range(30):
        a = [rng.randrange(4) for _ in range(rng.randrange(1, 9))]
        b = [rng.randrange(4) for _ in range(rng.randrange(1, 9))]
        lcs = lcs_bruteforce(a, b)
        want = 0.0 if lcs == 0 else 2 * (lcs / len(a)) * (lcs / len(b)) / (lcs / len(a) + lcs / len(b))
        assert rouge_l(a, b) == pytest.approx(want)
    assert common_prefix([1, 2, 3], [1, 2, 4]) == 2


def test_streaming_nll_with_full_cache_equals_transformers_cross_entropy():
    model = build("llama", seed=3)
    ids = torch.randint(1, 90, (2, 20))
    nll, count = streaming_nll(h2o_compile.optimize(model, budget=1.0, compile=False), ids, prompt_len=5)
    logits = model(ids).logits[:, 4:-1]
    want = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids[:, 5:].reshape(-1),
                                             reduction="sum")
    assert count == 2 * 15
    assert nll == pytest.approx(want.item(), rel=1e-5)


def test_evaluate_tiny_slice(tmp_path):
    from tests.conftest import word_tokenizer

    settings = EvalSettings(budgets=(0.25, 1.0), policies=("full", "h2o", "local"), seq_len=24, num_seqs=2,
                            batch_size=2, prompt_len=4, gen_prompt_len=12, gen_new_tokens=6, gen_prompts=2,
                            compile=False)
    result = evaluate(build("llama", seed=4), word_tokenizer(), [TEXT], settings, progress=False)
    full = result.perplexity["full"][1.0]
    assert math.isfinite(full) and full > 1
    # budget 1.0 keeps everything: same numbers as the full cache, whatever the policy.
    assert result.perplexity["h2o"][1.0] == pytest.approx(full, rel=1e-5)
    assert result.agreement["local"][1.0] == {"rouge_l": 1.0, "prefix": 6.0}
    assert result.perplexity["local"][0.25] != pytest.approx(full, rel=1e-3)


def test_a_sweep_without_full_still_measures_agreement_and_reports_as_it_goes():
    """Policies without ``full``: the full-cache generations are made first, so h2o at budget 1.0 agrees
    exactly with them and a small budget does not; ``on_config`` sees every configuration as it finishes."""
    from tests.conftest import word_tokenizer

    settings = EvalSettings(budgets=(0.25, 1.0), policies=("h2o",), seq_len=24, num_seqs=2, batch_size=2,
                            prompt_len=4, gen_prompt_len=12, gen_new_tokens=6, gen_prompts=2, compile=False)
    seen = []
    result = evaluate(build("llama", seed=4), word_tokenizer(), [TEXT], settings, progress=False,
                      on_config=lambda partial: seen.append(sorted(partial.perplexity["h2o"])))
    assert seen == [[0.25], [0.25, 1.0]]
    assert "full" not in result.perplexity
    assert result.agreement["h2o"][1.0] == {"rouge_l": 1.0, "prefix": 6.0}
    assert result.agreement["h2o"][0.25]["prefix"] < 6.0


def test_eval_cli_writes_json_table_and_plot(model_dir, tmp_path):
    text = tmp_path / "text.txt"
    text.write_text("head " * 50 + TEXT)
    out = tmp_path / "out"
    code = main(["eval", "--model", str(model_dir), "--text", str(text), "--tail", "0.9", "--budgets", "0.5,1.0",
                 "--policies", "h2o,full", "--seq-len", "24", "--num-seqs", "2", "--prompt-len", "4",
                 "--gen-prompt-len", "10", "--gen-new-tokens", "4", "--gen-prompts", "1", "--compile", "off",
                 "--out", str(out)])
    assert code == 0
    data = json.loads((out / "eval.json").read_text())
    assert set(data["perplexity"]) == {"full", "h2o"}
    assert "| h2o | 0.500 |" in (out / "eval.md").read_text()
    assert (out / "eval_perplexity.png").read_bytes()[:4] == b"\x89PNG"


def test_score_rules_join_the_sweep_under_their_own_label():
    """h2o under a rule is its own row; at budget 1.0 it keeps everything (the full cache's perplexity), at a
    small budget the decayed rule keeps other keys than the paper's sum."""
    from tests.conftest import word_tokenizer

    settings = EvalSettings(budgets=(0.25, 1.0), policies=("full", "h2o"), h2o_rules=("tova",), seq_len=24,
                            num_seqs=2, batch_size=2, prompt_len=4, gen_prompt_len=12, gen_new_tokens=6,
                            gen_prompts=2, compile=False)
    result = evaluate(build("llama", seed=4), word_tokenizer(), [TEXT], settings, progress=False)
    full = result.perplexity["full"][1.0]
    assert result.perplexity["h2o[tova]"][1.0] == pytest.approx(full, rel=1e-5)
    assert result.perplexity["h2o[tova]"][0.25] != pytest.approx(result.perplexity["h2o"][0.25], rel=1e-4)
    with pytest.raises(ValueError, match="cannot read 'decay'"):
        EvalSettings(h2o_rules=("decay",))
    with pytest.raises(ValueError, match=r"h2o rule 'budget=0.1\+allocation=0.5:1.5' sets budget, which the sweep"):
        EvalSettings(h2o_rules=("budget=0.1+allocation=0.5:1.5",))  # what a calibrated config's rule string says


def test_read_tail_and_bad_values(tmp_path):
    path = tmp_path / "t.txt"
    path.write_text("a" * 90 + "b" * 10)
    assert read_tail(path, 0.1) == "b" * 10
    with pytest.raises(ValueError, match="fraction=0"):
        read_tail(path, 0)
    with pytest.raises(ValueError, match="budgets"):
        EvalSettings(budgets=(0.0,))
    with pytest.raises(ValueError, match="prompt_len=0"):
        EvalSettings(prompt_len=0)
    with pytest.raises(ValueError, match="no configuration to run"):
        EvalSettings(policies=())
    with pytest.raises(ValueError, match="num_seqs=-1 must be >= 0"):
        EvalSettings(num_seqs=-1)
    with pytest.raises(ValueError, match="gen_prompts=0 must be >= 1"):
        EvalSettings(gen_prompts=0)


def test_agreement_only_sweep_measures_long_prompts_without_perplexity(model_dir, tmp_path):
    """--num-seqs 0: no perplexity windows; agreement at budget 1.0 is exact, KV bytes are those of the
    generation's cache (prompt + new tokens), and the plot shows agreement."""
    text = tmp_path / "text.txt"
    text.write_text(TEXT)
    out = tmp_path / "out"
    code = main(["eval", "--model", str(model_dir), "--text", str(text), "--budgets", "0.25,1.0",
                 "--policies", "h2o,local", "--num-seqs", "0", "--gen-prompt-len", "40", "--gen-new-tokens", "8",
                 "--gen-prompts", "2", "--compile", "off", "--out", str(out)])
    assert code == 0
    data = json.loads((out / "eval.json").read_text())
    assert data["perplexity"] == {}
    assert data["agreement"]["h2o"]["1.0"] == {"rouge_l": 1.0, "prefix": 8.0}
    sized = h2o_compile.optimize(build("llama"), budget=0.25, compile=False)
    sized.reset(1, 48)
    assert data["kv_bytes"]["local"]["0.25"] == sized.kv_cache_bytes()
    assert data["reference_bytes"]["tokens"] == 48
    table = (out / "eval.md").read_text()
    assert "No perplexity" in table and "| local | 0.250 | - | - |" in table
    assert (out / "eval_agreement.png").read_bytes()[:4] == b"\x89PNG"
