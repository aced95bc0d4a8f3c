"""Rank processes: one worker process per device, driven by the engine core.

The driver (the engine core) spawns `python -m atlas.app.ranks FD` once per rank, all in one
process group, each with one end of a socket pair, and talks to them in the frames of
`engine_protocol` (4-byte length + msgpack):

    driver -> rank:  StartRank(rank, world, device, comm id, worker factory)   once
                     Step(body, reply)  every step: one message, encoded once, the same bytes
                                        to all; `reply` False for a step answered later
                     Stop
    rank -> driver:  RankReady(body) | RankFailed(message, is_user_error, culprit)  after loading
                     StepDone(body) | RankFailed(...)                    after each replied step

What a rank does is a plug-in: `factory(RankContext) -> RankWorker` runs once in the rank
(load weights, build its device, join the communicator whose id the driver made; what it
reports back is `worker.loaded()`) and `worker.step(body) -> bytes` runs each step; the
factory travels pickled (a top-level function or a `functools.partial` of one), importable in
the rank because the rank takes the driver's `sys.path`.

Health. A rank that raises reports it and waits to be stopped, so its message is never lost;
a rank that dies is seen by a watcher thread at once. Either way the driver kills the whole
group (SIGKILL to the process group, which takes anything the ranks started too), calls
`on_failure` (or the callback given to `watch`), and raises `RankFailure` naming the rank at
fault from `start`, `collect` and `check` from then on. No wait of the driver outlives a dead rank. Ranks die with the driver
too (Linux's parent-death signal, bound to the thread that called `start`, so call it from a
thread that lives as long as the group), and a rank whose driver closes its socket exits.
"""

from __future__ import annotations

from atlas.app.ranks.group import RankFailure, RankGroup
from atlas.app.ranks.wire import RankContext, RankFactory, RankWorker

__all__ = ["RankContext", "RankFactory", "RankFailure", "RankGroup", "RankWorker"]
