"""Continuous batching: which tokens of which sequences the next step computes.

There are no prefill or decode phases. A sequence's `num_computed_tokens` catches up with its
`num_tokens`; each step hands out token counts under a budget of `max_num_batched_tokens`:

1. Running sequences, oldest admitted first: one still prefilling gets min(remaining, budget
   left), one that is caught up gets 1 (a decode). A long prompt therefore runs in chunks over
   several steps, and prefill chunks and decodes share one batch.
2. If nothing was preempted, waiting sequences in the policy's order, while the budget,
   `max_num_seqs` and free blocks allow; the first that does not fit stops admission. Once
   the sequences a step admitted hold `max_admitted_tokens` and number `BURST_SEQUENCES` and
   a `BURST_STEPS`th of the queue, the rest wait for the next step: a burst of short prompts
   starts over a few short steps, whose first tokens come out step by step, instead of one long
   step that answers them all at its end (and clients that send their next request when one
   ends stop arriving in synchronised waves). A few long prompts are not split so (their step
   costs the same either way, and an extra step costs every running sequence a step's fixed
   time), and a long queue shrinks by a `BURST_STEPS`th or more a step. A
   sequence starts from the longest prefix the prefix cache holds, so it costs only its new
   tokens and blocks; one whose hit would reach blocks this very step computes (the other forks
   of its prompt, say) stops admission too, and hits them in full next step.

With a speculation policy active, a caught-up sequence may also get the drafts the policy
proposes, if their pages are free (nobody is preempted for a draft); the step samples each of
their positions, and `commit` keeps the drafts the target's draws confirm (`accept_matching`)
and the target's next token, rolls the rest back and returns their pages. Drafts are never
resolved, so they never reach the prefix cache.

A sequence samples a token exactly when its chunk reaches its last token. Blocks are reserved
before tokens are handed out (check, then commit), through the cache manager
(`atlas.domain.cache`), which also evicts cached blocks nobody uses when free ones run short. A
running sequence that cannot get a block preempts by recompute the victim its policy names
(never one already in the step being built): the victim's full blocks stay in the prefix cache,
the rest go back to the pool, and it waits at the front of the queue to recompute its prompt and
output later, from the cache as far as it still holds them, which yields the same tokens.
Nothing can livelock on a pool that is too small: `add` refuses a prompt larger than the whole
pool, and a sequence whose next token would need more positions than the whole pool holds
finishes with LENGTH.

Steps overlap: `schedule()` may build step N+1 while step N is in flight (at most one
uncommitted batch) unless `needs_commit_first`. Scheduling a step advances
`num_computed_tokens` at once and gives each sampling sequence a pending placeholder token
(`atlas.domain.sequence`), so step N+1 can already decode it: its id is read on the device from
step N's samples. `commit(N)` resolves the placeholders and applies the stop rules; sequences
aborted or preempted in between are skipped, and a step computed for a sequence that finished
meanwhile is simply discarded.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from atlas.domain.batch import ScheduledBatch, SequenceOutput, StepResult
from atlas.domain.cache.manager import CacheManager
from atlas.domain.requests import FinishReason, ParameterError, SequenceStatus
from atlas.domain.sequence import Sequence
from atlas.domain.scheduling_policy import FifoPolicy, SchedulingPolicy
from atlas.domain.speculative.outcome import SpecDecodeStats
from atlas.domain.speculative.policy import NoSpeculation, SpeculationPolicy
from atlas.domain.speculative.verify import verify_drafts
from atlas.domain.step_plan import InFlightStep, StepPlan, check_result, sequence_output
from atlas.domain.stopping import ends_by_length, first_stop, stop_reason

# How many sequences one step admits before `max_admitted_tokens` may stop admission: at least
# BURST_SEQUENCES, and at least a BURST_STEPS-th of the queue.
BURST_SEQUENCES = 4
BURST_STEPS = 4


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    """The few numbers the scheduler needs. Raises ValueError for a size below 1."""

    max_model_len: int  # longest sequence, prompt + output
    max_num_seqs: int = 256  # sequences running at once
    max_num_batched_tokens: int = 2048  # token budget of one step (bounds prefill chunks)
    block_size: int = 16
    # tokens the sequences admitted in one step may hold before admission stops (None: the budget)
    max_admitted_tokens: int | None = None

    def __post_init__(self) -> None:
        for name in ("max_model_len", "max_num_seqs", "max_num_batched_tokens", "block_size"):
            value = getattr(self, name)
            if value < 1:
                raise ValueError(f"SchedulerConfig.{name} must be at least 1 (got {value})")
        if self.max_admitted_tokens is not None and self.max_admitted_tokens < 1:
            raise ValueError(f"SchedulerConfig.max_admitted_tokens must be at least 1 (got {self.max_admitted_tokens})")


class Scheduler:
    """Owns the waiting queue, the running set and their pages in `cache`."""

    __slots__ = (
        "config", "cache", "policy", "speculation", "spec_stats", "_waiting", "_running", "_live", "_in_flight",
        "_next_step_id",
    )

    def __init__(
        self,
        config: SchedulerConfig,
        cache: CacheManager,
        policy: SchedulingPolicy | None = None,
        speculation: SpeculationPolicy | None = None,
    ) -> None:
        """Raises ValueError when the cache's block size differs from the config's, or a cache
        group cannot hold one sequence's step of `max_num_batched_tokens`."""
        if cache.block_size != config.block_size:
            raise ValueError(
                f"the cache's block_size ({cache.block_size}) differs from the config's ({config.block_size})"
            )
        cache.check_step_fits(config.max_num_batched_tokens)
        self.config = config
        self.cache = cache
        self.policy: SchedulingPolicy = policy if policy is not None else FifoPolicy()
        self.speculation: SpeculationPolicy = speculation if speculation is not None else NoSpeculation()
        self.spec_stats = SpecDecodeStats()
        self._waiting: deque[Sequence] = deque()
        self._running: list[Sequence] = []  # in admission order
        self._live: dict[str, Sequence] = {}  # every waiting or running sequence by id
        self._in_flight: deque[InFlightStep] = deque()
        self._next_step_id = 0

    @property
    def num_running(self) -> int:
        """Sequences holding blocks (scheduled this step or waiting for budget)."""
        return len(self._running)

    @property
    def num_waiting(self) -> int:
        """Sequences queued for admission, preempted ones included."""
        return len(self._waiting)

    @property
    def has_unfinished(self) -> bool:
        """Whether any added sequence is neither finished nor aborted."""
        return bool(self._live)

    def add(self, seq: Sequence) -> None:
        """Queue a fresh sequence at the back of the waiting queue.

        Raises ParameterError("prompt", ...) when the prompt leaves no room for one output token
        under `max_model_len`, or needs more blocks than the whole pool holds, and the policy's
        ParameterError for a request it cannot honour (a priority under fifo). Raises ValueError
        for an engine mistake: a duplicate id, a sequence already started, or a
        `max_total_tokens` outside (prompt, max_model_len].
        """
        max_model_len = self.config.max_model_len
        num_prompt_tokens = seq.num_prompt_tokens
        if num_prompt_tokens >= max_model_len:
            raise ParameterError(
                "prompt",
                f"the prompt has {num_prompt_tokens} tokens but max_model_len is {max_model_len}, which leaves "
                f"no room for an output token; shorten the prompt to at most {max_model_len - 1} tokens",
            )
        self.cache.check_prompt_fits(num_prompt_tokens)
        self.policy.check(seq)
        if seq.seq_id in self._live:
            raise ValueError(f"sequence {seq.seq_id!r} is already scheduled")
        if seq.status is not SequenceStatus.WAITING or seq.num_computed_tokens or not seq.cache.is_empty:
            raise ValueError(f"sequence {seq.seq_id!r} was already started: {seq!r}")
        if not num_prompt_tokens < seq.max_total_tokens <= max_model_len:
            raise ValueError(
                f"sequence {seq.seq_id!r} has max_total_tokens {seq.max_total_tokens}; it must exceed the "
                f"prompt ({num_prompt_tokens}) and not exceed max_model_len ({max_model_len})"
            )
        self._waiting.append(seq)
        self._live[seq.seq_id] = seq

    def abort(self, seq_id: str) -> SequenceOutput | None:
        """Finish a waiting or running sequence with ABORT and free its blocks now.

        Returns its final output, or None if the id is unknown or already finished. If it is in
        the batch in flight, `commit` skips it.
        """
        seq = self._live.get(seq_id)
        if seq is None:
            return None
        if seq.status is SequenceStatus.RUNNING:
            self._finish(seq, FinishReason.ABORT)
        else:
            self._waiting.remove(seq)
            del self._live[seq_id]
            self.speculation.forget(seq_id)
            seq.finish(FinishReason.ABORT)
        return sequence_output(seq, (), ())

    def schedule(self) -> ScheduledBatch:
        """Build the next step; an empty batch when there is nothing to run.

        Raises RuntimeError if two batches are already in flight, and ValueError if the policy
        names a victim or admits a sequence outside its contract.
        """
        if len(self._in_flight) > 1:
            raise RuntimeError(
                f"steps {[f.step_id for f in self._in_flight]} are in flight; commit one before scheduling again"
            )
        self.cache.begin_step()
        plan = StepPlan(self._next_step_id, self.config.max_num_batched_tokens)
        self._next_step_id += 1
        self._schedule_running(plan)
        if plan.num_preempted == 0:
            self._admit_waiting(plan)
        if not plan.sequences:
            return ScheduledBatch(step_id=plan.step_id, sequences=(), block_size=self.cache.block_size)
        self.cache.release_unread(plan.sequences)  # the step's block tables are taken
        in_flight = plan.in_flight()
        self._in_flight.append(in_flight)
        return ScheduledBatch(step_id=plan.step_id, sequences=in_flight.scheduled, block_size=self.cache.block_size)

    @property
    def num_in_flight(self) -> int:
        """Scheduled batches not committed yet (0, 1 or 2)."""
        return len(self._in_flight)

    @property
    def needs_commit_first(self) -> bool:
        """The next step needs the host to know tokens still in flight: commit before scheduling.

        So it does when a sequence in flight has penalties (its next penalty context) or
        verifies drafts (how many it keeps), and whenever the next step may draft (drafts
        follow final tokens only)."""
        if not self._in_flight:
            return False
        return self.speculation.needs_final_tokens(self._running) or any(
            flight.needs_host_tokens for flight in self._in_flight
        )

    def commit(self, batch: ScheduledBatch, result: StepResult) -> list[SequenceOutput]:
        """Apply a step's result: append sampled tokens (verifying drafts), finish and free.

        `result.token_ids` holds the step's sampling rows in batch order: one per sampling
        sequence, 1 + k for one verifying k drafts. Returns one output per live sequence that
        got tokens (finished or not), in batch order. Raises ValueError, changing nothing, if
        `batch` is not the one in flight or `result` does not match it.
        """
        in_flight = check_result(self._in_flight[0] if self._in_flight else None, batch, result)
        self._in_flight.popleft()
        self.speculation.observe(batch, result)
        outputs: list[SequenceOutput] = []
        live, step_id = self._live, batch.step_id
        row_idx = 0
        for seq, scheduled in zip(in_flight.sequences, in_flight.scheduled):
            if scheduled.sampling is None:
                continue
            first_row, num_drafts = row_idx, scheduled.num_draft_tokens
            row_idx += 1 + num_drafts
            if live.get(seq.seq_id) is not seq:
                continue  # aborted after schedule(): its blocks are already back in the pool
            pending = seq.pending
            if not pending or pending[0].step_id != step_id:
                continue  # preempted after schedule(): it samples this token again later
            if num_drafts:
                outputs.append(self._append_verified(seq, result, first_row, 1 + num_drafts))
            else:
                outputs.append(self._append_sampled(seq, result, first_row))
        return outputs

    def resample(self, seq_id: str, step_id: int) -> bool:
        """The token step `step_id` (the oldest in flight) sampled for `seq_id` may not stand
        (its loose mask allowed a token the grammar refuses, `atlas.domain.constraints`):
        forget it and any later token in flight for it (the commits skip them) and compute its
        last resolved token again, so that the next step samples that position anew.

        Returns False, changing nothing, when that cannot be done: a sequence not running, one
        with nothing in flight, drafts to verify, no output token yet (the recompute would
        rewrite a prompt position other sequences may share), a model whose cache cannot
        compute a position again, or a cached block the rewind would give back."""
        seq = self._live.get(seq_id)
        if (seq is None or seq.status is not SequenceStatus.RUNNING or not seq.pending
                or seq.pending[0].step_id != step_id or seq.num_draft_tokens
                or seq.num_resolved_tokens <= seq.num_prompt_tokens or not self.cache.can_recompute_last_token
                or not self.cache.trims_only_fresh_pages(seq, seq.num_resolved_tokens - 1)):
            return False
        num_computed = seq.num_computed_tokens
        seq.rewind_to_resample()
        self.cache.trim(seq, num_computed - seq.num_computed_tokens)
        return True

    def check_invariants(self) -> None:
        """Raise AssertionError if queues, statuses, block tables and the cache disagree.

        Checked on top of the cache manager's invariants (running sequences hold exactly the
        pages for their computed and in-flight tokens; every used page has as many holders as
        its ref count; free + used + evictable = total): waiting and running partition the live
        sequences; waiting ones hold no pages and no cache; running ones have something left to
        compute.
        """
        self.cache.check_invariants(self._running)
        waiting_ids = [seq.seq_id for seq in self._waiting]
        running_ids = [seq.seq_id for seq in self._running]
        if sorted(waiting_ids + running_ids) != sorted(self._live):
            raise AssertionError(f"waiting {waiting_ids} + running {running_ids} != live {sorted(self._live)}")
        if len(self._running) > self.config.max_num_seqs:
            raise AssertionError(f"{len(self._running)} running > max_num_seqs {self.config.max_num_seqs}")
        for seq in self._waiting:
            if seq.status is not SequenceStatus.WAITING or not seq.cache.is_empty or seq.num_computed_tokens:
                raise AssertionError(f"a waiting sequence holds cache state: {seq!r}")
        for seq in self._running:
            if seq.status is not SequenceStatus.RUNNING or seq.num_uncomputed_tokens < 1:
                raise AssertionError(f"a running sequence is not running or has nothing to compute: {seq!r}")

    def _schedule_running(self, plan: StepPlan) -> None:
        """Give each running sequence, oldest first, its next tokens (and drafts), preempting
        when blocks run out."""
        speculating = self.speculation.is_active(len(self._running))
        if speculating:
            self.speculation.prepare(self._running)
        running, cache = self._running, self.cache
        idx = 0
        while idx < len(running) and plan.budget_left > 0:
            seq = running[idx]
            pending = seq.pending
            if pending and ends_by_length(seq):
                idx += 1  # its pending token is its last: nothing more to compute
                continue
            num_uncomputed = seq.num_uncomputed_tokens
            num_tokens = min(num_uncomputed, plan.budget_left)
            if speculating and num_uncomputed == 1 and not pending:
                num_tokens += self._add_drafts(seq, plan.budget_left - 1)
            # most steps of a running sequence need no new page
            if cache.covers(seq, num_tokens) or self._grow(seq, num_tokens, idx, plan):
                self._plan(plan, seq, num_tokens)
                idx += 1
            # else `seq` itself was preempted: the next sequence moved into slot `idx`

    def _add_drafts(self, seq: Sequence, max_drafts: int) -> int:
        """Drafts for a caught-up `seq`: what the policy proposes within the budget and the
        sequence's length limit, if their pages can be had without preempting anyone (check,
        then commit). Returns how many were added."""
        room = seq.max_total_tokens - seq.num_tokens - 1  # the verify step may add drafts + 1 tokens
        drafts = self.speculation.propose(seq.seq_id, seq, min(max_drafts, room))
        if not drafts:
            return 0
        reservation = self.cache.reserve(seq, 1 + len(drafts), num_drafts=len(drafts))
        if reservation is None:
            return 0
        self.cache.commit(seq, reservation)
        seq.add_drafts(drafts)
        return len(drafts)

    def _plan(self, plan: StepPlan, seq: Sequence, num_tokens: int) -> None:
        start = seq.num_computed_tokens
        self.cache.on_scheduled(seq, start, start + num_tokens)
        plan.add(seq, num_tokens, self.cache.step_tables(seq))

    def _grow(self, seq: Sequence, num_tokens: int, idx: int, plan: StepPlan) -> bool:
        """Attach the blocks `seq` needs to compute `num_tokens` more; False if it was preempted.

            block_size 4, 6 computed, 4 more this step
            positions  0 1 2 3 | 4 5 6 7 | 8 9
            computed   x x x x | x x
            this step          |     . . | . .
            blocks     held    | held    | new  -> needs 3, holds 2: reserve 1

        Victims come from `_running[idx:]`: the sequences before `idx` are already in the step.
        """
        while (reservation := self.cache.reserve(seq, num_tokens)) is None:
            candidates = self._running[idx:]
            victim = self.policy.choose_victim(candidates, seq)
            if not any(victim is candidate for candidate in candidates):
                raise ValueError(f"the policy chose {victim.seq_id!r}, which is not a preemption candidate")
            self._preempt(victim)
            plan.num_preempted += 1
            if victim is seq:
                return False
        self.cache.commit(seq, reservation)
        return True

    def _admit_waiting(self, plan: StepPlan) -> None:
        """Start waiting sequences in policy order while budget, seats, blocks and the
        admission cap last."""
        admitted: list[Sequence] = []
        config = self.config
        cap = config.max_admitted_tokens if config.max_admitted_tokens is not None else config.max_num_batched_tokens
        at_least = max(BURST_SEQUENCES, -(-len(self._waiting) // BURST_STEPS))
        admitted_tokens = 0
        for seq in self.policy.admission_order(self._waiting):
            if plan.budget_left == 0 or len(self._running) >= config.max_num_seqs:
                break
            if admitted_tokens >= cap and len(admitted) >= at_least:
                break
            if self._live.get(seq.seq_id) is not seq or seq.status is not SequenceStatus.WAITING:
                raise ValueError(f"the policy admitted {seq.seq_id!r}, which is not waiting")
            hit = self.cache.lookup(seq)
            if hit.waits_for_step:
                break  # this step computes blocks it would reuse: next step it hits them in full
            num_tokens = min(seq.num_tokens - hit.num_tokens, plan.budget_left)
            reservation = self.cache.reserve(seq, num_tokens, hit)
            if reservation is None:
                break
            self.cache.commit(seq, reservation)
            seq.status = SequenceStatus.RUNNING
            self._running.append(seq)
            admitted.append(seq)
            admitted_tokens += num_tokens
            self._plan(plan, seq, num_tokens)
        for seq in admitted:
            self._waiting.remove(seq)

    def _preempt(self, victim: Sequence) -> None:
        self._running.remove(victim)
        self.cache.release(victim)
        self.speculation.forget(victim.seq_id)  # a draft model's cache pages go back too
        victim.reset_for_recompute()
        self._waiting.appendleft(victim)

    def _finish(self, seq: Sequence, reason: FinishReason) -> None:
        self._running.remove(seq)
        self.cache.release(seq)
        del self._live[seq.seq_id]
        self.speculation.forget(seq.seq_id)
        seq.finish(reason)

    def _append_sampled(self, seq: Sequence, result: StepResult, row_idx: int) -> SequenceOutput:
        token_id = result.token_ids[row_idx]
        seq.resolve_pending(token_id)
        reason = stop_reason(seq)
        if reason is None and not self.cache.fits(seq.num_tokens):
            # Sampling again would need every token in the cache, more than the whole pool holds.
            reason = FinishReason.LENGTH
        if reason is not None:
            self._finish(seq, reason)
        token_logprobs = result.logprobs[row_idx] if result.logprobs is not None else None
        return sequence_output(seq, (token_id,), (token_logprobs,) if token_logprobs is not None else ())

    def _append_verified(self, seq: Sequence, result: StepResult, first_row: int, num_rows: int) -> SequenceOutput:
        """Verify `seq`'s drafts against its rows' draws: keep the accepted drafts and the next
        token (up to a stop among them), roll back the rest and give back the pages past them."""
        [outcome] = verify_drafts([seq.draft_token_ids], [result.token_ids[first_row : first_row + num_rows]])
        self.spec_stats.record(outcome)
        num_kept, reason = first_stop(seq, outcome.token_ids)
        kept = outcome.token_ids[:num_kept]
        self.cache.trim(seq, seq.resolve_verified(kept))
        if reason is None and not self.cache.fits(seq.num_tokens):
            reason = FinishReason.LENGTH
        if reason is not None:
            self._finish(seq, reason)
        logprobs = result.logprobs
        wanted = logprobs is not None and logprobs[first_row] is not None
        kept_logprobs = tuple(logprobs[first_row : first_row + num_kept]) if wanted else ()  # type: ignore[index]
        return sequence_output(seq, kept, kept_logprobs)  # type: ignore[arg-type]
