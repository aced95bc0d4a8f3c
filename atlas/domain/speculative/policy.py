"""When the scheduler speculates, and with which drafts: a policy object plugged into it.

    policy.is_active(num_running)        this step may verify drafts
    policy.needs_final_tokens(running)   the next step may draft: commit the step in flight
                                         first (drafts and their verification need final tokens)
    policy.prepare(running)              once per such step, before any propose: a proposer
                                         that drafts for every sequence at once runs here
    policy.propose(seq, max_drafts)      up to max_drafts drafts for a caught-up sequence
    policy.observe(batch, result)        a step is being committed: a proposer fed the target's
                                         hidden states (MTP, EAGLE-3) keeps those it will need
    policy.forget(seq_id)                the sequence finished or was preempted: drop what the
                                         proposer keeps for it

`NoSpeculation` is the null object (the scheduler's default); `NgramSpeculation` drafts with
prompt lookup (`NgramProposer`), `DraftModelSpeculation` with a small model
(`DraftModelProposer`), `DraftHeadSpeculation` with a head fed the target's hidden states (MTP,
EAGLE-3: `DraftHeadProposer`); each switches itself off for steps with more running sequences
than the config's `disable_by_batch_size`.

Why the draft model's device work sits behind the policy: drafts must exist when the step is
scheduled (its block reservations and row counts depend on them), and the verify outcome they
follow is known only once the previous step is committed (speculation commits first). So the
round runs inside `schedule()`, batched over the running sequences in `prepare`, through a
`StepRunner` (one method, the worker's own `execute` over plain `ScheduledBatch` data): the
policy stays pure bookkeeping, testable with a fake runner, and no new port is needed since
the domain's `Worker` already runs any model on any `GpuBackend`.
"""

from __future__ import annotations

from typing import Protocol

from collections.abc import Sequence as SequenceOf

from atlas.domain.batch import ScheduledBatch, StepResult
from atlas.domain.sequence import Sequence
from atlas.domain.speculative.config import SpeculativeConfig, SpeculativeConfigError, SpeculativeMethod
from atlas.domain.speculative.draft_head import DraftHeadProposer
from atlas.domain.speculative.draft_model import DraftModelProposer, DraftRequest
from atlas.domain.speculative.ngram import NgramProposer, TokenHistory


class SpeculationPolicy(Protocol):
    def is_active(self, num_running: int) -> bool:
        """Whether a step with `num_running` running sequences proposes drafts."""
        ...

    def needs_final_tokens(self, running: SequenceOf[Sequence]) -> bool:
        """Whether the next step may draft for one of `running`, so that the step in flight
        must commit before it is scheduled. A proposer that can tell from the final tokens it
        has that none would draft (n-gram: no tail matches) lets the steps overlap until one
        would: a small model's host work per step then hides behind the device again."""
        ...

    def prepare(self, running: SequenceOf[Sequence]) -> None:
        """A step that speculates is being scheduled over `running` (oldest first): called
        once, before its `propose` calls."""
        ...

    def propose(self, seq_id: str, history: TokenHistory, max_drafts: int) -> tuple[int, ...]:
        """At most `max_drafts` drafts to follow `history`'s final tokens (possibly none)."""
        ...

    def observe(self, batch: ScheduledBatch, result: StepResult) -> None:
        """Step `batch` is being committed with `result` (every step, before its tokens are
        applied): where `result.hidden_states` is set, the target's kept hidden states."""
        ...

    def forget(self, seq_id: str) -> None:
        """`seq_id` finished or was aborted (a no-op for one never seen)."""
        ...


class NoSpeculation:
    """Never drafts."""

    def is_active(self, num_running: int) -> bool:
        return False

    def needs_final_tokens(self, running: SequenceOf[Sequence]) -> bool:
        return False

    def prepare(self, running: SequenceOf[Sequence]) -> None:
        pass

    def propose(self, seq_id: str, history: TokenHistory, max_drafts: int) -> tuple[int, ...]:
        return ()

    def observe(self, batch: ScheduledBatch, result: StepResult) -> None:
        pass

    def forget(self, seq_id: str) -> None:
        pass


class NgramSpeculation:
    """Prompt-lookup drafts of `config.num_speculative_tokens` (fewer near a sequence's end)."""

    def __init__(self, config: SpeculativeConfig) -> None:
        """Raises SpeculativeConfigError for a method other than ngram."""
        if config.method is not SpeculativeMethod.NGRAM:
            raise SpeculativeConfigError("method", f"{config.method.value} is not an n-gram configuration")
        self.config = config
        self._proposer = NgramProposer(
            config.prompt_lookup_min, config.prompt_lookup_max, config.num_speculative_tokens  # type: ignore[arg-type]
        )

    def is_active(self, num_running: int) -> bool:
        return self.config.speculates_at(num_running)

    def needs_final_tokens(self, running: SequenceOf[Sequence]) -> bool:
        # Whether a tail matches as of the last committed token (a lookup per sequence, ~1 us):
        # in text with no repeats (SmolLM2 on H200: 354 of 628 n-gram steps drafted nothing)
        # the steps overlap as plain decoding does; a sequence entering a repeat drafts one
        # step later than it would have.
        if not self.is_active(len(running)):
            return False
        return any(self._proposer.propose(seq.seq_id, seq) for seq in running)

    def prepare(self, running: SequenceOf[Sequence]) -> None:
        pass  # prompt lookup drafts per sequence, in propose

    def propose(self, seq_id: str, history: TokenHistory, max_drafts: int) -> tuple[int, ...]:
        if max_drafts <= 0:
            return ()
        return self._proposer.propose(seq_id, history)[:max_drafts]

    def observe(self, batch: ScheduledBatch, result: StepResult) -> None:
        pass

    def forget(self, seq_id: str) -> None:
        self._proposer.forget(seq_id)


