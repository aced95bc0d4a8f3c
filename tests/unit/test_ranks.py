"""Rank processes on the mock communicator: steps, failures named by rank, and no process left
behind. Every test spawns real rank processes (python -m atlas.app.ranks)."""

from __future__ import annotations

import functools
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from atlas.adapters.comm.mock import new_mock_comm_id
from atlas.app.ranks import RankFailure, RankGroup
from helpers import rank_workers
from helpers.rank_workers import HIDDEN, mlp_reference


def is_gone(pid: int, within_s: float = 10.0) -> bool:
    """Whether `pid` has exited (a zombie awaiting its reaper counts as exited)."""
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except FileNotFoundError:
            return True
        except OSError:
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                return True
            state = "R"
        if state == "Z":
            return True
        time.sleep(0.05)
    return False


def group(world_size: int, factory, **options) -> RankGroup:
    return RankGroup(world_size, factory, new_mock_comm_id(), **options)


def test_ranks_run_tensor_parallel_steps_that_match_the_whole_model_and_agree():
    rng = np.random.default_rng(3)
    ranks = group(3, rank_workers.tensor_parallel_mlp)
    with ranks:
        pids = ranks.pids
        for batch in (1, 4):
            x = rng.standard_normal((batch, HIDDEN)).astype(np.float32)
            replies = ranks.step(x.tobytes())
            assert len(replies) == ranks.world_size and len(set(replies)) == 1  # the same bits everywhere
            np.testing.assert_allclose(np.frombuffer(replies[0], np.float32).reshape(batch, HIDDEN),
                                       mlp_reference(x), rtol=1e-5, atol=1e-5)
    assert all(is_gone(pid) for pid in pids)


def test_a_rank_that_raises_fails_the_step_naming_it_and_stops_every_rank():
    failures: list[RankFailure] = []
    ranks = group(2, functools.partial(rank_workers.tensor_parallel_mlp, crash_rank=1, at_step=1),
                  on_failure=failures.append)
    ranks.start()
    pids = ranks.pids
    x = np.ones((1, HIDDEN), np.float32).tobytes()
    ranks.step(x)
    with pytest.raises(RankFailure, match="rank 1: RuntimeError: rank 1 broke at step 1") as caught:
        ranks.step(x)
    assert caught.value.rank == 1 and not caught.value.is_user_error
    assert all(is_gone(pid) for pid in pids)
    assert failures == [caught.value]
    with pytest.raises(RankFailure, match="broke at step 1"):
        ranks.check()
    ranks.close()


def test_killing_an_idle_rank_is_noticed_at_once_and_stops_the_others():
    noticed = threading.Event()
    ranks = group(3, rank_workers.sleeper, on_failure=lambda failure: noticed.set())
    ranks.start()
    pids = ranks.pids
    os.kill(pids[1], signal.SIGKILL)
    assert noticed.wait(10)
    assert ranks.failure.rank == 1 and str(ranks.failure) == "rank 1 was killed by SIGKILL"
    assert all(is_gone(pid) for pid in pids)
    with pytest.raises(RankFailure, match="rank 1 was killed by SIGKILL"):
        ranks.step(b"")
    ranks.close()


def test_killing_a_rank_in_the_middle_of_a_step_fails_the_step_without_waiting_for_the_others():
    # rank 1 stalls, so ranks 0 and 2 sit in an all-reduce when rank 2 is killed
    ranks = group(3, functools.partial(rank_workers.tensor_parallel_mlp, stall_rank=1))
    ranks.start()
    pids = ranks.pids
    ranks.submit(np.ones((1, HIDDEN), np.float32).tobytes())
    time.sleep(0.3)
    started = time.monotonic()
    os.kill(pids[2], signal.SIGKILL)
    with pytest.raises(RankFailure) as caught:
        ranks.collect()
    assert caught.value.rank == 2, str(caught.value)
    assert time.monotonic() - started < 10
    assert all(is_gone(pid) for pid in pids)
    ranks.close()


def test_a_silent_rank_is_named_by_its_peers_communicator():
    ranks = group(3, functools.partial(rank_workers.tensor_parallel_mlp, stall_rank=1, comm_timeout_s=0.5))
    with ranks:
        with pytest.raises(RankFailure, match="rank 1 did not join collective #0") as caught:
            ranks.step(np.ones((1, HIDDEN), np.float32).tobytes())
        assert caught.value.rank == 1


def test_a_step_timeout_names_the_rank_that_hangs():
    ranks = group(1, rank_workers.sleeper, step_timeout_s=0.5)
    with ranks:
        pid = ranks.pids[0]
        with pytest.raises(RankFailure, match="rank 0 did not finish the step within 0.5 s") as caught:
            ranks.step(b"hang")
        assert caught.value.rank == 0
        assert is_gone(pid)


def test_a_rank_that_cannot_load_refuses_the_start_with_its_message():
    ranks = group(2, functools.partial(rank_workers.refuse_to_load, rank=1))
    with pytest.raises(RankFailure, match=r"rank 1: the model does not fit \(try --kv-cache-gb 1\)") as caught:
        ranks.start()
    assert caught.value.rank == 1 and caught.value.is_user_error
    assert all(is_gone(pid) for pid in ranks.pids)
    ranks.close()


def test_closing_leaves_no_process_behind_not_even_the_ranks_children():
    ranks = group(2, rank_workers.sleeper)
    ranks.start()
    pids = [int(pid) for reply in ranks.step(b"") for pid in reply.split()]
    assert len(pids) == 4 and not any(is_gone(pid, within_s=0) for pid in pids)
    ranks.close()
    assert all(is_gone(pid) for pid in pids)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the parent-death signal is Linux's")
def test_ranks_die_with_their_driver(tmp_path):
    script = textwrap.dedent("""
        import os, signal
        from atlas.adapters.comm.mock import new_mock_comm_id
        from atlas.app.ranks import RankGroup
        from helpers import rank_workers
        ranks = RankGroup(2, rank_workers.tensor_parallel_mlp, new_mock_comm_id())
        ranks.start()
        print(*ranks.pids, flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
    """)
    tests_dir = Path(__file__).resolve().parents[1]
    environment = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tests_dir.parent), str(tests_dir)])}
    driver = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60,
                            env=environment)
    assert driver.returncode == -signal.SIGKILL, driver.stderr
    pids = [int(pid) for pid in driver.stdout.split()]
    assert len(pids) == 2 and all(is_gone(pid) for pid in pids)
