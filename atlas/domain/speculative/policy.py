"""When the scheduler speculates, and with which drafts: a policy object plugged into it.

    policy.is_active(num_running)        this step may verify drafts: commit the previous one
                                         first (drafts and their verification need final tokens)
    policy.propose(seq, max_drafts)      up to max_drafts drafts for a caught-up sequence
    policy.forget(seq_id)                the sequence finished: drop what the proposer keeps

`NoSpeculation` is the null object (the scheduler's default); `NgramSpeculation` drafts with
prompt lookup (`NgramProposer`) and switches itself off for steps with more running sequences
than the config's `disable_by_batch_size`.
"""

from __future__ import annotations

from typing import Protocol

from atlas.domain.speculative.config import SpeculativeConfig, SpeculativeConfigError, SpeculativeMethod
from atlas.domain.speculative.ngram import NgramProposer, TokenHistory


class SpeculationPolicy(Protocol):
    def is_active(self, num_running: int) -> bool:
        """Whether a step with `num_running` running sequences proposes drafts."""
        ...

    def propose(self, seq_id: str, history: TokenHistory, max_drafts: int) -> tuple[int, ...]:
        """At most `max_drafts` drafts to follow `history`'s final tokens (possibly none)."""
        ...

    def forget(self, seq_id: str) -> None:
        """`seq_id` finished or was aborted (a no-op for one never seen)."""
        ...


class NoSpeculation:
    """Never drafts."""

    def is_active(self, num_running: int) -> bool:
        return False

    def propose(self, seq_id: str, history: TokenHistory, max_drafts: int) -> tuple[int, ...]:
        return ()

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

    def propose(self, seq_id: str, history: TokenHistory, max_drafts: int) -> tuple[int, ...]:
        if max_drafts <= 0:
            return ()
        return self._proposer.propose(seq_id, history)[:max_drafts]

    def forget(self, seq_id: str) -> None:
        self._proposer.forget(seq_id)


def speculation_policy(config: SpeculativeConfig | None) -> SpeculationPolicy:
    """The policy for a configuration (None: no speculation). Raises SpeculativeConfigError
    naming `method` for a method the engine cannot run yet."""
    if config is None:
        return NoSpeculation()
    if config.method is not SpeculativeMethod.NGRAM:
        raise SpeculativeConfigError(
            "method", f"{config.method.value} is not supported by the engine yet; use ngram"
        )
    return NgramSpeculation(config)
