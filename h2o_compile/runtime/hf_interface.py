"""What transformers' generation, pipeline and evaluation code asks of a causal LM, for H2OModel.

``CausalLMInterface`` is mixed into :class:`h2o_compile.runtime.H2OModel`: ``config``-side attributes
(``generation_config`` settable, ``dtype``, ``can_generate()``, ``main_input_name``, modalities), a stateless
``forward(input_ids, attention_mask, labels) -> CausalLMOutputWithPast`` that scores a sequence as H2O decodes it,
``save_pretrained`` / ``from_pretrained``, and ``.to()`` / ``.half()`` / ``.cuda()`` that rebuild the H2O graph
and state for the converted model (the graph is captured at one dtype and device, so converting it in place
would leave dtype-specific constants and state behind).
"""

from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path
from typing import Optional, Union

import torch
import torch.nn.functional as F
from torch import Tensor

from ..config import H2OConfig
from .generation import model_lock

H2O_FILE = "h2o_model.json"   # beside the transformers checkpoint; not export/onnx.py's h2o_config.json
_FILE_FORMAT = 1
IGNORE_INDEX = -100           # transformers' label value for positions without a loss
# Keyword arguments harnesses pass to a causal LM's forward that change nothing here.
_IGNORED_FORWARD_ARGS = ("use_cache", "return_dict", "output_attentions", "output_hidden_states")


