"""ONNX export of H2O models and an ONNX Runtime model with the same generate() as H2OModel.

``export_onnx(model, out_dir, budget=0.2, max_seq_len=2048)`` writes ``model.onnx`` (one
``ai.h2o_compile::H2OAttention`` function node per layer, standard ops inside) plus ``h2o_config.json`` and
the transformers config / tokenizer files; ``H2OOrtModel.from_pretrained(out_dir)`` runs it, with the node
computed by the native custom op of ``native/`` when it builds (``native="auto"``), else by the function.
onnx, onnxscript and onnxruntime (the ``onnx`` extra) are imported only when these are used.
"""

from .onnx import export_onnx
from .ort import H2OOrtModel

__all__ = ["H2OOrtModel", "export_onnx"]
