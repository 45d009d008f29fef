"""One request of continuous batching (h2o_compile/runtime/continuous_batching.py): its generation setup, exactly as
``generate`` builds it for the request alone, its prefill into a batch-1 scratch model, and its tokens."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from enum import IntEnum
from typing import Optional

import torch
from torch import Tensor

from . import generation_setup as setup
from .cache_plan import CachePlan
from .generation import check_token_ids

try:
    from transformers.generation.continuous_batching.requests import GenerationOutput, RequestStatus
except ImportError:  # pragma: no cover - transformers without continuous batching: the same fields
    class RequestStatus(IntEnum):
        PENDING = 0
        PREFILLING = 1
        DECODING = 2
        FINISHED = 3
        FAILED = 4

    @dataclass
    class GenerationOutput:
        request_id: str
        prompt_ids: list = field(default_factory=list)
        generated_tokens: list = field(default_factory=list)
        logprobs: list = field(default_factory=list)
        error: Optional[str] = None
        status: RequestStatus = RequestStatus.PENDING
        created_time: float = field(default_factory=time.perf_counter)
        lifespan: tuple = (-1, -1)
        timestamps: Optional[list] = None

        def is_finished(self) -> bool:
            return self.status >= RequestStatus.FINISHED

# Settings of generate that a request's output (a GenerationOutput of token ids) has no place for.
_NO_PLACE = ("return_dict_in_generate", "output_scores", "output_logits")


class Request:
    """A request's prompt [1, P], its transformers processors and stopping criteria, its token buffer [1, width]
    (prompt, then the new tokens; width = P + max_new_tokens) and, while it decodes, its batch row."""

    def __init__(self, request_id: str, prompt: Tensor, mask: Optional[Tensor], config, processors, criteria,
                 early: bool, generator: Optional[torch.Generator], streaming: bool, record_timestamps: bool):
        self.id, self.prompt, self.mask, self.config = request_id, prompt, mask, config
        self.processors, self.criteria, self.early = processors, criteria, early
        self.generator, self.streaming = generator, streaming
        self.timestamps = [] if record_timestamps else None
        self.width = config.max_length
        self.buffer = torch.empty(1, self.width, dtype=torch.long, device=prompt.device)
        self.buffer[:, :prompt.shape[1]] = prompt
        self.length = prompt.shape[1]   # tokens in the buffer
        self.tokens: list[int] = []     # the new ones
        self.row: Optional[int] = None
        self.fed = 0                    # prompt tokens prefilled so far
        self.created = time.perf_counter()
        self.admitted = -1.0
        # Greedy with no processor: the manager takes one argmax over all such rows at once.
        self.plain_greedy = not config.do_sample and len(processors) == 0

    def start(self, twin, capacity: int) -> None:
        """Begin the prefill: the scratch model gets one empty row of the batch rows' size."""
        twin.reset(1, capacity=capacity)
        self.fed, self.admitted = 0, time.perf_counter()

    def prefill(self, twin, chunk: Optional[int]) -> Optional[Tensor]:
        """Feed the prompt (all of it, or the next ``chunk`` tokens) into the scratch model; the logits [1, V]
        of its last position once the whole prompt is in, else None."""
        end = self.prompt.shape[1] if chunk is None else min(self.prompt.shape[1], self.fed + chunk)
        mask = None if self.mask is None else self.mask[:, self.fed:end]
        logits = twin.step(self.prompt[:, self.fed:end], mask, logits_to_keep=1)[:, -1]    # [1, V]
        self.fed = end
        return logits if end == self.prompt.shape[1] else None

    def choose(self, logits: Tensor) -> int:
        """The next token from this request's logits [V], as generate picks it."""
        raw = logits[None].to(dtype=torch.float32, copy=True)                            # [1, V]
        processed = self.processors(self.buffer[:, :self.length], raw)
        if self.config.do_sample:
            probs = torch.softmax(processed, dim=-1)
            return int(torch.multinomial(probs, num_samples=1, generator=self.generator))
        return int(torch.argmax(processed, dim=-1))

    def append(self, token: int) -> bool:
        """Add a new token; returns whether the request is done (its buffer full or a stopping criterion)."""
        self.buffer[0, self.length] = token
        self.length += 1
        self.tokens.append(token)
        if self.timestamps is not None:
            self.timestamps.append(time.perf_counter())
        if self.length >= self.width:
            return True
        return self.early and bool(self.criteria(self.buffer[:, :self.length], None)[0])

    def output(self, status, error: Optional[str] = None, finished: float = -1.0) -> GenerationOutput:
        return GenerationOutput(request_id=self.id, prompt_ids=self.prompt[0].tolist(),
                                generated_tokens=list(self.tokens), error=error, status=status,
                                created_time=self.created, lifespan=(self.admitted, finished),
                                timestamps=None if self.timestamps is None else list(self.timestamps))