class _RoundSpeculation:
    """Drafts of `config.num_speculative_tokens` from a proposer that runs one round a step for
    every running sequence (`draft`), handed out by `propose`: what a draft model and a draft
    head share."""

    _METHODS: tuple[SpeculativeMethod, ...] = ()

    def __init__(self, config: SpeculativeConfig, proposer: DraftModelProposer | DraftHeadProposer) -> None:
        """Raises SpeculativeConfigError for a method the subclass does not run."""
        if config.method not in self._METHODS:
            names = " or ".join(method.value for method in self._METHODS)
            raise SpeculativeConfigError("method", f"{type(self).__name__} runs {names}, not {config.method.value}")
        self.config = config
        self.proposer = proposer
        self._drafts: dict[str, tuple[int, ...]] = {}

    def is_active(self, num_running: int) -> bool:
        return self.config.speculates_at(num_running)

    def needs_final_tokens(self, running: SequenceOf[Sequence]) -> bool:
        return self.config.speculates_at(len(running))  # a round drafts for every caught-up sequence

    def prepare(self, running: SequenceOf[Sequence]) -> None:
        self._drafts = self.proposer.draft([draft_request(seq, self.config.num_speculative_tokens) for seq in running])

    def propose(self, seq_id: str, history: TokenHistory, max_drafts: int) -> tuple[int, ...]:
        drafts = self._drafts.pop(seq_id, ())
        return drafts[:max_drafts] if max_drafts > 0 else ()

    def observe(self, batch: ScheduledBatch, result: StepResult) -> None:
        pass

    def forget(self, seq_id: str) -> None:
        self._drafts.pop(seq_id, None)
        self.proposer.forget(seq_id)


class DraftModelSpeculation(_RoundSpeculation):
    """Drafts from a draft model (`DraftModelProposer`), which reads tokens only."""

    _METHODS = (SpeculativeMethod.DRAFT_MODEL,)
    proposer: DraftModelProposer


class DraftHeadSpeculation(_RoundSpeculation):
    """Drafts from a draft head fed the target's hidden states (MTP, EAGLE-3: `DraftHeadProposer`):
    the target's kept hidden states go to the proposer as each step commits (while speculation is
    on)."""

    _METHODS = (SpeculativeMethod.MTP, SpeculativeMethod.EAGLE3)
    proposer: DraftHeadProposer

    def __init__(self, config: SpeculativeConfig, proposer: DraftHeadProposer) -> None:
        super().__init__(config, proposer)
        self._active = False  # whether the step being built (then committed) speculates

    def is_active(self, num_running: int) -> bool:
        self._active = self.config.speculates_at(num_running)
        return self._active

    def observe(self, batch: ScheduledBatch, result: StepResult) -> None:
        # Not while speculation is off (large batches): nothing would feed the head those rows.
        if self._active and result.hidden_states is not None:
            self.proposer.observe(batch, result.hidden_states)


def draft_request(seq: Sequence, num_speculative_tokens: int) -> DraftRequest:
    """`seq`'s share of a draft round. The scheduler's rule for a sequence that may verify drafts
    (`Scheduler._add_drafts`): caught up with no token in flight, and room for the drafts and the
    token after them."""
    caught_up = seq.num_uncomputed_tokens == 1 and not seq.pending
    room = seq.max_total_tokens - seq.num_tokens - 1
    max_drafts = max(0, min(num_speculative_tokens, room)) if caught_up else 0
    bias = seq.sampling.logit_bias or {}
    return DraftRequest(seq.seq_id, seq, seq.num_computed_tokens, max_drafts,
                        (tuple(bias), tuple(float(value) for value in bias.values())))


def speculation_policy(config: SpeculativeConfig | None,
                       draft: DraftModelProposer | DraftHeadProposer | None = None) -> SpeculationPolicy:
    """The policy for a configuration (None: no speculation); `draft` runs a draft_model
    configuration's model (a `DraftModelProposer`) or an mtp / eagle3 configuration's head (a
    `DraftHeadProposer`). Raises SpeculativeConfigError naming `model` when that proposer is
    missing or of the other kind."""
    if config is None:
        return NoSpeculation()
    if config.method is SpeculativeMethod.NGRAM:
        return NgramSpeculation(config)
    what = "draft model" if config.method is SpeculativeMethod.DRAFT_MODEL else f"{config.method.value} head"
    if draft is None:
        raise SpeculativeConfigError("model", f"the {what} is not loaded; the engine builder loads it")
    if config.method is SpeculativeMethod.DRAFT_MODEL:
        if not isinstance(draft, DraftModelProposer):
            raise SpeculativeConfigError("model", "draft_model drafts with a DraftModelProposer")
        return DraftModelSpeculation(config, draft)
    if not isinstance(draft, DraftHeadProposer):
        raise SpeculativeConfigError("model", f"{config.method.value} drafts with a DraftHeadProposer")
    return DraftHeadSpeculation(config, draft)
