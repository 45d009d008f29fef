"""Continuous batching on an H2OModel: requests join and leave a running batch of fixed rows.

H2O gives every row a fixed number of cache slots whatever its length, so a batch of ``max_batch_size`` rows has
a memory size known before the first request arrives: no paging, no preemption. The manager keeps that batch
alive; a waiting request takes a free row, decodes with the others in one static-shape step, and frees its row
the step it finishes (EOS, a stop string or another stopping criterion, its own ``max_new_tokens``).

Sizing: the batch's state is the stream sizing ``opt.reset(max_batch_size, capacity=C)``: C slots per row and
layer whatever the request's length, so one decode step (eager or compiled) serves every mix of rows and
lengths and nothing recompiles when requests come and go. C is the budget when it is an int, else
``budget x max_seq_len`` for a ``max_seq_len`` given up front (a float budget is a share of a length, and the
shape cannot follow each request's). A request alone through ``opt.generate`` gets the same C whenever it
evicts (an int budget C: min(C, P + n) slots), so its tokens and kept positions are the ones it gets here.

Prefill: a new request's prompt runs as a batch-1 prefill into a scratch twin of the model (same graph and
weights, its own one-row state, sized like the batch's rows), then the twin's row is copied into the free row
(keys, values, scores, positions; the row's token count). Why not chunked prefill inside the batch step: the
batch step is a one-token step (the compiled, static-shape one); a prompt block in it would need every row to
carry T tokens (mostly padding) and a second compiled shape per T. The batch-1 prefill costs the prompt's own
tokens, runs the very blocks ``generate`` runs (``H2OConfig.prefill``: the whole prompt or chunks of c), and so
gives the same state as the request alone. The running rows wait for it; ``prefill_chunk`` (with an int
``H2OConfig.prefill`` and no prompt-only score rule) feeds the prompt one chunk per manager step instead, so
a long prompt never stalls the running rows for more than one chunk.

Generation semantics are ``generate``'s, per request: transformers' GenerationConfig (the model's defaults,
``generation_config``, keyword overrides), its logits processors and stopping criteria built by
:mod:`h2o_compile.runtime.generation_setup` for that request's prompt, greedy argmax or ``torch.multinomial`` of the
softmax, drawn from the request's own ``torch.Generator`` when a ``seed`` is given (the draws
``torch.manual_seed(seed)`` + ``generate`` makes for it alone), else from torch's global generator.
"""

from __future__ import annotations

import copy
import queue
import threading
from collections import deque
from typing import Optional

import torch
from torch import Tensor

# GenerationOutput / RequestStatus: transformers' own classes (its continuous batching's outputs).
from .continuous_requests import GenerationOutput, Request, RequestStatus, finished_output, make_request

__all__ = ["ContinuousBatchingManager", "GenerationOutput", "RequestStatus", "generate_batch"]


def _twin(opt):
    """A scratch H2OModel sharing ``opt``'s graph, weights and settings but holding its own state buffers, for
    batch-1 prefills. It runs eagerly: a one-token prompt would otherwise compile a batch-1 decode step."""
    twin = copy.copy(opt)
    twin._modules = dict(opt._modules)  # reset() registers its fresh stream into this dict, not opt's
    twin.compile_mode = False
    return twin