def finished_output(request: Request, error: Optional[str] = None) -> GenerationOutput:
    status = RequestStatus.FINISHED if error is None else RequestStatus.FAILED
    return request.output(status, error, time.perf_counter())


def make_request(opt, request_id: str, input_ids, generation_config, logits_processor, stopping_criteria,
                 options: dict, *, seed: Optional[int], streaming: bool, record_timestamps: bool,
                 max_seq_len: Optional[int]) -> Request:
    """Validate one request and build its generation setup as ``generate`` does for a batch of this one prompt
    (generation.py's _generate): the config, EOS / pad, the inferred mask, lengths, processors and criteria."""
    from transformers import generation as hf

    prompt = _prompt_tensor(input_ids)
    check_token_ids(prompt, getattr(opt, "vocab_size", None))
    config, extras = setup.prepare_config(getattr(opt, "generation_config", None), generation_config, options)
    for name in _NO_PLACE:
        if getattr(config, name, False):
            raise ValueError(f"{name}=True: a continuous batching output (GenerationOutput) holds token ids only; "
                             "use generate for scores and logits")
    if (config.num_return_sequences or 1) != 1:
        raise ValueError(f"num_return_sequences={config.num_return_sequences}: add the prompt that many times "
                         "(with a seed each when sampling)")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
        raise TypeError(f"seed={seed!r} must be an int or None")
    device = opt.device
    prompt = prompt.to(device)
    eos, pad = setup.special_tokens(config, device)
    mask = setup.infer_mask(prompt, eos, pad)
    if mask is not None and bool(mask.all()):
        mask = None
    if mask is not None and not bool(mask[:, -1].all()):
        raise ValueError("the prompt ends with pad_token_id, which generate would read as right padding")
    prompt_len = prompt.shape[1]
    max_positions = getattr(getattr(opt, "config", None), "max_position_embeddings", None)
    setup.lengths(config, extras, prompt_len, max_positions)
    if max_seq_len is not None and config.max_length > max_seq_len:
        raise ValueError(f"request {request_id!r}: prompt {prompt_len} + new tokens reach {config.max_length}, beyond "
                         f"the manager's max_seq_len={max_seq_len}")
    # The check generate's reset(1, P + max_new_tokens) makes: the sequence fits the model's positions.
    CachePlan.check_lengths(opt.h2o_config, opt.limits, config.max_length)
    processors = setup.logits_processors(config, prompt_len, mask, eos, device, logits_processor)
    criteria = setup.stopping_criteria(config, eos, extras["tokenizer"], max_positions, stopping_criteria)
    early = any(not (isinstance(c, hf.MaxLengthCriteria) and c.max_length >= config.max_length) for c in criteria)
    generator = None
    if seed is not None and config.do_sample:
        generator = torch.Generator(device=device).manual_seed(seed)
    return Request(request_id, prompt, mask, config, processors, criteria, early, generator, streaming,
                   record_timestamps)


def _prompt_tensor(input_ids) -> Tensor:
    """[1, P] int64 on the CPU from a list of ints, a 1-D tensor or a [1, P] tensor."""
    if isinstance(input_ids, Tensor):
        if input_ids.dim() == 2 and input_ids.shape[0] == 1:
            input_ids = input_ids[0]
        if input_ids.dim() != 1 or input_ids.dtype not in (torch.int64, torch.int32):
            raise ValueError(f"input_ids must be one prompt: a 1-D (or [1, P]) integer tensor, got "
                             f"{input_ids.dtype} {tuple(input_ids.shape)}")
        prompt = input_ids.detach().to("cpu", torch.long)
    elif isinstance(input_ids, (list, tuple)) and all(isinstance(t, int) and not isinstance(t, bool)
                                                      for t in input_ids):
        prompt = torch.tensor(list(input_ids), dtype=torch.long)
    else:
        raise TypeError(f"input_ids must be a list of token ids or an integer tensor, got {type(input_ids).__name__}"
                        + (f" of {type(input_ids[0]).__name__}" if isinstance(input_ids, (list, tuple))
                           and input_ids else ""))
    if prompt.numel() == 0:
        raise ValueError("input_ids is empty: give at least one prompt token")
    return prompt[None]
