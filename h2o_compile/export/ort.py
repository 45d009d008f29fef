"""H2OOrtModel: run an ``export_onnx`` directory with ONNX Runtime, with H2OModel's reset / step / generate.

    model = H2OOrtModel.from_pretrained("out_dir")            # CUDA provider when available, else CPU
    ids = model.generate(input_ids, attention_mask, max_new_tokens=64)

The H2O state never leaves the provider's device: each layer's tensors (cache_plan.py) live in two sets of OrtValues
that the graph reads from and writes to alternately (IO binding; "present" of one step is "past" of the
next), so a decode step copies only token ids / positions in and logits out. Inputs and logits are torch
tensors bound by pointer: on CUDA (with a CUDA torch) they stay on the GPU and generation.generate samples
there; otherwise they are CPU tensors and ONNX Runtime copies the few bytes across.

The exported capacity C is fixed: ``reset(batch, max_seq_len)`` accepts any max_seq_len up to the exported
one and always keeps C slots, so results equal H2OModel's when both use the same C (an int budget, or the
exported max_seq_len with a float budget).
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch
from torch import Tensor

from ..runtime import generation
from ..runtime.hf_interface import register_for_pipelines
from ..runtime.cache_plan import CachePlan, layer_positions
from ..config import H2OConfig
from .onnx import (CONFIG_FILE, FORMAT, FORMAT_VERSION, MODEL_FILE, TOKENIZER_FILES, state_input_names,
                   state_output_names)

_PROVIDER_ALIASES = {"cpu": "CPUExecutionProvider", "cuda": "CUDAExecutionProvider"}
_COMPANION_FILES = ("config.json", "generation_config.json") + TOKENIZER_FILES
# ONNX TensorProto element types, for binding torch buffers by pointer (covers bf16, which numpy lacks).
_ONNX_TYPES = {torch.float32: 1, torch.int8: 3, torch.int64: 7, torch.bool: 9, torch.float16: 10,
               torch.bfloat16: 16}
_TORCH_DTYPES = {"tensor(float)": torch.float32, "tensor(float16)": torch.float16,
                 "tensor(bfloat16)": torch.bfloat16}
_META_DTYPES = {"float32": torch.float32, "float16": torch.float16}


def _choose_provider(provider: str | None) -> str:
    import onnxruntime as ort

    available = ort.get_available_providers()
    if provider is None:
        return "CUDAExecutionProvider" if "CUDAExecutionProvider" in available else "CPUExecutionProvider"
    name = _PROVIDER_ALIASES.get(provider, provider)
    if name not in available:
        raise ValueError(f"provider={provider!r} is not available in this onnxruntime; available: "
                         f"{', '.join(available)}")
    return name


class H2OOrtModel:
    """An exported H2O model in an ONNX Runtime session; same reset / step / generate as H2OModel."""

    main_input_name = "input_ids"

    def __init__(self, session, meta: dict, *, model_dir: Path | None = None, config=None,
                 generation_config=None, tokenizer=None, native: bool = False, in_place: bool = False):
        if meta.get("format") != FORMAT:
            raise ValueError(f"not an h2o_compile ONNX export (format={meta.get('format')!r})")
        if meta.get("format_version") != FORMAT_VERSION:
            raise ValueError(f"this export has format_version={meta.get('format_version')!r}; this library reads "
                             f"{FORMAT_VERSION}: export the model again with export_onnx()")
        self.h2o_config = H2OConfig.from_dict(meta["config"])
        register_for_pipelines(type(self))
        self.session = session
        self.meta = meta
        self.model_dir = model_dir
        self.config = config
        self.generation_config = generation_config
        self.tokenizer = tokenizer
        self.native = native  # the session runs the native H2OAttention kernel (export/native_session.py)
        self._in_place = in_place  # past and present state are one buffer set
        self.provider = session.get_providers()[0]
        self._ort_device = "cuda" if self.provider == "CUDAExecutionProvider" else "cpu"
        self._device_id = int(session.get_provider_options().get(self.provider, {}).get("device_id", 0))
        use_cuda_tensors = self._ort_device == "cuda" and torch.cuda.is_available()
        self.device = torch.device("cuda", self._device_id) if use_cuda_tensors else torch.device("cpu")
        outputs = {o.name: o for o in session.get_outputs()}
        self._logits_dtype = _TORCH_DTYPES[outputs["logits"].type]
        self._cache_dtype = _META_DTYPES.get(meta.get("dtype"), self._logits_dtype)
        vocab = outputs["logits"].shape[-1]  # the graph's own (static) width, else the config's vocab
        self._vocab = vocab if isinstance(vocab, int) else int(meta["vocab_size"])
        n = int(meta["num_layers"])
        self.plan = CachePlan.from_meta(meta, self._cache_dtype)
        quantized = self.h2o_config.quantized
        self._fields = len(self.plan.layers[0].fields) if self.plan.layers else 4  # state tensors per layer
        self._past, self._present = state_input_names(n, quantized), state_output_names(n, quantized)
        self.capacity: int = int(meta["capacity"])
        self.max_seq_len: int | None = None  # of the current reset(); meta["max_seq_len"] bounds it
        self._state = self._spare = None
        self._fed = 0
        self.seen = torch.zeros(0, dtype=torch.long, device=self.device)

    # -- loading and saving (optimum OptimizedModel conventions) -------------------------------------------

    @classmethod
    def from_pretrained(cls, model_dir: str | os.PathLike, provider: str | None = None, *,
                        session_options=None, provider_options: dict | None = None,
                        native="auto") -> H2OOrtModel:
        """Open ``model_dir`` written by export_onnx (or save_pretrained); loads its transformers config,
        generation config and tokenizer (``.tokenizer``, None without tokenizer files) when present.

        Args:
            provider: an ONNX Runtime execution provider name (or "cpu" / "cuda"); None = CUDA if available.
            session_options: an ``onnxruntime.SessionOptions``; provider_options: options of that provider.
            native: run H2OAttention with the native custom op (export/native, compiled on first use):
                "auto" (default) = on the CPU provider when the library builds, else the ONNX function;
                True = required (an error if it cannot be built); False = the ONNX function.
        """
        import onnxruntime as ort

        from . import native_session

        model_dir = Path(model_dir)
        if not (model_dir / CONFIG_FILE).is_file() or not (model_dir / MODEL_FILE).is_file():
            raise ValueError(f"{model_dir} has no {MODEL_FILE} + {CONFIG_FILE}; create it with export_onnx()")
        meta = json.loads((model_dir / CONFIG_FILE).read_text())
        provider = _choose_provider(provider)
        session_options, native = native_session.choose(native, provider, meta, session_options)
        n, quantized = int(meta["num_layers"]), meta.get("config", {}).get("kv_dtype") == "int8"
        # int8 state feeds the dequantizing ops, not the node: never in place (state_in_place says so).
        in_place = native and native_session.state_in_place(model_dir / MODEL_FILE, state_input_names(n, quantized),
                                                            state_output_names(n, quantized))
        session = ort.InferenceSession(str(model_dir / MODEL_FILE), sess_options=session_options,
                                       providers=[provider], provider_options=[provider_options or {}])
        config = generation_config = None
        if (model_dir / "config.json").is_file():
            from transformers import AutoConfig

            config = AutoConfig.from_pretrained(model_dir)
        if (model_dir / "generation_config.json").is_file():
            from transformers import GenerationConfig

            generation_config = GenerationConfig.from_pretrained(model_dir)
        tokenizer = None
        if any((model_dir / name).is_file() for name in TOKENIZER_FILES):
            from transformers import AutoTokenizer

            tokenizer = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
        return cls(session, meta, model_dir=model_dir, config=config, generation_config=generation_config,
                   tokenizer=tokenizer, native=native, in_place=in_place)

    def save_pretrained(self, save_directory: str | os.PathLike) -> Path:
        """Write the model, its H2O metadata and the config / tokenizer files to ``save_directory``."""
        if self.model_dir is None:
            raise ValueError("this H2OOrtModel was not loaded from a directory; nothing to save")
        save_directory = Path(save_directory)
        save_directory.mkdir(parents=True, exist_ok=True)
        if save_directory.resolve() == self.model_dir.resolve():
            return save_directory
        # model.onnx plus any external-data file the exporter wrote beside it (model.onnx.data).
        names = [p.name for p in self.model_dir.iterdir() if p.name.startswith(MODEL_FILE)]
        names += [CONFIG_FILE] + [n for n in _COMPANION_FILES if (self.model_dir / n).is_file()]
        for name in names:
            shutil.copy2(self.model_dir / name, save_directory / name)
        return save_directory

    # -- state ---------------------------------------------------------------------------------------------

    def _state_specs(self, batch: int):
        """(shape, dtype, empty value) of every state tensor, in graph order (cache_plan.py)."""
        return [spec for layer in self.plan.layers for spec in layer.tensor_specs(batch)]

    def reset(self, batch_size: int, max_seq_len: int) -> None:
        """Empty caches of the exported C slots for ``batch_size`` rows and up to ``max_seq_len`` tokens."""
        from onnxruntime import OrtValue

        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"batch_size={batch_size!r} must be an int >= 1")
        fixed = self.meta.get("batch_size")
        if fixed is not None and batch_size != fixed:
            raise ValueError(f"batch_size={batch_size}: this model was exported for batch_size={fixed}")
        limit = int(self.meta["max_seq_len"])
        if isinstance(max_seq_len, bool) or not isinstance(max_seq_len, int) or max_seq_len < 1:
            raise ValueError(f"max_seq_len={max_seq_len!r} must be an int >= 1")
        if max_seq_len > limit:
            raise ValueError(f"a sequence of {max_seq_len} tokens (prompt + max_new_tokens) exceeds the "
                             f"exported max_seq_len={limit}; export again with a larger max_seq_len")
        if self._cache_dtype == torch.bfloat16:  # numpy, used for the initial values, has no bfloat16
            raise ValueError("bfloat16 caches are not supported by H2OOrtModel; export in float32 or float16")
        state, spare = [], []
        for shape, dtype, fill in self._state_specs(batch_size):
            # Initial values cross to the device once per reset; afterwards the state stays there.
            init = torch.full(shape, fill, dtype=dtype).numpy()
            state.append(OrtValue.ortvalue_from_numpy(init, self._ort_device, self._device_id))
            if not self._in_place:
                spare.append(OrtValue.ortvalue_from_shape_and_type(list(shape), init.dtype, self._ort_device,
                                                                  self._device_id))
        # In place (native kernel): present is written over past, one buffer set (export/native_session.py).
        self._state, self._spare = state, state if self._in_place else spare
        self._io = self.session.io_binding()
        self.seen = torch.zeros(batch_size, dtype=torch.long, device=self.device)
        self.max_seq_len, self._fed = max_seq_len, 0

    def state(self) -> list:
        """The current state as OrtValues, per layer: key, value, score (fp32), position (int64), and with
        kv_dtype="int8" the key and value scales."""
        if self._state is None:
            raise RuntimeError("no cache yet: call reset(batch_size, max_seq_len) or generate() first")
        return list(self._state)

    def kept_positions(self, layer: int) -> Tensor:
        """LongTensor [B, Hkv, C_layer] (on CPU): the position held by each slot of ``layer``, -1 = empty (a layer
        split by KV heads as H2OModel.kept_positions)."""
        state = self.state()
        positions = [torch.from_numpy(state[self._fields * i + 3].numpy()) for i in range(len(self.plan.layers))]
        return layer_positions([p.spec for p in self.plan.layers], positions, layer)

    def kv_cache_bytes(self, batch_size: int | None = None) -> int:
        """Bytes of the H2O state of all layers (keys, values, scores, positions, int8 scales; one of the two
        alternating sets, or the one set of the native in-place path) for ``batch_size`` rows: default the batch
        of the last reset(), or 1 before any."""
        batch = batch_size or (self.seen.shape[0] if self._state is not None else 1)
        return self.plan.nbytes(batch)

    # -- running -------------------------------------------------------------------------------------------

    def _bind_tensor(self, name: str, tensor: Tensor, output: bool = False) -> None:
        device = "cuda" if tensor.is_cuda else "cpu"
        index = tensor.device.index or 0
        bind = self._io.bind_output if output else self._io.bind_input
        bind(name, device, index, _ONNX_TYPES[tensor.dtype], list(tensor.shape), tensor.data_ptr())

    def _run(self, input_ids: Tensor, positions: Tensor, valid: Tensor) -> Tensor:
        """One graph call on a block: [B, T] int64, int64, bool -> logits [B, T, V]; swaps the state sets."""
        b, t = input_ids.shape
        logits = torch.empty(b, t, self._vocab, dtype=self._logits_dtype, device=self.device)
        tensors = (input_ids.contiguous(), positions.contiguous(), valid.contiguous())
        for name, tensor in zip(("input_ids", "position_ids", "valid"), tensors):
            self._bind_tensor(name, tensor)
        self._bind_tensor("logits", logits, output=True)
        for name, value in zip(self._past, self._state):
            self._io.bind_ortvalue_input(name, value)
        for name, value in zip(self._present, self._spare):
            self._io.bind_ortvalue_output(name, value)
        if logits.is_cuda:
            # ONNX Runtime runs on its own stream: wait until torch has written the inputs it will read.
            torch.cuda.current_stream(logits.device).synchronize()
        self.session.run_with_iobinding(self._io)
        self._state, self._spare = self._spare, self._state
        return logits

    @torch.no_grad()
    def step(self, input_ids: Tensor, attention_mask: Tensor | None = None, *, logits_to_keep: int = 0) -> Tensor:
        """Append a block of tokens and return its logits, exactly like :meth:`H2OModel.step`.

        Args:
            input_ids: [B, T] (B as given to reset); attention_mask: [B, T], 0 = left padding, or None.
            logits_to_keep: 0 = every position, 1 = the last one (the exported graph computes them all).
        Returns:
            logits [B, T, V] (or [B, 1, V]) on ``self.device``; padding positions hold meaningless values.
        """
        if logits_to_keep not in (0, 1) or isinstance(logits_to_keep, bool):
            raise ValueError(f"logits_to_keep={logits_to_keep!r}; allowed: 0 (every position) or 1 (the last)")
        self.state()
        input_ids, valid, positions = generation.place_block(self.seen, self._fed, self.max_seq_len, input_ids,
                                                             attention_mask, self.device,
                                                             int(self.meta["vocab_size"]))
        t = input_ids.shape[1]
        self._fed += t
        chunk = self.h2o_config.prefill
        chunk = t if chunk == "full" or t == 1 else int(chunk)
        logits = [self._run(input_ids[:, i:i + chunk], positions[:, i:i + chunk], valid[:, i:i + chunk])
                  for i in range(0, t, chunk)]
        if logits_to_keep == 1:
            return logits[-1][:, -1:]
        return logits[0] if len(logits) == 1 else torch.cat(logits, dim=1)

    def generate(self, input_ids: Tensor, attention_mask: Tensor | None = None, generation_config=None,
                 logits_processor=None, stopping_criteria=None, streamer=None, **kwargs):
        """transformers-style generation, as :meth:`H2OModel.generate` (same arguments, same loop; the defaults
        are the exported generation_config); prompt + new tokens must not exceed the exported max_seq_len
        (ValueError). Returns [B, P + n] on ``self.device``, or a GenerateDecoderOnlyOutput."""
        return generation.generate(self, input_ids, attention_mask, generation_config, logits_processor,
                                   stopping_criteria, streamer, **kwargs)

    @property
    def vocab_size(self) -> int:
        return int(self.meta["vocab_size"])

    # -- what transformers' pipelines ask of a causal LM (as H2OModel, runtime/hf_interface.py) ---------------

    @classmethod
    def can_generate(cls) -> bool:
        """True: ``generate`` takes transformers' arguments (pipelines check this before calling it)."""
        return True

    @property
    def dtype(self) -> torch.dtype:
        """The dtype of the logits the exported graph returns."""
        return self._logits_dtype

    def __call__(self, input_ids: Tensor, attention_mask: Tensor | None = None) -> Tensor:
        return self.step(input_ids, attention_mask)
