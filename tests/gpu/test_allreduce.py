"""The P2P all-reduce on 2 and 4 GPUs against NCCL and the references, through real rank
processes; and a rank killed mid-step leaves no process and no GPU memory behind.

    source .devkit/env.sh && python3 -m pytest tests/gpu/test_allreduce.py -m gpu -q
"""

from __future__ import annotations

import os
import signal
import subprocess
import time

import pytest

pytestmark = pytest.mark.gpu
os.environ["NCCL_NVLS_ENABLE"] = "0"


def _num_gpus() -> int:
    pytest.importorskip("cuda.core", reason="the cuda extra is not installed")
    pytest.importorskip("nccl", reason="nccl4py is not installed")
    from cuda.bindings import driver as cu

    if cu.cuInit(0)[0] != cu.CUresult.CUDA_SUCCESS:
        return 0
    return int(cu.cuDeviceGetCount()[1])


@pytest.fixture(scope="module", params=[2, 4], ids=lambda n: f"{n}-gpus")
def ranks(request, kernel_cache_dir):
    from atlas.app.bench.allreduce import start_group

    if _num_gpus() < request.param:
        pytest.skip(f"needs {request.param} GPUs")
    group = start_group(request.param, str(kernel_cache_dir))
    yield group
    group.close()


def test_p2p_all_reduce_matches_the_reference_bit_for_bit_and_nccl_within_rounding(ranks):
    from atlas.app.bench.allreduce import CHECK_SIZES, run_checks

    rows = run_checks(ranks, CHECK_SIZES)
    failed = [row for row in rows if not row.ok]
    assert not failed, "\n".join(map(str, failed[:20]))
    paths = {row.path for row in rows}
    assert {"ll", "one_shot", "two_shot", "nccl", "auto", "graph 2"} <= paths  # the P2P kernels did run
    assert {row.rank for row in rows} == set(range(ranks.world_size))


def test_timings_come_back_from_every_rank_for_every_path(ranks):
    from atlas.app.bench.allreduce import DECODE_SIZES, run_timings

    rows = run_timings(ranks, DECODE_SIZES[:2])
    assert {(row.num_bytes, row.path) for row in rows} >= {(DECODE_SIZES[0], path)
                                                            for path in ("ll", "one_shot", "two_shot", "nccl")}
    assert all(row.us_per_call > 0 for row in rows)


def _memory_used_mib() -> list[int]:
    """Per GPU (nvidia-smi reads it for the whole device, so it works inside containers too)."""
    listing = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, check=True).stdout
    return [int(line) for line in listing.split()]


def test_a_rank_killed_in_the_middle_of_a_step_fails_it_fast_and_frees_every_gpu(kernel_cache_dir):
    import msgspec

    from atlas.app.bench.allreduce import CheckRequest, start_group
    from atlas.app.ranks import RankFailure

    if _num_gpus() < 2:
        pytest.skip("needs 2 GPUs")
    before = _memory_used_mib()[:2]
    group = start_group(2, str(kernel_cache_dir))
    pids = group.pids
    assert all(used > was for used, was in zip(_memory_used_mib()[:2], before))  # the ranks hold memory
    group.submit(msgspec.msgpack.encode(CheckRequest([64 << 20], ["bf16", "f32"])))
    time.sleep(1.0)
    started = time.monotonic()
    os.kill(pids[1], signal.SIGKILL)
    with pytest.raises(RankFailure) as caught:
        group.collect()
    assert caught.value.rank == 1, str(caught.value)
    assert time.monotonic() - started < 30
    group.close()
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if all(used <= was + 64 for used, was in zip(_memory_used_mib()[:2], before)):
            break
        time.sleep(0.5)
    assert all(used <= was + 64 for used, was in zip(_memory_used_mib()[:2], before)), (before, _memory_used_mib())
