"""cuBLASLt algorithm tuning: the winners' store (CPU) and tuned GEMMs on the GPU (results against
float64, winners reused by a fresh backend without timing again)."""

from __future__ import annotations

import json

import numpy as np
import pytest
from cuda_harness import BF16_TOLERANCE, bf16, cuda_test_backend, host, poisoned, rel_l2

from atlas.ports.gpu import DType

pytest.importorskip("cuda.bindings", reason="the cuda extra is not installed")

from atlas.adapters.cuda.gemm_tuning import GemmTuningStore, token_bucket


def test_token_buckets_are_powers_of_two_from_16():
    assert [token_bucket(n) for n in (1, 9, 16, 17, 64, 65, 8192, 8193)] == [16, 16, 16, 32, 64, 128, 8192, 16384]


def test_store_round_trips_through_its_file_and_survives_bad_files(tmp_path):
    path = GemmTuningStore.file_for(tmp_path, "NVIDIA H200", 130100)
    assert path.name == "cublaslt-nvidia-h200-130100.json"
    store = GemmTuningStore(path)
    store.put("64,4096,4096,bf16,bf16,0", bytes(range(64)))
    assert GemmTuningStore(path).get("64,4096,4096,bf16,bf16,0") == bytes(range(64))
    assert json.loads(path.read_text())["64,4096,4096,bf16,bf16,0"] == bytes(range(64)).hex()
    path.write_text("{not json")
    assert GemmTuningStore(path).get("64,4096,4096,bf16,bf16,0") is None
    blocked = tmp_path / "a-file"
    blocked.write_text("")
    in_memory = GemmTuningStore(blocked / "store.json")  # its folder cannot exist
    in_memory.put("k", b"\x01")
    assert in_memory.get("k") == b"\x01" and in_memory.path is None


@pytest.mark.gpu
@pytest.mark.parametrize(
    "num_tokens, num_rows, inner, out_dtype, with_bias",
    [
        (9, 14336, 4096, DType.BF16, False),  # decode batches: split-K candidates join the race
        (64, 4096, 4096, DType.BF16, True),
        (128, 6144, 4096, DType.F32, False),
        (1000, 4096, 1024, DType.BF16, True),  # a prefill chunk
    ],
)
def test_tuned_linear_matches_float64(cuda_backend, rng, num_tokens, num_rows, inner, out_dtype, with_bias):
    x = bf16(rng.standard_normal((num_tokens, inner)))
    weight = bf16(rng.standard_normal((num_rows, inner)) / np.sqrt(inner))
    bias = bf16(rng.standard_normal(num_rows)) if with_bias else None
    out = poisoned(cuda_backend, (num_tokens, num_rows), out_dtype)
    cuda_backend.linear(
        cuda_backend.upload(x, DType.BF16),
        cuda_backend.upload(weight, DType.BF16),
        out,
        cuda_backend.upload(bias, DType.BF16) if bias is not None else None,
    )
    expected = x.astype(np.float64) @ weight.astype(np.float64).T + (bias if bias is not None else 0.0)
    tolerance = BF16_TOLERANCE if out_dtype is DType.BF16 else 1e-4
    assert rel_l2(host(cuda_backend, out), expected) < tolerance


@pytest.mark.gpu
def test_every_decode_candidate_computes_the_product(cuda_backend, rng):
    """Decode-sized N races the heuristic's picks, their split-K copies and the tile variants
    (other tiles and clusters of the first pick): each one that joins must compute the product."""
    from atlas.adapters.cuda import cublaslt

    gemm = cuda_backend._linear._gemm
    if gemm._tuning is None:
        pytest.skip("cuBLASLt tuning is off (ATLAS_CUDA_DISABLE=gemm_tuning)")
    num_tokens, num_rows, inner = 40, 3072, 2048
    x = bf16(rng.standard_normal((num_tokens, inner)))
    weight = bf16(rng.standard_normal((num_rows, inner)) / np.sqrt(inner))
    expected = x.astype(np.float64) @ weight.astype(np.float64).T
    x_device, weight_device = cuda_backend.upload(x, DType.BF16), cuda_backend.upload(weight, DType.BF16)
    plan = gemm._build(num_tokens, num_rows, inner, DType.BF16, DType.BF16, False, False)
    heuristic = gemm._heuristic(plan.descriptor, plan.layouts, cublaslt._HEURISTIC_CANDIDATES)
    variants = gemm._tile_variants(plan.descriptor, plan.layouts, heuristic[0], num_tokens, heuristic)
    assert len(variants) > 0 and len(plan.candidates) > len(heuristic)  # split-K copies at least
    plan.candidates = np.concatenate([plan.candidates, variants])  # (again where the plan raced them)
    for index in range(len(plan.candidates)):
        out = poisoned(cuda_backend, (num_tokens, num_rows), DType.BF16)
        gemm._enqueue(plan, index, (x_device.address, weight_device.address, out.address))
        assert rel_l2(host(cuda_backend, out), expected) < BF16_TOLERANCE, f"candidate {index}"