class ContinuousBatchingManager:
    """A live stream of requests over one H2OModel: ``add_request``, then ``step()`` yourself or ``start()`` a
    background thread; results come from ``get_result`` / iteration as requests finish; ``stop()`` ends it.

    Args:
        opt: the H2OModel; the manager owns its cache while it runs (a ``generate`` or ``reset`` on the same
            model in between is detected and raises RuntimeError).
        generation_config, **kwargs: the defaults of every request, as ``generate`` takes them (each request may
            override them).
        max_batch_size: rows of the batch (requests decoding at once); more wait in arrival order.
        capacity / max_seq_len: the rows' sizing (module docstring): an int budget needs neither; a float
            budget needs ``max_seq_len``, which then bounds every request's prompt + max_new_tokens.
        prefill_chunk: None = a prompt is prefilled whole when its request is admitted; an int c = one block of
            c tokens per manager step (needs an int ``H2OConfig.prefill`` equal to c and a score rule that
            does not treat the prompt specially, so the blocks are the ones ``generate`` runs).
    """

    def __init__(self, opt, generation_config=None, *, max_batch_size: int = 8, capacity: Optional[int] = None,
                 max_seq_len: Optional[int] = None, prefill_chunk: Optional[int] = None, **kwargs):
        if isinstance(max_batch_size, bool) or not isinstance(max_batch_size, int) or max_batch_size < 1:
            raise ValueError(f"max_batch_size={max_batch_size!r} must be an int >= 1")
        if opt.h2o_config.splits_by_prompt:
            raise ValueError(f"allocation={opt.h2o_config.allocation!r} sizes each request's cache from its own "
                             "prompt, but continuous batching keeps every row in one state of fixed slots per "
                             "layer: calibrate the split once (h2o_compile.calibrate) and serve that")
        self.opt, self.rows = opt, max_batch_size
        self.capacity, self.max_seq_len = _row_capacity(opt.h2o_config, capacity, max_seq_len)
        self.prefill_chunk = _check_chunk(opt.h2o_config, prefill_chunk)
        self.generation_config, self.defaults = generation_config, kwargs
        self.device = opt.device
        opt.reset(max_batch_size, capacity=self.capacity)
        self._stream = opt.stream  # to notice a reset by someone else
        self._twin = _twin(opt)
        self._slots: list[Optional[Request]] = [None] * max_batch_size
        self._next = torch.zeros(max_batch_size, dtype=torch.long, device=self.device)   # [B] next input token
        self._active = torch.zeros(max_batch_size, dtype=torch.bool, device=self.device)  # [B] rows decoding
        self._waiting: deque[Request] = deque()
        self._prefilling: Optional[Request] = None  # with prefill_chunk: the request whose prompt is going in
        self._requests: dict[str, Request] = {}
        self._counter = 0
        self._lock = threading.RLock()
        self._wake = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self._stop = threading.Event()
        self.error: Optional[BaseException] = None
        self.output_queue: "queue.Queue[GenerationOutput]" = queue.Queue()
        self.decode_steps = 0
        self._finished: list[GenerationOutput] = []  # outputs of the current step()

    # -- requests ----------------------------------------------------------------------------------------

    def add_request(self, input_ids, request_id: Optional[str] = None, max_new_tokens: Optional[int] = None, *,
                    seed: Optional[int] = None, streaming: bool = False, record_timestamps: bool = False,
                    generation_config=None, logits_processor=None, stopping_criteria=None, **kwargs) -> str:
        """Queue a request; returns its id (``req_<n>`` unless given).

        Args:
            input_ids: the prompt, a list of ints or a 1-D / [1, P] integer tensor (no padding).
            max_new_tokens, generation_config, logits_processor, stopping_criteria, **kwargs: as ``generate``
                (over the manager's defaults); ``tokenizer=`` for stop_strings.
            seed: with sampling, this request draws from its own generator seeded so.
            streaming: also put a partial GenerationOutput in the output queue after each token.
            record_timestamps: note the time of each new token in ``output.timestamps``.
        """
        options = {**self.defaults, **kwargs}
        if max_new_tokens is not None:
            options["max_new_tokens"] = max_new_tokens
        with self._lock:
            if request_id is None:
                request_id = f"req_{self._counter}"
            if request_id in self._requests:
                raise ValueError(f"request_id={request_id!r} is already in use")
            self._counter += 1
            request = make_request(self.opt, request_id, input_ids, generation_config or self.generation_config,
                                   logits_processor, stopping_criteria, options, seed=seed, streaming=streaming,
                                   record_timestamps=record_timestamps, max_seq_len=self.max_seq_len)
            self._requests[request_id] = request
            self._waiting.append(request)
        self._wake.set()
        return request_id

    def add_requests(self, inputs, max_new_tokens: Optional[int] = None, **kwargs) -> list[str]:
        """``add_request`` for each prompt of ``inputs``, in order; returns their ids."""
        return [self.add_request(ids, max_new_tokens=max_new_tokens, **kwargs) for ids in inputs]

    def cancel_request(self, request_id: str) -> None:
        """Drop a waiting or running request (its row frees at once); its output ends FAILED, error 'cancelled'."""
        with self._lock:
            request = self._requests.get(request_id)
            if request is None:
                return
            if request in self._waiting:
                self._waiting.remove(request)
            if self._prefilling is request:
                self._prefilling = None
            self._finish(request, error="cancelled")

    @property
    def pending(self) -> int:
        """Requests not finished yet (waiting, prefilling or decoding)."""
        return len(self._requests)

    @property
    def running(self) -> int:
        """Rows decoding now."""
        return sum(r is not None for r in self._slots)

    # -- one step ----------------------------------------------------------------------------------------

    @torch.no_grad()
    def step(self) -> list[GenerationOutput]:
        """Admit waiting requests into free rows (their prefill; with ``prefill_chunk`` one chunk), then one
        decode step for every running row; returns the outputs of the requests that finished in it."""
        with self._lock:
            if self.opt.stream is not self._stream:
                raise RuntimeError("the model's cache was reset (generate or reset on the same H2OModel) while the "
                                   "continuous batching manager owns it; use a second optimize() for other calls")
            self._finished = []
            self._admit()
            if self._active.any():
                self._decode()
            finished, self._finished = self._finished, []
            return finished

    def warmup(self) -> None:
        """One decode step with every row free (no state changes): compiles the batch step at its shapes."""
        with torch.no_grad(), self._lock:
            self._run_batch_step()

    def _admit(self) -> None:
        while True:
            free = next((i for i, r in enumerate(self._slots) if r is None), None)
            if free is None:
                return
            if self._prefilling is None:
                if not self._waiting:
                    return
                self._prefilling = self._waiting.popleft()
                self._prefilling.start(self._twin, self.capacity)
            request = self._prefilling
            logits = request.prefill(self._twin, self.prefill_chunk)  # [1, V], or None while chunks remain
            if logits is None:
                return  # the rest of the prompt goes in at the next steps
            self._prefilling = None
            self._stream.copy_row(self._twin.stream, 0, free)
            self._slots[free], request.row = request, free
            token = request.choose(logits[0])                                  # the first new token
            if self._after_token(request, token):
                continue
            self._next[free], self._active[free] = token, True

    def _run_batch_step(self) -> Tensor:
        # The batch has no end (capacity sizing): place_block's positions are per row; the model's count of
        # fed tokens is only its position check's "longest row", which is the longest running request.
        self._stream.fed = max((r.length for r in self._slots if r is not None), default=0)
        return self.opt.step(self._next[:, None], self._active[:, None])[:, -1]    # [B, V]

    def _decode(self) -> None:
        logits = self._run_batch_step()
        self.decode_steps += 1
        running = [(i, r) for i, r in enumerate(self._slots) if r is not None]
        greedy = [i for i, r in running if r.plain_greedy]
        fast = dict(zip(greedy, logits[greedy].argmax(dim=-1).tolist())) if greedy else {}
        for i, request in running:
            token = fast[i] if i in fast else request.choose(logits[i])
            if not self._after_token(request, token):
                self._next[i] = token

    def _after_token(self, request: Request, token: int) -> bool:
        """Record a new token; finish the request if it stopped. Returns whether it finished."""
        if request.append(token):
            self._finish(request)
            return True
        if request.streaming:
            self.output_queue.put(request.output(RequestStatus.DECODING))
        return False

    def _finish(self, request: Request, error: Optional[str] = None) -> None:
        self._requests.pop(request.id, None)
        if request.row is not None:  # the row frees at once: the next admitted request takes it
            self._stream.reset_row(request.row)
            self._slots[request.row] = None
            self._active[request.row] = False
            request.row = None
        output = finished_output(request, error)
        self._finished.append(output)
        self.output_queue.put(output)

    # -- a background loop, as transformers' manager ------------------------------------------------------

    def start(self) -> None:
        """Run ``step()`` in a background thread until ``stop()``; it sleeps while there is nothing to do."""
        if self.is_running():
            return
        self._stop.clear()
        self._thread = threading.Thread(target=self._loop, name="h2o-continuous-batching", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        try:
            while not self._stop.is_set():
                if not self.pending:
                    self._wake.wait(0.05)
                    self._wake.clear()
                    continue
                self.step()
        except BaseException as exc:  # noqa: BLE001 - surfaced to the caller by get_result / stop
            self.error = exc

    def is_running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def stop(self, block: bool = True, timeout: Optional[float] = None) -> None:
        """Stop the background loop (requests still pending stay so; ``step()`` may go on serving them)."""
        self._stop.set()
        self._wake.set()
        if block and self._thread is not None:
            self._thread.join(timeout)
        if self.error is not None:
            raise RuntimeError("the continuous batching loop failed") from self.error

    def get_result(self, request_id: Optional[str] = None, timeout: Optional[float] = None):
        """The next output from the queue (a finished request, or with ``streaming`` a partial one); None after
        ``timeout`` seconds. With ``request_id``, an output of another request goes back to the queue."""
        try:
            result = self.output_queue.get(timeout=timeout)
        except queue.Empty:
            if self.error is not None:
                raise RuntimeError("the continuous batching loop failed") from self.error
            return None
        if request_id is not None and result.request_id != request_id:
            self.output_queue.put(result)
            return None
        return result

    def __iter__(self):
        """Outputs as they come while the background loop runs."""
        while self.is_running() or not self.output_queue.empty():
            result = self.get_result(timeout=0.1)
            if result is not None:
                yield result

    def run_until_done(self, progress: bool = False) -> dict[str, GenerationOutput]:
        """Step (in this thread) until no request is pending; returns the finished outputs by id."""
        from tqdm.auto import tqdm

        results = {}
        with tqdm(total=self.pending, disable=not progress, unit="request") as bar:
            while self.pending:
                for output in self.step():
                    results[output.request_id] = output
                    bar.update(1)
        while not self.output_queue.empty():  # what step() returned is in the queue too
            self.output_queue.get_nowait()
        return results


def _row_capacity(config, capacity: Optional[int], max_seq_len: Optional[int]) -> tuple[int, Optional[int]]:
    """(C, max_seq_len or None): the slots of every row (module docstring)."""
    for name, value in (("capacity", capacity), ("max_seq_len", max_seq_len)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise ValueError(f"{name}={value!r} must be an int >= 1 or None")
    if capacity is not None:
        return capacity, max_seq_len
    if max_seq_len is not None:
        return config.capacity(max_seq_len), max_seq_len
    if isinstance(config.budget, int) and config.policy != "full":
        return config.budget, None
    raise ValueError(f"budget={config.budget!r} with policy={config.policy!r} sizes a row from a length: give "
                     "max_seq_len= (the longest prompt + max_new_tokens of any request) or capacity= (slots per row)")


def _check_chunk(config, chunk: Optional[int]) -> Optional[int]:
    if chunk is None:
        return None
    if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1:
        raise ValueError(f"prefill_chunk={chunk!r} must be an int >= 1 or None")
    if config.prefill != chunk or config.scores_prompt_specially:
        raise ValueError(f"prefill_chunk={chunk} needs optimize(prefill={chunk}) and a score rule without a prompt "
                         f"window or pooling (the model has prefill={config.prefill!r}), so that the chunks fed "
                         "between decode steps are the blocks generate runs")
    return chunk


@torch.no_grad()
def generate_batch(opt, inputs, generation_config=None, continuous_batching_config=None,
                   record_timestamps: bool = False, progress_bar: bool = False, persistent_manager: bool = False,
                   warmup: bool = True, *, max_batch_size: Optional[int] = None, seeds=None,
                   **kwargs) -> dict[str, GenerationOutput]:
    """transformers' ``model.generate_batch`` on an H2OModel: every prompt of ``inputs`` through continuous
    batching; returns {request id: GenerationOutput} in the order of ``inputs`` (ids ``req_0``, ``req_1``, ...),
    each output's ``generated_tokens`` the new tokens (up to and including EOS), ``prompt_ids`` its prompt.

    Args:
        inputs: list of prompts, each a list of token ids (or a 1-D tensor).
        generation_config, **kwargs: as ``generate`` (``max_new_tokens``, ``do_sample``, ``eos_token_id``, ...).
        continuous_batching_config: transformers' ContinuousBatchingConfig; only ``max_requests_per_batch`` is
            read (the rows); the paging settings do not apply to an H2O cache.
        record_timestamps: per-token times in ``output.timestamps``; progress_bar: a tqdm bar.
        persistent_manager: keep the manager on ``opt._continuous_batching_manager``.
        warmup: run one empty decode step first (compiles the batch step when compilation is on).
        max_batch_size: rows (default: ``max_requests_per_batch``, else min(len(inputs), 8)).
        seeds: one int per prompt (or None): sampling seeds, request i drawing as ``torch.manual_seed(seeds[i])``
            + ``generate`` would for it alone.
    """
    if not isinstance(inputs, (list, tuple)):
        raise TypeError(f"inputs must be a list of prompts (lists of token ids), got {type(inputs).__name__}")
    if not inputs:
        return {}
    if seeds is not None and len(seeds) != len(inputs):
        raise ValueError(f"seeds has {len(seeds)} entries for {len(inputs)} inputs: give one per prompt or None")
    rows = max_batch_size or getattr(continuous_batching_config, "max_requests_per_batch", None) or min(len(inputs), 8)
    max_seq_len = kwargs.pop("max_seq_len", None)
    if max_seq_len is None and not (isinstance(opt.h2o_config.budget, int) and opt.h2o_config.policy != "full"):
        config = generation_config or opt.generation_config
        new = kwargs.get("max_new_tokens") or getattr(config, "max_new_tokens", None)
        if new is None:
            raise ValueError("a float budget sizes the rows from the longest request: give max_new_tokens")
        max_seq_len = max(len(p) for p in inputs) + new
    manager = ContinuousBatchingManager(opt, generation_config, max_batch_size=rows, max_seq_len=max_seq_len,
                                        **kwargs)
    ids = [manager.add_request(prompt, seed=None if seeds is None else seeds[i], record_timestamps=record_timestamps)
           for i, prompt in enumerate(inputs)]
    if warmup:
        manager.warmup()
    results = manager.run_until_done(progress=progress_bar)
    if persistent_manager:
        opt._continuous_batching_manager = manager
    return {i: results[i] for i in ids}
