"""The engine core: the step loop over the scheduler and a worker, with no I/O of its own.

    batch = scheduler.schedule()            # step N+1, while step N runs on the device
    pending = worker.submit(batch)
    outputs = scheduler.commit(batch_N, pending_N.result())
    pending.sample(masks)                   # constrained steps: masks after step N's tokens

Steps overlap by one: the next step is scheduled and enqueued before the previous one's ids
are read back, so host work hides behind device work. Sequences whose next penalty context
needs the token still in flight, and speculation (drafts follow final tokens, and a verify
step's outcome decides what comes next), make the core commit first (the steps then do not
overlap).

Token constraints (structured output, thinking budgets) keep the overlap: a step with a
constrained sampling row is submitted with `awaits_masks`, and its masks are filled on a helper
thread while the device runs its forward (`atlas.domain.constrained_steps`), or by a grammar
worker in a helper process (`atlas.domain.served_constraints`).

Transports (the Python API, the engine actor behind HTTP, a separate engine process) wrap
this object; they decide when to call `step` and where outputs go.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Protocol

import numpy as np

from atlas.domain.batch import ScheduledBatch, SequenceOutput, StepResult
from atlas.domain.constrained_steps import ConstrainedSampling
from atlas.domain.grammar_service import GrammarWorker
from atlas.domain.request_constraints import GrammarCache
from atlas.domain.requests import ParameterError, Request
from atlas.domain.sampling import validate_token_ids
from atlas.domain.scheduler import Scheduler
from atlas.domain.sequence import Sequence
from atlas.domain.served_constraints import ServedConstrainedSampling


class PendingResult(Protocol):
    def sample(self, bitmask: np.ndarray | None) -> None:
        """Enqueue the sampling of a step submitted with `awaits_masks`, with its rows' masks
        (int32 [R, ceil(V / 32)]; None: no row is constrained)."""
        ...

    def result(self) -> StepResult:
        """Block until the step's sampled ids are on the host. The core may call it from its
        mask thread while the thread that submitted waits (never from both at once)."""
        ...


class StepExecutor(Protocol):
    """Runs scheduled batches (the worker, in this process or behind a transport). One in this
    process may also offer `mask_rows()` (`Worker.mask_rows`): where masks are filled in place."""

    def submit(self, batch: ScheduledBatch, before_launch: Callable[[], None] | None = None) -> PendingResult:
        """Enqueue the step and return at once; steps run in submission order. A batch that
        `awaits_masks` samples when its `PendingResult.sample` is called, before any later
        step is submitted. `before_launch` is called once before the step reaches the device,
        after whatever host work may run first (building and staging its inputs): the core
        samples the step in flight there, so that work hides behind the masks' fill."""
        ...


@dataclass(frozen=True, slots=True)
class EngineStats:
    num_running: int
    num_waiting: int
    num_blocks_total: int
    num_blocks_free: int  # free or cached-evictable: back to num_blocks_total when idle
    num_steps: int
    num_prompt_tokens: int  # prompt tokens of every request added
    num_generated_tokens: int
    num_preemptions: int  # times a sequence was preempted by recompute, since start
    num_blocks_cached: int = 0  # of the free ones, those holding a cached prefix
    num_prefix_cache_queries: int = 0  # prompt tokens looked up in the prefix cache at admission
    num_prefix_cache_hits: int = 0  # of those, found there
    num_spec_draft_tokens: int = 0  # speculative drafts verified
    num_spec_accepted_tokens: int = 0  # of those, accepted
    num_spec_verify_steps: int = 0  # sequence-steps that verified drafts
    spec_accepted_by_position: tuple[int, ...] = ()  # [j]: drafts at position j accepted
    num_resampled_tokens: int = 0  # tokens sampled under a grammar's superset mask that it refused


