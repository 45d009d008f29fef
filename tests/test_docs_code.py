"""The guide's and the README's code against the library: every ``h2o_compile.*`` name they cite resolves, the
signature of ``optimize`` the guide prints is the function's, every Python block of the guide runs (on a small
random model, compiling off), and docs/api.md is what docs/api_reference.py writes from the docstrings today."""

from __future__ import annotations

import importlib
import inspect
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import transformers

import h2o_compile

from .conftest import word_tokenizer

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", ROOT / "docs" / "guide.md", ROOT / "docs" / "design.md", ROOT / "docs" / "api.md"]


def _resolve(dotted: str):
    parts = dotted.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        for name in parts[i:]:
            obj = getattr(obj, name)
        return obj
    raise ImportError(dotted)


def test_every_cited_name_resolves():
    missing = []
    for doc in DOCS:
        for dotted in set(re.findall(r"\bh2o_compile(?:\.[A-Za-z_]\w*)+", doc.read_text(encoding="utf-8"))):
            try:
                _resolve(dotted)
            except (ImportError, AttributeError):
                missing.append(f"{doc.name}: {dotted}")
    assert not missing, missing


def test_the_guides_optimize_signature_is_the_functions():
    guide = (ROOT / "docs" / "guide.md").read_text(encoding="utf-8")
    shown = re.search(r"`(optimize\(model, budget=None[^`]*\))`", guide).group(1)
    sig = inspect.signature(h2o_compile.optimize)
    bare = sig.replace(parameters=[p.replace(annotation=inspect.Parameter.empty) for p in sig.parameters.values()],
                       return_annotation=inspect.Signature.empty)
    assert shown == "optimize" + str(bare).replace("'", '"')


def test_every_python_block_of_the_guide_runs(tmp_path, monkeypatch):
    config = transformers.LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).eval()
    tokenizer = word_tokenizer()
    tokenizer.padding_side, tokenizer.pad_token = "left", "<eos>"
    batch = tokenizer(["w1 w2 w3 w4", "w5 w6"], return_tensors="pt", padding=True)
    ids = [tokenizer(f"w{i} w{i + 1} w{i + 2}")["input_ids"] for i in (1, 4, 7)]
    monkeypatch.chdir(tmp_path)  # the blocks write out_dir
    guide = (ROOT / "docs" / "guide.md").read_text(encoding="utf-8")
    blocks = re.findall(r"```python\n(.*?)```", guide, re.S)
    assert len(blocks) >= 5
    namespace = dict(model=model, tokenizer=tokenizer, batch=batch, inputs=batch, ids_a=ids[0], ids_b=ids[1],
                     ids_c=ids[2])  # one namespace: a reader runs the blocks in order
    for block in blocks:
        if "export_onnx" in block:
            pytest.importorskip("onnxruntime")
        # Compiling the step takes a minute on CPU and changes no token: the blocks run eagerly here.
        code = block.replace("compile=True", "compile=False").replace("max_new_tokens=64", "max_new_tokens=4")
        exec(compile(code, "docs/guide.md", "exec"), namespace)  # noqa: S102 - the guide's own code


def test_the_api_reference_is_current():
    done = subprocess.run([sys.executable, str(ROOT / "docs" / "api_reference.py"), "--check"], capture_output=True,
                          text=True, timeout=300, cwd=ROOT)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
