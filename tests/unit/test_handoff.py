"""`HandoffThread`: a job runs on the thread, `submit` returns once it has started (`post` at
once), outcomes and errors come back through the handle, and a closed thread refuses work."""

from __future__ import annotations

import threading
import time

import pytest

from atlas.domain.handoff import HandoffThread


def test_submit_returns_once_the_job_runs_and_the_result_comes_back() -> None:
    thread = HandoffThread("test-handoff")
    release = threading.Event()
    started: list[str] = []

    def job() -> int:
        started.append(threading.current_thread().name)
        release.wait(5)
        return 42

    try:
        outcome = thread.submit(job)
        assert started == ["test-handoff"]  # started before submit returned, on the thread
        release.set()
        assert outcome.result() == 42 and outcome.exception() is None and outcome.result() == 42
        assert [thread.submit(lambda i=i: i * i).result() for i in range(50)] == [i * i for i in range(50)]
    finally:
        thread.close()


def test_an_error_is_raised_where_the_outcome_is_read() -> None:
    thread = HandoffThread("test-handoff")
    try:
        outcome = thread.submit(lambda: 1 / 0)
        assert isinstance(outcome.exception(), ZeroDivisionError)
        with pytest.raises(ZeroDivisionError):
            outcome.result()
        assert thread.submit(lambda: "still serving").result() == "still serving"
    finally:
        thread.close()


def test_close_waits_for_the_job_and_refuses_more() -> None:
    thread = HandoffThread("test-handoff")
    outcome = thread.submit(lambda: time.sleep(0.05) or "done")
    thread.close()
    assert outcome.result() == "done"
    thread.close()  # a second close is a no-op
    with pytest.raises(RuntimeError, match="closed"):
        thread.submit(lambda: None)


def test_post_returns_at_once_and_the_job_signals_part_way() -> None:
    """`post` does not wait for the job to start; a job may complete a `Handoff` of its own
    before it returns (the engine's mask thread: the accepts, then the fill)."""
    from atlas.domain.handoff import Handoff

    thread = HandoffThread("test-handoff")
    release = threading.Event()
    part_way: Handoff[str] = Handoff()

    def job() -> str:
        release.wait(5)
        part_way.set_result("accepted")
        release.wait(5)
        return "filled"

    try:
        outcome = thread.post(job)  # returns although the job blocks at once
        release.set()
        assert part_way.result() == "accepted" and outcome.result() == "filled"
        failed: Handoff[str] = Handoff()
        thread.post(lambda: failed.set_exception(KeyError("ids")))
        assert isinstance(failed.exception(), KeyError)
        assert thread.submit(lambda: "submit after post").result() == "submit after post"
    finally:
        thread.close()