class EngineCore:
    """Owns the scheduler and drives a worker one step at a time."""

    def __init__(
        self,
        scheduler: Scheduler,
        executor: StepExecutor,
        max_model_len: int,
        vocab_size: int,
        eos_token_ids: frozenset[int],
        grammars: GrammarCache | None = None,
        grammar_worker: Callable[[], GrammarWorker] | None = None,
    ) -> None:
        """`grammars` compiles the grammars of requests' constraints (None: a request with a
        grammar is refused). `grammar_worker` starts a worker that holds the constraints and
        fills their masks (a helper process), taking their place in this one."""
        self.scheduler = scheduler
        self.executor = executor
        self.max_model_len = max_model_len
        self.vocab_size = vocab_size
        self.eos_token_ids = eos_token_ids
        self.grammars = grammars
        self._sequences: dict[str, Sequence] = {}
        self._num_steps = 0
        self._num_prompt_tokens = 0
        self._num_generated_tokens = 0
        self._num_finished_preemptions = 0
        self._in_flight: deque[tuple[ScheduledBatch, PendingResult]] = deque()
        # an executor in this process may offer its masks' host rows (`Worker.mask_rows`): the
        # fill then writes where the upload reads, with no copy between
        mask_rows = getattr(executor, "mask_rows", None)
        self._constrained: ConstrainedSampling | ServedConstrainedSampling
        if grammar_worker is not None:
            self._constrained = ServedConstrainedSampling(scheduler, self._in_flight, grammar_worker)
        else:
            self._constrained = ConstrainedSampling(scheduler, self._in_flight, vocab_size, eos_token_ids, grammars,
                                                    mask_rows)

    @property
    def num_resampled_tokens(self) -> int:
        """Loosely sampled tokens the grammar refused (sampled again), since start."""
        return self._constrained.num_resampled_tokens

    def add_request(self, request: Request) -> None:
        """Queue a request. Raises ParameterError naming the field when it cannot run."""
        if request.request_id in self._sequences:
            raise ParameterError("request_id", f"{request.request_id!r} is already running")
        num_prompt = len(request.prompt_token_ids)
        if num_prompt >= self.max_model_len:
            raise ParameterError(
                "prompt",
                f"the prompt has {num_prompt} tokens but the model's context is {self.max_model_len} "
                f"(--max-seq-len), which leaves no room for output; shorten the prompt",
            )
        bad = [t for t in request.prompt_token_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ParameterError("prompt", f"token id {bad[0]} is outside the vocabulary [0, {self.vocab_size})")
        validate_token_ids(request.sampling, self.vocab_size)
        max_tokens = request.sampling.max_tokens
        max_total = self.max_model_len if max_tokens is None else min(self.max_model_len, num_prompt + max_tokens)
        sequence = Sequence(request, max_total, self.eos_token_ids)
        constraint = self._constrained.constraint_for(request)
        if constraint is not None:
            field = request.constraint.grammar_field if request.constraint is not None else ""
            self._constrained.add(request.request_id, constraint, field)  # type: ignore[arg-type]
        try:
            self.scheduler.add(sequence)
        except BaseException:
            self._constrained.forget(request.request_id)
            raise
        self._sequences[request.request_id] = sequence
        self._num_prompt_tokens += num_prompt

    def abort(self, request_id: str) -> SequenceOutput | None:
        """Stop a request now and free its blocks; None when it already finished."""
        self._forget(request_id)
        return self.scheduler.abort(request_id)

    @property
    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished or bool(self._in_flight) or self._constrained.has_ended

    @property
    def newest_batch(self) -> ScheduledBatch | None:
        """The last batch enqueued and not yet committed (None when none is in flight)."""
        return self._in_flight[-1][0] if self._in_flight else None

    def step(self) -> list[SequenceOutput]:
        """Enqueue the next step and commit the previous one; the outputs that commit produced.

        The first call after idle returns no outputs (its step is still in flight); call again
        while `has_unfinished`.
        """
        outputs: list[SequenceOutput] = []
        if self._in_flight and self.scheduler.needs_commit_first:
            outputs += self._commit_oldest()
        batch = self.scheduler.schedule()  # while the last step's masks fill
        if not batch.is_empty:
            if self._constrained.awaits_masks(batch):
                batch = replace(batch, awaits_masks=True)
            # the step in flight samples before this one is enqueued behind it, once this one's
            # inputs are built: the fill runs on beside that work too
            pending = self.executor.submit(batch, before_launch=self._constrained.sample_in_flight)
            self._in_flight.append((batch, pending))
            self._num_steps += 1
        else:
            self._constrained.sample_in_flight()
        if self._in_flight and (len(self._in_flight) > 1 or batch.is_empty):
            outputs += self._commit_oldest()
        if batch.awaits_masks and not self._constrained.filling:  # the commit did not start them early
            self._constrained.start_masks(batch)
        if self._constrained.has_ended:  # constrained requests its grammar worker's death ended
            ended = self._constrained.take_ended()
            for output in ended:
                self._forget(output.seq_id)
            outputs += ended
        return outputs

    def drain(self) -> list[SequenceOutput]:
        """Commit every step in flight and return their outputs: afterwards nothing runs on
        the device (the worker's buffers are free, e.g. to capture a graph) until the next
        `step`, which schedules as usual."""
        outputs: list[SequenceOutput] = []
        while self._in_flight:
            outputs += self._commit_oldest()
        return outputs

    def close(self) -> None:
        """Stop the mask threads or the grammar worker (a later constrained step starts them again)."""
        self._constrained.close()

    def reset_prefix_cache(self) -> int:
        """Drop every cached block no running request uses; returns how many were freed."""
        return self.scheduler.cache.reset_prefix_cache()

    def _commit_oldest(self) -> list[SequenceOutput]:
        constrained = self._constrained
        constrained.sample_in_flight()  # the step may be the one whose masks are filling
        batch, pending = self._in_flight.popleft()
        result, early = constrained.take_result(batch, pending)
        outputs = constrained.after_commit(batch, self.scheduler.commit(batch, result), early)
        self._num_generated_tokens += sum([len(output.new_token_ids) for output in outputs])
        for output in outputs:
            if output.finish_reason is not None:
                self._forget(output.seq_id)
        return outputs

    def _forget(self, request_id: str) -> None:
        self._constrained.forget(request_id)
        sequence = self._sequences.pop(request_id, None)
        if sequence is not None:
            self._num_finished_preemptions += sequence.num_preemptions

    def stats(self) -> EngineStats:
        cache = self.scheduler.cache.stats()
        spec = self.scheduler.spec_stats
        return EngineStats(
            num_running=self.scheduler.num_running,
            num_waiting=self.scheduler.num_waiting,
            num_blocks_total=cache.num_blocks_total,
            num_blocks_free=cache.num_blocks_free,
            num_steps=self._num_steps,
            num_prompt_tokens=self._num_prompt_tokens,
            num_generated_tokens=self._num_generated_tokens,
            num_preemptions=self._num_finished_preemptions + sum(s.num_preemptions for s in self._sequences.values()),
            num_blocks_cached=cache.num_blocks_cached,
            num_prefix_cache_queries=cache.num_queried_tokens,
            num_prefix_cache_hits=cache.num_hit_tokens,
            num_spec_draft_tokens=spec.num_draft_tokens,
            num_spec_accepted_tokens=spec.num_accepted_tokens,
            num_spec_verify_steps=spec.num_verify_steps,
            spec_accepted_by_position=tuple(spec.accepted_by_position),
            num_resampled_tokens=self._constrained.num_resampled_tokens,
        )