class CausalLMInterface:
    """The transformers-facing half of H2OModel (see the module docstring); needs ``self.model``,
    ``self.h2o_config``, ``reset``, ``step``, ``self.stream`` and ``from_model`` (:func:`optimize`)."""

    main_input_name = "input_ids"
    input_modalities = ("text",)
    output_modalities = ("text",)

    @classmethod
    def can_generate(cls) -> bool:
        """True: ``generate`` takes transformers' arguments (pipelines check this before calling it)."""
        return True

    @property
    def generation_config(self):
        """The wrapped model's GenerationConfig: generate's defaults, as in transformers (settable)."""
        return getattr(self.model, "generation_config", None)

    @generation_config.setter
    def generation_config(self, value) -> None:
        from transformers import GenerationConfig

        if value is not None and not isinstance(value, GenerationConfig):
            raise TypeError(f"generation_config must be a transformers.GenerationConfig or None, got "
                            f"{type(value).__name__}")
        self.model.generation_config = value

    def tie_weights(self) -> None:
        """Nothing to do: the wrapped model tied its weights when it was built (harnesses such as lm-eval's HFLM
        call this on any model they are given)."""

    @property
    def dtype(self) -> torch.dtype:
        """The dtype of the model's floating-point weights (and of the cached keys and values)."""
        return next((p.dtype for p in self.model.parameters() if p.is_floating_point()), torch.float32)

    # -- scoring -------------------------------------------------------------------------------------------

    def forward(self, input_ids: Tensor, attention_mask: Optional[Tensor] = None, labels: Optional[Tensor] = None,
                *, prompt_length: int = 1, **kwargs):
        """Score ``input_ids`` as H2O decodes them, on a fresh cache: the logits each position gets from the
        state H2O keeps at that point (not from the full cache), so a loss over a text measures the method.

        The first ``prompt_length`` tokens go in as one prompt block (as ``generate`` feeds a prompt; the
        config's ``prefill`` chunks it), then every later token is one decode step: with ``prefill="full"``
        and the default ``prompt_length=1`` that is one step per token, the teacher-forced stream of
        ``reset(B, S)`` + ``step`` of each token. Cost: one graph call per token after the prompt (S -
        prompt_length + 1 calls), against one call for the original model's forward; the cache holds
        capacity(S) slots. No gradients flow (inference only).
        A stream in progress (``reset`` / ``step``) is put back afterwards, untouched.

        Args:
            input_ids: [B, S] int token ids; attention_mask: [B, S] (0 = padding; padding at either end, as
                tokenizers pad) or None; labels: [B, S] int, -100 = no loss, or None.
            prompt_length: tokens (of the S columns, padding included) fed as the first block, 1 <= it <= S.
            use_cache / return_dict / output_attentions / output_hidden_states: accepted for transformers'
                callers, ignored (no cache object or attentions are returned).
        Returns:
            transformers' CausalLMOutputWithPast: ``logits`` [B, S, V] in the model's dtype (padding
            positions' logits are unspecified) and, with ``labels``, ``loss``: the mean cross-entropy of
            logits[:, :-1] against labels[:, 1:] over the labels that are not -100 (transformers' shift).
        """
        from transformers.modeling_outputs import CausalLMOutputWithPast

        unknown = sorted(set(kwargs) - set(_IGNORED_FORWARD_ARGS))
        if unknown:
            raise TypeError(f"forward() got unexpected arguments {unknown}; it takes input_ids, attention_mask, "
                            f"labels, prompt_length and ignores {list(_IGNORED_FORWARD_ARGS)}")
        if kwargs.get("return_dict", True) is False:
            raise ValueError("return_dict=False: forward returns a CausalLMOutputWithPast only (use .logits)")
        mask = _check_scoring_inputs(input_ids, attention_mask, labels, prompt_length)
        batch, total = input_ids.shape
        with model_lock(self), self._fresh_stream():
            self.reset(batch, total)
            blocks = [slice(0, prompt_length)] + [slice(t, t + 1) for t in range(prompt_length, total)]
            logits = torch.cat([self.step(input_ids[:, b], None if mask is None else mask[:, b])
                                for b in blocks], dim=1)                              # [B, S, V]
        loss = None
        if labels is not None:
            labels = labels.to(logits.device)
            loss = F.cross_entropy(logits[:, :-1].float().reshape(-1, logits.shape[-1]),
                                   labels[:, 1:].reshape(-1).long(), ignore_index=IGNORE_INDEX)
        return CausalLMOutputWithPast(loss=loss, logits=logits)

    @contextlib.contextmanager
    def _fresh_stream(self):
        """Run the body on caches of its own; the stream of reset/step comes back."""
        saved = self.stream
        try:
            yield
        finally:
            self.stream = saved

    # -- continuous batching ------------------------------------------------------------------------------

    def generate_batch(self, inputs, generation_config=None, **kwargs):
        """transformers' ``generate_batch``: every prompt of ``inputs`` (lists of token ids) through continuous
        batching over fixed H2O rows; {request id: GenerationOutput} in the order of ``inputs``. Arguments:
        :func:`h2o_compile.runtime.continuous_batching.generate_batch`."""
        # Imported on use: transformers' continuous batching module imports torch._dynamo, and with it Triton.
        from .continuous_batching import generate_batch

        return generate_batch(self, inputs, generation_config, **kwargs)

    def init_continuous_batching(self, generation_config=None, continuous_batching_config=None, workload_hints=None,
                                 **kwargs):
        """transformers' ``init_continuous_batching``: a manager for a live stream (``add_request``, ``start``,
        ``get_result``, ``stop``). ``continuous_batching_config``: only its ``max_requests_per_batch`` is read
        (the rows, unless ``max_batch_size`` is given); ``workload_hints`` size paged caches and are ignored.
        Other arguments: :class:`h2o_compile.runtime.continuous_batching.ContinuousBatchingManager`."""
        from .continuous_batching import ContinuousBatchingManager  # on use, as in generate_batch

        rows = getattr(continuous_batching_config, "max_requests_per_batch", None)
        if rows is not None:
            kwargs.setdefault("max_batch_size", rows)
        return ContinuousBatchingManager(self, generation_config, **kwargs)

    # -- saving and loading --------------------------------------------------------------------------------

    def save_pretrained(self, save_directory: Union[str, os.PathLike], **kwargs) -> Path:
        """Write the transformers checkpoint (``self.model.save_pretrained(save_directory, **kwargs)``) and,
        beside it, ``h2o_model.json``: the H2O configuration (``H2OConfig.to_dict()``) and the compile settings.
        :meth:`from_pretrained` reads both back; ``AutoModelForCausalLM.from_pretrained(dir)`` still opens the
        plain model. Returns the directory."""
        save_directory = Path(save_directory)
        if save_directory.exists() and not save_directory.is_dir():
            raise ValueError(f"save_directory={str(save_directory)!r} is a file, not a directory")
        save_directory.mkdir(parents=True, exist_ok=True)
        self.model.save_pretrained(save_directory, **kwargs)
        meta = {"format": _FILE_FORMAT, "config": self.h2o_config.to_dict(), "compile": self.compile_mode,
                "regional_compile": self.regional_compile}
        (save_directory / H2O_FILE).write_text(json.dumps(meta, indent=2) + "\n")
        return save_directory

    @classmethod
    def from_pretrained(cls, model_dir: Union[str, os.PathLike], *, dtype: Union[str, torch.dtype] = "auto",
                        device: Union[str, torch.device, None] = None, compile=None, **options):
        """Open what :meth:`save_pretrained` wrote, in a local directory or a Hub repository (``model_dir`` a Hub
        id, resolved by transformers with the user's Hub cache, token and offline mode): the transformers model
        (``AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype)``, moved to ``device``), optimized with
        the saved H2O configuration; ``**options`` (any H2OConfig / ScoreRule field, e.g. ``budget=0.1``) and
        ``compile`` override what was saved."""
        from transformers import AutoModelForCausalLM
        from transformers.utils import cached_file

        try:
            path = cached_file(str(model_dir), H2O_FILE, _raise_exceptions_for_missing_entries=False)
        except OSError:  # neither a folder nor a repository id transformers can resolve
            path = None
        if path is None:
            raise ValueError(f"{model_dir} has no {H2O_FILE}: write it with H2OModel.save_pretrained(), or "
                             "optimize(AutoModelForCausalLM.from_pretrained(dir), ...) a plain checkpoint")
        meta = json.loads(Path(path).read_text())
        if meta.get("format") != _FILE_FORMAT:
            raise ValueError(f"{path} has format {meta.get('format')!r}; this version reads format {_FILE_FORMAT}")
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).eval()
        if device is not None:
            model = model.to(device)
        return cls.from_model(model, config=H2OConfig.from_dict(meta["config"]),
                              compile=meta.get("compile", "auto") if compile is None else compile,
                              regional_compile=meta.get("regional_compile", False), **options)

    # -- device and dtype ----------------------------------------------------------------------------------

    def _apply(self, fn, recurse: bool = True):
        """``.to()``, ``.half()``, ``.bfloat16()``, ``.float()``, ``.cuda()``, ``.cpu()`` all come here: the
        wrapped model is converted, and when its device or dtype changed the graph is captured again and the
        H2O state rebuilt for it, exactly as ``optimize`` of the converted model would (the captured graph holds
        constants of the old dtype and device). The cache is emptied: call ``reset`` or ``generate`` next."""
        before = (self.device, self.dtype)
        self.model._apply(fn, recurse)
        if (self.device, self.dtype) == before:
            return super()._apply(fn, recurse)
        self._rebuild()
        return self

    def _rebuild(self) -> None:
        try:
            fresh = self.from_model(self.model, config=self.h2o_config, compile=self.compile_mode,
                             regional_compile=self.regional_compile)
        except (ValueError, TypeError) as error:  # UnsupportedModelError is a ValueError too
            raise ValueError(f"the wrapped model is now {self.dtype} on {self.device}, but the H2O graph could not be "
                             f"rebuilt for it ({error}); convert the model before optimize(), with a config "
                             "served there") from error
        # The object stays the same (nn.Module.to converts in place and returns self), with the fresh state.
        self.__dict__.clear()
        self.__dict__.update(fresh.__dict__)


