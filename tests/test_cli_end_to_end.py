"""Every h2o-compile subcommand end to end, in a subprocess as a user runs it (tiny sizes)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest


def run_cli(*args, cwd=None) -> str:
    done = subprocess.run([sys.executable, "-m", "h2o_compile.cli", *map(str, args)], capture_output=True,
                          text=True, timeout=600, cwd=cwd)
    assert done.returncode == 0, f"h2o-compile {' '.join(map(str, args))} failed:\n{done.stderr[-3000:]}"
    return done.stdout


def test_demo_on_the_tiny_model_prints_and_writes_only_under_out(tmp_path):
    out = run_cli("demo", "--model", "tiny", "--max-new-tokens", "4", "--out", tmp_path / "demo", cwd=tmp_path)
    assert "full cache" in out and "H2O 20%" in out and "tok/s" in out
    assert sorted(p.name for p in (tmp_path / "demo").iterdir()) == ["demo.json", "demo.md", "demo.png"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["demo"]  # nothing else written in the cwd
    records = json.loads((tmp_path / "demo" / "demo.json").read_text())["results"]
    full, h2o = [r["kv_cache_bytes"] for r in records[:2]]
    assert h2o < full / 3  # 20% of the sequence, every layer


def test_bench_smoke(tmp_path):
    out = run_cli("bench", "--smoke", "--compile", "off", "--out", tmp_path / "bench")
    assert (tmp_path / "bench.json").is_file() and (tmp_path / "bench.md").is_file()
    assert "tok/s" in out or "tokens/s" in out


def test_eval_heldout_writes_the_report(tmp_path):
    text = tmp_path / "corpus.txt"
    text.write_text("\n\n".join(f"The {i}th soldier walked to the river and sat by the mill. " * 6
                                for i in range(400)), encoding="utf-8")
    out = run_cli("eval", "--model", "tiny", "--text", text, "--heldout", "0.5", "--seq-len", "64", "--num-seqs", 2,
                  "--batch-size", 2, "--gen-prompt-len", 48, "--gen-new-tokens", 16, "--gen-prompts", 2,
                  "--budgets", "0.25", "--policies", "full,h2o,local", "--compile", "off", "--out", tmp_path / "ev")
    result = json.loads((tmp_path / "ev" / "eval.json").read_text())
    assert set(result["perplexity"]) == {"full", "h2o", "local"}
    assert "held-out" in out and (tmp_path / "ev" / "eval_perplexity.png").is_file()


def test_generate_with_sampling_policy_sinks_and_chunked_prefill(model_dir):
    args = ["generate", "--model", model_dir, "--prompt", "w1 w2 w3 w4 w5 w6 w7 w8", "--max-new-tokens", 8,
            "--policy", "sink", "--sink-tokens", 2, "--prefill", 3, "--budget", 8, "--compile", "off",
            "--temperature", 0.8, "--top-k", 20, "--top-p", 0.9, "--seed", 3]
    first, second = run_cli(*args), run_cli(*args)
    assert first.splitlines()[0] == second.splitlines()[0]  # seeded sampling repeats
    assert first.startswith("w1 w2 w3 w4 w5 w6 w7 w8") and "policy sink" in first


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_export_with_dtype_and_fixed_batch_then_generate_with_onnx(model_dir, tmp_path, dtype):
    pytest.importorskip("onnxruntime")
    out = tmp_path / "onnx"
    run_cli("export", "--model", model_dir, "-o", out, "--budget", 8, "--max-seq-len", 24, "--batch-size", 1,
            "--dtype", dtype)
    meta = json.loads((out / "h2o_config.json").read_text())
    assert meta["dtype"] == dtype and meta["batch_size"] == 1
    text = run_cli("generate", "--model", out, "--backend", "onnx", "--prompt", "w3 w9 w27", "--max-new-tokens", 6,
                   "--temperature", 0.7, "--top-k", 10, "--seed", 1)
    assert text.startswith("w3 w9 w27")


def _git_status(root: Path):
    done = subprocess.run(["git", "status", "--porcelain", "--untracked-files=all"], capture_output=True, text=True,
                          cwd=root)
    return done.stdout if done.returncode == 0 else None


def test_a_run_in_a_checkout_leaves_git_status_clean_and_writes_under_runs(tmp_path):
    """eval with its default --out, run from the repository root: the report lands in a new folder under
    ./runs/ (gitignored), nothing in the package's docs/ changes."""
    root = Path(__file__).resolve().parents[1]
    before = _git_status(root)
    if before is None:
        pytest.skip("not a git checkout")
    runs = root / "runs"
    existing = set(runs.iterdir()) if runs.is_dir() else set()
    text = tmp_path / "corpus.txt"
    text.write_text("The soldier walked to the river and sat by the mill. " * 200, encoding="utf-8")
    try:
        run_cli("eval", "--model", "tiny", "--text", text, "--seq-len", "64", "--batch-size", 1,
                "--num-seqs", 0, "--gen-prompt-len", 16, "--gen-new-tokens", 4, "--gen-prompts", 1,
                "--budget", "0.5", "--policies", "full,h2o", "--compile", "off", cwd=root)
        new = set(runs.iterdir()) - existing
        assert len(new) == 1 and next(iter(new)).name.startswith("eval-")
        assert (next(iter(new)) / "eval.json").is_file()
        assert _git_status(root) == before
    finally:
        for folder in (set(runs.iterdir()) - existing if runs.is_dir() else ()):
            shutil.rmtree(folder)
        if runs.is_dir() and not existing:
            runs.rmdir()
