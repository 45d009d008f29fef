"""A model named by its Hub id: the zoo's loader, the CLI's --model and H2OModel.from_pretrained resolve it through
transformers, so the user's Hub cache and offline mode apply. The test lays out a Hub cache folder locally (no
network) and loads from it with HF_HUB_OFFLINE=1, in a fresh process (the Hub settings are read at import)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import h2o_compile

from ..conftest import word_tokenizer
from ..runtime.arch_configs import build

REPO, REVISION = "h2o-test/tiny-llama", "0123456789abcdef0123456789abcdef01234567"

SCRIPT = """
import json, sys
import h2o_compile
from h2o_compile.cli import main
from h2o_compile.zoo.loading import load_pretrained

model, tokenizer = load_pretrained(sys.argv[1])
opt = h2o_compile.H2OModel.from_pretrained(sys.argv[1])
try:
    load_pretrained("h2o-test/no-such-model")
    missing = ""
except ValueError as error:
    missing = str(error)
print(json.dumps({"model_type": model.config.model_type, "ids": tokenizer("w1 w2")["input_ids"],
                  "config": opt.h2o_config.to_string(), "missing": missing,
                  "cli": main(["generate", "--model", sys.argv[1], "--prompt", "w1 w2", "--max-new-tokens", "4",
                               "--compile", "off"])}))
"""


def test_a_hub_id_loads_from_the_users_hub_cache_offline(tmp_path):
    snapshot = tmp_path / "hub" / f"models--{REPO.replace('/', '--')}" / "snapshots" / REVISION
    opt = h2o_compile.optimize(build("llama"), config="recommended+budget=12")
    opt.save_pretrained(snapshot)
    word_tokenizer().save_pretrained(snapshot)
    (snapshot.parent.parent / "refs").mkdir()
    (snapshot.parent.parent / "refs" / "main").write_text(REVISION)
    env = dict(os.environ, HF_HUB_CACHE=str(tmp_path / "hub"), HF_HUB_OFFLINE="1")
    done = subprocess.run([sys.executable, "-c", SCRIPT, REPO], capture_output=True, text=True, timeout=600, env=env,
                          cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["model_type"] == "llama" and len(result["ids"]) == 2
    assert result["config"] == opt.h2o_config.to_string()
    assert result["cli"] == 0
    # A missing id: transformers' own error, wrapped with what --model takes.
    assert "h2o-test/no-such-model" in result["missing"] and "Hub id" in result["missing"]
    assert "OSError" in result["missing"] or "offline" in result["missing"].lower()