_registered: set = set()


def register_for_pipelines(model_class: type) -> None:
    """Name ``model_class`` among transformers' causal LMs (``AutoModelForCausalLM.register``), once per process,
    so that ``pipeline("text-generation", model=opt)`` does not log that the class is unsupported (the pipeline
    checks the class name against that table). The key is a config class of our own, one per model class, which
    no checkpoint uses: ``AutoModelForCausalLM`` still maps every transformers config to its own model."""
    if model_class in _registered:
        return
    from transformers import AutoModelForCausalLM, PretrainedConfig

    config_class = type(f"{model_class.__name__}Config", (PretrainedConfig,),
                        {"model_type": f"h2o_compile_{model_class.__name__.lower()}"})
    AutoModelForCausalLM.register(config_class, model_class, exist_ok=True)
    _registered.add(model_class)


def _check_scoring_inputs(input_ids, attention_mask, labels, prompt_length) -> Optional[Tensor]:
    """Validate forward()'s inputs; returns the mask as bool (None when absent)."""
    if not isinstance(input_ids, Tensor) or input_ids.dim() != 2 or input_ids.dtype not in (torch.int64, torch.int32):
        got = f"{input_ids.dtype} {tuple(input_ids.shape)}" if isinstance(input_ids, Tensor) else type(input_ids)
        raise ValueError(f"input_ids must be an integer tensor [batch, seq_len], got {got}")
    total = input_ids.shape[1]
    if total == 0:
        raise ValueError("input_ids is empty: give at least one token")
    if isinstance(prompt_length, bool) or not isinstance(prompt_length, int) or not 1 <= prompt_length <= total:
        raise ValueError(f"prompt_length={prompt_length!r} must be an int in [1, {total}] (the sequence length)")
    if labels is not None:
        if not isinstance(labels, Tensor) or labels.shape != input_ids.shape or labels.is_floating_point():
            got = f"{labels.dtype} {tuple(labels.shape)}" if isinstance(labels, Tensor) else type(labels).__name__
            raise ValueError(f"labels must be an integer tensor shaped like input_ids {tuple(input_ids.shape)}, "
                             f"got {got}")
    if attention_mask is None:
        return None
    if not isinstance(attention_mask, Tensor) or attention_mask.shape != input_ids.shape:
        got = tuple(attention_mask.shape) if isinstance(attention_mask, Tensor) else type(attention_mask).__name__
        raise ValueError(f"attention_mask {got} must match input_ids {tuple(input_ids.shape)}")
    mask = attention_mask.bool()
    if not bool(mask.any(dim=1).all()):
        raise ValueError("attention_mask has a row with no tokens (all zeros)")
    return mask


__all__ = ["CausalLMInterface", "H2O_FILE", "register_for_pipelines"]
