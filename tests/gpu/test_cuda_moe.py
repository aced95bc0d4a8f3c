"""The CUDA MoE kind's paths against the mock on the same data: the one-launch decode routing
(<= 8 tokens) and the norm + product + top-k routing past it; the grouped GEMV (<= 64 tokens)
and the aligned grouped GEMM past it; shared experts, biases, the clamped SwiGLU; at real
expert counts (128 experts, top 8; 512, top 10); captured in a graph."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from cuda_harness import assert_moe_replays_eager, bf16, poisoned, rel_l2

from atlas.adapters.mock.backend import MockGpuBackend
from atlas.ports.gpu import DType
from atlas.ports.kernels.host_weights import Activation, ClampedSwiglu, HostLinear, RmsNorm
from atlas.ports.kernels.moe import HostMoe, HostSharedExpert, Routing, Scoring

pytestmark = pytest.mark.gpu


def _host_moe(rng, hidden, inner, routing, activation=Activation.SILU, biases=False, shared_inner=0, gated=True):
    experts = routing.num_experts

    def weights(*shape, scale=1.0):
        return bf16(rng.standard_normal(shape) * scale / np.sqrt(shape[-1]))

    def bias(*shape):
        return bf16(rng.standard_normal(shape) * 0.1) if biases else None

    shared = None
    if shared_inner:
        shared = HostSharedExpert(HostLinear(weights(2 * shared_inner, hidden)), HostLinear(weights(hidden, shared_inner)),
                                  HostLinear(weights(1, hidden)) if gated else None)
    return HostMoe(
        input_norm=RmsNorm(bf16(1 + 0.2 * rng.standard_normal(hidden)), 1e-6),
        router=HostLinear(weights(experts, hidden, scale=4.0), bias(experts)),
        gate_up=HostLinear(weights(experts, 2 * inner, hidden), bias(experts, 2 * inner)),
        down=HostLinear(weights(experts, hidden, inner), bias(experts, hidden)),
        activation=activation,
        routing=routing,
        shared=shared,
    )


def _run(backend, host_moe, x, act_dtype):
    moe = backend.moe.prepare(host_moe)
    num_tokens, top_k = x.shape[0], host_moe.routing.top_k
    residual = backend.upload(x, act_dtype)
    normed = poisoned(backend, x.shape, act_dtype)
    ids = poisoned(backend, (num_tokens, top_k), DType.I32)
    weights = poisoned(backend, (num_tokens, top_k), DType.F32)
    backend.moe.route(residual, moe, normed, ids, weights)
    normed_rows = np.asarray(backend.begin_download(normed).wait(), np.float64)
    backend.moe.experts(normed, moe, ids, weights, residual)  # ids and weights hold the routing from here on
    return (normed_rows, np.asarray(backend.begin_download(ids).wait()),
            np.asarray(backend.begin_download(weights).wait(), np.float64),
            np.asarray(backend.begin_download(residual).wait(), np.float64))


CASES = [
    # (tokens, hidden, inner, routing, activation, biases, shared inner)
    (1, 2048, 768, Routing(128, 8, renormalize=True), Activation.SILU, False, 0),  # Qwen3-30B-A3B decode
    (8, 512, 96, Routing(128, 8, renormalize=True), Activation.SILU, False, 0),
    (9, 512, 96, Routing(128, 8, renormalize=True), Activation.SILU, False, 0),  # routing past one launch
    (64, 512, 96, Routing(128, 8, renormalize=True), Activation.SILU, False, 0),  # the last GEMV size
    (65, 512, 96, Routing(128, 8, renormalize=True), Activation.SILU, False, 0),  # the grouped GEMM
    (300, 256, 136, Routing(64, 6, renormalize=True), Activation.SILU, False, 200),
    (3, 256, 64, Routing(512, 10, renormalize=True), Activation.SILU, False, 64),  # Qwen3-Next-like
    (200, 256, 64, Routing(512, 10, renormalize=True), Activation.SILU, False, 64),
    (5, 320, 64, Routing(32, 4, renormalize=True), ClampedSwiglu(1.702, 7.0), True, 0),  # GPT-OSS-like
    (150, 320, 64, Routing(32, 4, renormalize=True), ClampedSwiglu(1.702, 7.0), True, 0),
    (20, 256, 64, Routing(64, 4, Scoring.SIGMOID, renormalize=True, scaling=2.5), Activation.GELU_TANH, False, 0),
]


@pytest.fixture(params=["wgmma", "mma"])
def gemm_kernel(request, cuda_backend, monkeypatch):
    """The prefill GEMM's two forms: wgmma (kernels/sm90/moe.cu, Hopper) and mma.sync."""
    runtime = cuda_backend.runtime
    if request.param == "wgmma" and not runtime.kernels.provides("moe", "moe_wgmma_down"):
        pytest.skip("no wgmma MoE kernels on this GPU")
    monkeypatch.setattr(runtime, "features", dataclasses.replace(runtime.features, moe_wgmma=request.param == "wgmma"))
    return request.param


