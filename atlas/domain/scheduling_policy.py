"""Scheduling policies: who is admitted first, and who gives up its blocks under pressure.

The scheduler owns the mechanics (budget, blocks, chunking); a policy only orders. A new policy
(SLA-aware admission, say) is a new object passed to `Scheduler`, not a branch in it.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Sequence as SequenceList
from typing import Protocol

from atlas.domain.requests import ParameterError
from atlas.domain.sequence import Sequence


class SchedulingPolicy(Protocol):
    """Admission order of the waiting queue and the choice of a preemption victim."""

    def check(self, seq: Sequence) -> None:
        """Raise ParameterError naming the field when this policy cannot honour the request."""
        ...

    def admission_order(self, waiting: Collection[Sequence]) -> Iterable[Sequence]:
        """The waiting sequences in the order admission should try them.

        `waiting` is the queue as the scheduler holds it (preempted sequences at the front, then
        new ones in arrival order); it must not be changed. The scheduler stops at the first
        sequence that does not fit, so the head of the order is never starved by smaller ones
        behind it. Yielding a sequence not in `waiting` is a contract violation.
        """
        ...

    def choose_victim(self, candidates: SequenceList[Sequence], requester: Sequence) -> Sequence:
        """Which running sequence to preempt so that `requester` can get a block.

        `candidates` are the running sequences not yet scheduled in the step being built, in
        admission order, `requester` among them; the answer must be one of them (the scheduler
        raises otherwise). Choosing `requester` itself means it waits for a later step.
        """
        ...


class FifoPolicy:
    """First come, first served: admit in queue order; preempt the most recently admitted."""

    __slots__ = ()

    def check(self, seq: Sequence) -> None:
        """Refuses a priority: it would be ignored here."""
        if seq.priority != 0:
            raise ParameterError(
                "priority",
                f"priority {seq.priority} needs the server started with --scheduling-policy priority; "
                f"this one schedules first come, first served (omit priority or send 0)",
            )

    def admission_order(self, waiting: Collection[Sequence]) -> Iterable[Sequence]:
        """The queue as it stands."""
        return iter(waiting)

    def choose_victim(self, candidates: SequenceList[Sequence], requester: Sequence) -> Sequence:
        """The newest candidate, so the sequences admitted before it keep their progress."""
        return candidates[-1]


class PriorityPolicy:
    """Lower `priority` first (as vLLM): admit the most urgent waiting sequence first, preempt
    the least urgent running one. Equal priorities keep first come, first served: queue order
    for admission (preempted sequences at its front), the newest for preemption."""

    __slots__ = ()

    def check(self, seq: Sequence) -> None:
        """Any priority is honoured."""

    def admission_order(self, waiting: Collection[Sequence]) -> Iterable[Sequence]:
        """The queue sorted by priority; the sort is stable, so ties keep queue order."""
        return sorted(waiting, key=_priority)

    def choose_victim(self, candidates: SequenceList[Sequence], requester: Sequence) -> Sequence:
        """The candidate with the largest priority value, the newest among equals."""
        return max(reversed(candidates), key=_priority)


def _priority(seq: Sequence) -> int:
    return seq.priority


POLICIES: dict[str, type[FifoPolicy] | type[PriorityPolicy]] = {"fifo": FifoPolicy, "priority": PriorityPolicy}
"""The policies `--scheduling-policy` names."""
