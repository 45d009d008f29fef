"""benchmarks/kvpress_tasks.py (run in kvpress's own venv): the press's context manager sees only the global
layers in ``global`` mode, every layer in ``all`` mode, and the model keeps all its layers either way."""

from __future__ import annotations

from contextlib import contextmanager
from types import SimpleNamespace

import torch

from ..helpers import load_benchmark


def _script():
    return load_benchmark("kvpress_tasks")


class Layer(torch.nn.Module):
    def __init__(self, sliding):
        super().__init__()
        self.self_attn = SimpleNamespace(is_sliding=sliding)


class FakePress:
    """Records the layers the model showed when the context manager was entered, and whether it was exited."""

    def __init__(self):
        self.seen, self.exited = None, False

    @contextmanager
    def __call__(self, model):
        self.seen = list(model.model.layers)
        try:
            yield
        finally:
            self.exited = True


def _model():
    model = torch.nn.Module()
    model.model = torch.nn.Module()
    model.model.layers = torch.nn.ModuleList([Layer(i % 6 != 5) for i in range(12)])  # Gemma 3's 5 local : 1
    return model


def test_global_mode_hooks_only_the_global_layers_and_restores_the_model():
    kv = _script()
    model, press = _model(), FakePress()
    layers = list(model.model.layers)
    with kv.pressed(model, press, "global"):
        assert press.seen == [layers[5], layers[11]] and not press.exited
        assert list(model.model.layers) == layers  # generate runs on every layer
    assert press.exited


def test_all_mode_and_no_press():
    kv = _script()
    model, press = _model(), FakePress()
    with kv.pressed(model, press, "all"):
        assert len(press.seen) == 12
    with kv.pressed(model, None, "global"):
        pass
    assert set(kv.PRESSES) >= {"snapkv", "observed", "streamingllm", "tova", "expected", "knorm"}
