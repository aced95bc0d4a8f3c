"""`HandoffThread`: a job runs on the thread, `submit` returns once it has started, outcomes and
errors come back through the handle, and a closed thread refuses work."""

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