@pytest.mark.parametrize("num_tokens, hidden, inner, routing, activation, biases, shared_inner", CASES)
def test_route_and_experts_match_the_mock(cuda_backend, rng, gemm_kernel, num_tokens, hidden, inner, routing,
                                          activation, biases, shared_inner):
    if num_tokens <= 64 and gemm_kernel == "mma":
        pytest.skip("decode sizes take the grouped GEMV whatever the GEMM")
    host_moe = _host_moe(rng, hidden, inner, routing, activation, biases, shared_inner)
    x = bf16(rng.standard_normal((num_tokens, hidden)) * 2)
    normed, ids, weights, residual = _run(cuda_backend, host_moe, x, DType.BF16)
    mock = MockGpuBackend(activation_dtype=DType.F32)
    mock_moe = mock.moe.prepare(host_moe)
    # The mock runs the experts CUDA chose, from CUDA's own normed rows (same bf16 values).
    m_normed = mock.upload(normed.astype(np.float32), DType.F32)
    expected_normed = x / np.sqrt((x.astype(np.float64) ** 2).mean(1, keepdims=True) + 1e-6) * host_moe.input_norm.weight
    assert rel_l2(normed, expected_normed) < 1e-2
    m_ids = mock.upload(ids.astype(np.int32))
    m_weights = mock.upload(weights.astype(np.float32))
    stream = mock.upload(x, DType.F32)
    mock.moe.experts(m_normed, mock_moe, m_ids, m_weights, stream)
    assert (np.sort(ids, axis=1)[:, 1:] != np.sort(ids, axis=1)[:, :-1]).all()  # distinct experts per token
    assert ids.min() >= 0 and ids.max() < routing.num_experts
    assert rel_l2(residual - x, mock.begin_download(stream).wait() - x) < 2e-2


@pytest.mark.parametrize("num_tokens, first, held", [(1, 64, 64), (6, 0, 32), (20, 32, 32), (100, 96, 32)])
def test_an_expert_parallel_share_adds_only_its_experts(cuda_backend, rng, num_tokens, first, held):
    """A rank holding experts first .. first + held - 1 of 128: the grouped GEMV's slot table
    (written by the routing, ids local) and the grouped GEMM's shifted ids against the mock."""
    routing = Routing(128, 8, renormalize=True)
    whole = _host_moe(rng, 256, 64, routing, shared_inner=0)
    share = dataclasses.replace(
        whole,
        gate_up=HostLinear(whole.gate_up.weight[first : first + held]),
        down=HostLinear(whole.down.weight[first : first + held]),
        first_expert=first,
    )
    x = bf16(rng.standard_normal((num_tokens, 256)) * 2)
    normed, ids, weights, residual = _run(cuda_backend, share, x, DType.BF16)
    assert ((ids >= first) & (ids < first + held)).any() and ((ids < first) | (ids >= first + held)).any()
    mock = MockGpuBackend(activation_dtype=DType.F32)
    stream = mock.upload(x, DType.F32)
    mock.moe.experts(mock.upload(normed.astype(np.float32), DType.F32), mock.moe.prepare(share),
                     mock.upload(ids.astype(np.int32)), mock.upload(weights.astype(np.float32)), stream)
    assert rel_l2(residual - x, mock.begin_download(stream).wait() - x) < 2e-2


@pytest.mark.parametrize(
    "routing, activation, biases, shared_inner, first, held",
    [
        (Routing(128, 8, renormalize=True), Activation.SILU, False, 0, 0, 128),  # Qwen3-30B-A3B
        (Routing(512, 10, renormalize=True), Activation.SILU, False, 64, 0, 512),  # Qwen3-Next: a shared expert
        (Routing(32, 4, renormalize=True), ClampedSwiglu(1.702, 7.0), True, 0, 0, 32),  # GPT-OSS-like
        (Routing(64, 6, Scoring.SIGMOID, renormalize=True, scaling=2.5), Activation.SILU, False, 0, 0, 64),
        (Routing(128, 8, renormalize=True), Activation.SILU, False, 0, 64, 64),  # a rank's share: slots skipped
        (Routing(128, 8, renormalize=True), Activation.SILU, False, 0, 120, 4),  # fewer slots than k: the table
    ],
)
def test_one_token_routed_inside_the_experts_matches_the_slot_table(cuda_backend, rng, routing, activation, biases,
                                                                     shared_inner, first, held):
    """At one token the expert kernels route the token from the logits themselves
    (`moe_local_route`); ids, weights and the residual are the slot table path's, bit for bit."""
    runtime = cuda_backend.runtime
    host_moe = _host_moe(rng, 512, 96, routing, activation, biases, shared_inner)
    if routing.scoring is Scoring.SIGMOID:
        host_moe = dataclasses.replace(host_moe, selection_bias=bf16(rng.standard_normal(routing.num_experts) * 0.05))
    if held < routing.num_experts:
        host_moe = dataclasses.replace(host_moe, gate_up=HostLinear(host_moe.gate_up.weight[first: first + held]),
                                       down=HostLinear(host_moe.down.weight[first: first + held]), first_expert=first)
    x = bf16(rng.standard_normal((1, 512)) * 2)
    saved = runtime.features
    try:
        results = {}
        for local in (True, False):
            runtime.features = dataclasses.replace(saved, moe_local_route=local)
            results[local] = _run(cuda_backend, host_moe, x, DType.BF16)
    finally:
        runtime.features = saved
    for on, off in zip(results[True], results[False]):
        np.testing.assert_array_equal(on, off)
    ids = results[True][1]
    if ((ids >= first) & (ids < first + held)).any():
        assert not np.array_equal(results[True][3], x)  # the held experts added something