@pytest.mark.gpu
def test_a_weight_smaller_than_the_l2_is_timed_from_hbm(cuda_backend, rng):
    """The tuner times a weight that fits the L2 after `evict_l2`: the product then streams its
    weight at no more than the HBM's peak rate, where back-to-back replays would read it from
    the L2 (faster than HBM). Its race includes the tile variants, under a key of its own."""
    from atlas.adapters.cuda.gemm_tuning import CandidateTimer

    rt = cuda_backend.runtime
    gemm = cuda_backend._linear._gemm
    if gemm._tuning is None or rt.peak_bandwidth == 0:
        pytest.skip("cuBLASLt tuning is off, or the driver gives no memory clock")
    num_tokens, num_rows, inner = 16, 4096, 2048  # a 16 MB weight
    assert num_rows * inner * 2 < rt.l2_bytes
    x = cuda_backend.upload(bf16(rng.standard_normal((num_tokens, inner))), DType.BF16)
    weight = cuda_backend.upload(bf16(rng.standard_normal((num_rows, inner)) / 45), DType.BF16)
    out = cuda_backend.empty((num_tokens, num_rows), DType.BF16)
    plan = gemm._build(num_tokens, num_rows, inner, DType.BF16, DType.BF16, False, False)
    assert plan.l2_resident and plan.tuning_key.endswith(",hbm")
    heuristic = gemm._heuristic(plan.descriptor, plan.layouts, 8)
    assert len(plan.candidates) > len(heuristic)
    timer = CandidateTimer(rt.stream_handle)
    try:
        def run() -> None:
            gemm._enqueue(plan, 0, (x.address, weight.address, out.address))

        evicted = timer.seconds(run, rt.evict_l2)
        resident = timer.seconds(run)
    finally:
        timer.close()
    weight_bytes = num_rows * inner * 2
    assert weight_bytes / evicted < 1.05 * rt.peak_bandwidth, (evicted, resident)
    assert evicted > resident, (evicted, resident)


@pytest.mark.gpu
def test_a_fresh_backend_takes_the_stored_winner_without_timing(tmp_path, rng, monkeypatch):
    from atlas.adapters import cuda
    from atlas.adapters.cuda import gemm_tuning

    if not cuda.available():
        pytest.skip("no CUDA GPU")
    x = bf16(rng.standard_normal((200, 2048)))
    weight = bf16(rng.standard_normal((3072, 2048)) / 45)
    results = []
    for run in range(2):
        backend = cuda_test_backend(tmp_path)
        if run == 1:  # the winner of bucket 256 is on disk now: no candidate may be timed
            monkeypatch.setattr(gemm_tuning.CandidateTimer, "seconds", _refuse_timing)
        out = poisoned(backend, (200, 3072), DType.BF16)
        backend.linear(backend.upload(x, DType.BF16), backend.upload(weight, DType.BF16), out)
        results.append(host(backend, out))
        backend.close()
    stores = list(tmp_path.glob("cublaslt-*.json"))
    keys = json.loads(stores[0].read_text()) if len(stores) == 1 else {}
    assert any(key.startswith("256,3072,2048,bf16,bf16,0") for key in keys), keys  # (",hbm": timed from HBM)
    np.testing.assert_array_equal(results[0], results[1])  # the same algorithm both times
    assert rel_l2(results[1], x.astype(np.float64) @ weight.astype(np.float64).T) < BF16_TOLERANCE


def _refuse_timing(self, run, evict=None):
    raise AssertionError("a stored winner should have been used")


@pytest.mark.gpu
def test_token_counts_of_one_bucket_reuse_its_algorithm_without_the_heuristic(cuda_backend, rng, monkeypatch):
    """Mixed serving steps bring a new token count nearly every step: after the bucket's first
    shape, the others of the bucket (here 600..1000 of bucket 1024) reuse its algorithm, never
    query the heuristic or time candidates, and still compute the product."""
    from atlas.adapters.cuda import gemm_tuning

    gemm = cuda_backend._linear._gemm
    num_rows, inner = 4096, 1024
    weight = bf16(rng.standard_normal((num_rows, inner)) / np.sqrt(inner))
    weight_device = cuda_backend.upload(weight, DType.BF16)

    def run(num_tokens):
        x = bf16(rng.standard_normal((num_tokens, inner)))
        out = poisoned(cuda_backend, (num_tokens, num_rows), DType.BF16)
        cuda_backend.linear(cuda_backend.upload(x, DType.BF16), weight_device, out)
        expected = x.astype(np.float64) @ weight.astype(np.float64).T
        assert rel_l2(host(cuda_backend, out), expected) < BF16_TOLERANCE, num_tokens

    run(1000)
    heuristics, derived = gemm.stats.num_heuristics, gemm.stats.num_derived
    monkeypatch.setattr(gemm_tuning.CandidateTimer, "seconds", _refuse_timing)
    for num_tokens in (600, 777, 513, 999):
        run(num_tokens)
    assert gemm.stats.num_heuristics == heuristics
    assert gemm.stats.num_derived == derived + 4


@pytest.mark.gpu
def test_warm_ups_are_recorded_per_key_across_restarts(tmp_path):
    """What `Worker.warm_up` asks: the sizes no earlier warm-up under the same key recorded,
    in this process or one before (the store on disk); another key has none recorded."""
    from atlas.adapters import cuda

    if not cuda.available():
        pytest.skip("no CUDA GPU")
    sizes = (16, 32, 300)
    backend = cuda_test_backend(tmp_path)
    assert backend.unprepared_token_counts("model-a", sizes) == sizes
    backend.record_prepared("model-a", (16, 300))
    assert backend.unprepared_token_counts("model-a", sizes) == (32,)
    backend.close()
    restarted = cuda_test_backend(tmp_path)
    assert restarted.unprepared_token_counts("model-a", sizes) == (32,)
    assert restarted.unprepared_token_counts("model-b", sizes) == sizes
    restarted.close()