def test_routing_ids_match_a_reference_of_its_own_normed_rows(cuda_backend, rng):
    """Both routing paths choose exactly the experts the float64 reference chooses from the rows
    they normalised (ties aside), with its weights."""
    for num_tokens in (1, 8, 33):
        routing = Routing(128, 8, renormalize=True)
        host_moe = _host_moe(rng, 512, 64, routing)
        x = bf16(rng.standard_normal((num_tokens, 512)) * 3)
        normed, ids, weights, _ = _run(cuda_backend, host_moe, x, DType.BF16)
        logits = normed @ host_moe.router.weight.T.astype(np.float64)
        scores = np.exp(logits - logits.max(1, keepdims=True))
        scores /= scores.sum(1, keepdims=True)
        expected_ids = np.argsort(-scores, axis=1, kind="stable")[:, :8]
        expected_weights = np.take_along_axis(scores, expected_ids, 1)
        expected_weights /= expected_weights.sum(1, keepdims=True)
        np.testing.assert_array_equal(ids, expected_ids)
        assert rel_l2(weights, expected_weights) < 1e-5


@pytest.mark.parametrize("num_tokens", [1, 16, 64])
def test_experts_replay_from_a_graph_with_new_routing(cuda_backend, rng, num_tokens):
    """route + experts captured once replay for new inputs as eager runs compute them (the grids
    do not depend on which experts were chosen)."""
    routing = Routing(128, 8, renormalize=True)
    moe = cuda_backend.moe.prepare(_host_moe(rng, 256, 64, routing, shared_inner=64))
    assert_moe_replays_eager(cuda_backend, rng, moe, num_tokens, 256, routing.top_k)


def test_prepare_refuses_what_the_kernels_cannot_hold(cuda_backend, rng):
    from atlas.ports.gpu import UnsupportedError

    with pytest.raises(UnsupportedError, match="num_experts"):
        cuda_backend.moe.prepare(_host_moe(rng, 64, 16, Routing(600, 2)))
    with pytest.raises(UnsupportedError, match="multiples of 8"):
        cuda_backend.moe.prepare(_host_moe(rng, 64, 12, Routing(8, 2)))


def _ring_kernel(runtime):
    if not runtime.kernels.provides("moe", "moe_ring_silu"):
        pytest.skip("no moe_ring_silu on this GPU (kernels/sm90/moe.cu)")


def test_one_token_ring_kernel_matches_the_kernel_chain(cuda_backend, rng):
    """moe_ring_silu (one persistent kernel for one token's routed experts, Hopper) against
    moe_gate_up + moe_down on Qwen3-30B-A3B's shape: the same routing bit for bit, the residual
    within the bf16 roundings the two orders of summation take."""
    runtime = cuda_backend.runtime
    _ring_kernel(runtime)
    routing = Routing(128, 8, renormalize=True)
    host_moe = _host_moe(rng, 2048, 768, routing)
    saved = runtime.features
    try:
        for _ in range(3):
            x = bf16(rng.standard_normal((1, 2048)) * 2)
            results = {}
            for ring in (True, False):
                runtime.features = dataclasses.replace(saved, moe_ring=ring)
                results[ring] = _run(cuda_backend, host_moe, x, DType.BF16)
            (normed, ids, weights, residual), (normed_off, ids_off, weights_off, residual_off) = (
                results[True], results[False])
            np.testing.assert_array_equal(normed, normed_off)
            np.testing.assert_array_equal(ids, ids_off)
            np.testing.assert_array_equal(weights, weights_off)
            assert not np.array_equal(residual, x)
            assert rel_l2(residual - x, residual_off - x) < 1e-2
    finally:
        runtime.features = saved


def test_one_token_ring_kernel_replays_from_a_graph(cuda_backend, rng):
    """The ring kernel's grid barrier is ready again after every launch: replays of a captured
    route + experts give what eager runs give, for new routing each time."""
    _ring_kernel(cuda_backend.runtime)
    routing = Routing(128, 8, renormalize=True)
    moe = cuda_backend.moe.prepare(_host_moe(rng, 2048, 768, routing))
    assert_moe_replays_eager(cuda_backend, rng, moe, 1, 2048, routing.top_k)
