"""The MoE kind: routing and the grouped experts, against float64 references and against
transformers' own Qwen3-MoE, GPT-OSS and Qwen3-Next blocks."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from contract_harness import prepared_or_skip, require_kind
from kind_references import bf16, expert, glu, rel, rmsnorm, route

from atlas.ports.gpu import DType, Kind
from atlas.ports.kernels.host_weights import Activation, ClampedSwiglu, HostLinear, RmsNorm
from atlas.ports.kernels.moe import HostMoe, HostSharedExpert, Routing, Scoring

EPS = 1e-6


@pytest.fixture(autouse=True)
def _needs_the_kind(harness):
    require_kind(harness, Kind.MOE)


def _host_moe(rng, hidden, inner, routing, activation=Activation.SILU, biases=False, shared=False, selection_bias=None):
    experts = routing.num_experts

    def weights(*shape):
        return bf16(rng.standard_normal(shape) / np.sqrt(shape[-1]))

    def bias(*shape):
        return bf16(rng.standard_normal(shape) * 0.1) if biases else None

    shared_expert = None
    if shared:
        shared_expert = HostSharedExpert(HostLinear(weights(2 * 24, hidden)), HostLinear(weights(hidden, 24)),
                                         HostLinear(weights(1, hidden)))
    return HostMoe(
        input_norm=RmsNorm(bf16(1 + 0.2 * rng.standard_normal(hidden)), EPS),
        router=HostLinear(weights(experts, hidden) * 4, bias(experts)),
        gate_up=HostLinear(weights(experts, 2 * inner, hidden), bias(experts, 2 * inner)),
        down=HostLinear(weights(experts, hidden, inner), bias(experts, hidden)),
        activation=activation,
        routing=routing,
        selection_bias=selection_bias,
        shared=shared_expert,
    )


def _run(harness, host: HostMoe, x: np.ndarray):
    """(normed, ids, weights, residual after `experts`) as the backend computes them."""
    backend = harness.backend
    moe = prepared_or_skip(backend.moe.prepare, host)
    num_tokens, top_k = x.shape[0], host.routing.top_k
    residual = backend.upload(x, harness.act)
    normed = harness.poisoned(x.shape)
    ids, weights = harness.poisoned((num_tokens, top_k), DType.I32), harness.poisoned((num_tokens, top_k), DType.F32)
    backend.moe.route(residual, moe, normed, ids, weights)
    normed_rows = harness.host(normed)
    backend.moe.experts(normed, moe, ids, weights, residual)  # ids and weights hold the routing from here on
    return normed_rows, harness.host(ids), harness.host(weights), harness.host(residual)


ROUTINGS = [
    Routing(16, 4),  # Qwen3-MoE without renormalisation
    Routing(16, 2, Scoring.SOFTMAX, renormalize=True),  # Qwen3-MoE, GPT-OSS
    Routing(32, 8, Scoring.SIGMOID, renormalize=True, scaling=2.5),  # DeepSeek-V3 style
]


@pytest.mark.parametrize("routing", ROUTINGS)
@pytest.mark.parametrize("num_tokens", [1, 7, 40])
def test_route(harness, rng, routing, num_tokens):
    hidden = 64
    selection_bias = bf16(rng.standard_normal(routing.num_experts) * 0.05) if routing.scoring is Scoring.SIGMOID else None
    host = _host_moe(rng, hidden, 32, routing, biases=True, selection_bias=selection_bias)
    x = bf16(rng.standard_normal((num_tokens, hidden)) * 3)
    normed, ids, weights, _ = _run(harness, host, x)
    expected_normed = rmsnorm(x, host.input_norm.weight, EPS)
    assert rel(normed, expected_normed) < harness.tolerance
    expected_ids, expected_weights = route(normed, host.router.weight, host.router.bias, routing, selection_bias)
    np.testing.assert_array_equal(ids, expected_ids)  # from the backend's own normed rows: same ties
    assert rel(weights, expected_weights) < harness.tolerance


def test_route_breaks_ties_by_the_lowest_expert_id(harness, rng):
    """Experts with equal scores are chosen lowest id first."""
    hidden, routing = 16, Routing(8, 3)
    host = _host_moe(rng, hidden, 8, routing)
    router = np.zeros((8, hidden), np.float32)
    router[[2, 5, 6]] = 1.0  # three experts tie for first place, the rest for fourth
    host = HostMoe(host.input_norm, HostLinear(router), host.gate_up, host.down, host.activation, routing)
    _, ids, _, _ = _run(harness, host, np.ones((2, hidden), np.float32))
    np.testing.assert_array_equal(ids, [[2, 5, 6], [2, 5, 6]])
    host = HostMoe(host.input_norm, HostLinear(np.zeros((8, hidden), np.float32)), host.gate_up, host.down,
                   host.activation, routing)
    _, ids, weights, _ = _run(harness, host, np.ones((1, hidden), np.float32))
    np.testing.assert_array_equal(ids, [[0, 1, 2]])
    assert rel(weights, np.full((1, 3), 1 / 8)) < 1e-6


@pytest.mark.parametrize("num_tokens", [3, 23, 70])  # CUDA: grouped GEMV (its down kernel, looped), GEMM
@pytest.mark.parametrize(
    "activation, biases, shared",
    # the gates here are ~N(0, 1): a limit of 1 binds for a third of them (GPT-OSS's 7 never would)
    [(Activation.SILU, False, False), (ClampedSwiglu(alpha=1.702, limit=1.0), True, False), (Activation.SILU, False, True)],
)
def test_experts_add_the_weighted_routed_and_shared_experts(harness, rng, activation, biases, shared, num_tokens):
    hidden, inner, routing = 64, 48, Routing(8, 2, renormalize=True)
    host = _host_moe(rng, hidden, inner, routing, activation, biases, shared)
    x = bf16(rng.standard_normal((num_tokens, hidden)) * 2)
    normed, ids, weights, residual = _run(harness, host, x)
    expected = x.astype(np.float64).copy()
    for t in range(x.shape[0]):
        for e, w in zip(ids[t], weights[t], strict=True):
            gate_up_bias = None if host.gate_up.bias is None else host.gate_up.bias[e]
            down_bias = None if host.down.bias is None else host.down.bias[e]
            expected[t] += w * expert(normed[t], host.gate_up.weight[e], gate_up_bias, host.down.weight[e], down_bias,
                                      activation)
    if shared:
        hidden_shared = glu(normed @ host.shared.gate_up.weight.T.astype(np.float64), activation)
        gate = 1 / (1 + np.exp(-(normed @ host.shared.gate.weight.T.astype(np.float64))))
        expected += gate * (hidden_shared @ host.shared.down.weight.T.astype(np.float64))
    assert rel(residual - x, expected - x) < harness.tolerance * 2


@pytest.mark.parametrize("num_tokens", [5, 23, 80])
def test_an_expert_parallel_share_adds_only_the_experts_it_holds(harness, rng, num_tokens):
    """Experts 3..5 of the 8 routed (`HostMoe.first_expert` 3): a token's picks of the others add
    nothing; at decode sizes and past them (grouped GEMV and GEMM on CUDA)."""
    hidden, inner, routing = 64, 48, Routing(8, 2, renormalize=True)
    whole = _host_moe(rng, hidden, inner, routing, biases=True)
    held = range(3, 6)
    share = dataclasses.replace(
        whole, first_expert=held.start,
        gate_up=HostLinear(whole.gate_up.weight[held.start : held.stop], whole.gate_up.bias[held.start : held.stop]),
        down=HostLinear(whole.down.weight[held.start : held.stop], whole.down.bias[held.start : held.stop]),
    )
    x = bf16(rng.standard_normal((num_tokens, hidden)) * 2)
    normed, ids, weights, residual = _run(harness, share, x)
    picks = [e in held for e in ids.ravel()]
    assert any(picks) and not all(picks)
    expected = x.astype(np.float64).copy()
    for t in range(num_tokens):
        for e, w in zip(ids[t], weights[t], strict=True):
            if e in held:
                expected[t] += w * expert(normed[t], whole.gate_up.weight[e], whole.gate_up.bias[e],
                                          whole.down.weight[e], whole.down.bias[e], whole.activation)
    assert rel(residual - x, expected - x) < harness.tolerance * 2


@pytest.mark.parametrize("num_tokens", [3, 23, 70])  # CUDA: moe_down, moe_down_looped, moe_combine
@pytest.mark.parametrize("shared", [False, True])
def test_experts_without_accumulate_write_their_sum_in_place_of_the_rows(harness, rng, num_tokens, shared):
    """`accumulate=False` (a tensor-parallel rank that does not carry the residual): the rows
    become the held experts' sum, their old values unread (NaN here), bit for bit what the same
    call adds to rows of zeros."""
    hidden, inner, routing = 64, 48, Routing(8, 2, renormalize=True)
    whole = _host_moe(rng, hidden, inner, routing, biases=True, shared=shared)
    held = range(3, 6)
    share = dataclasses.replace(
        whole, first_expert=held.start,
        gate_up=HostLinear(whole.gate_up.weight[held.start : held.stop], whole.gate_up.bias[held.start : held.stop]),
        down=HostLinear(whole.down.weight[held.start : held.stop], whole.down.bias[held.start : held.stop]),
    )
    backend = harness.backend
    moe = prepared_or_skip(backend.moe.prepare, share)
    x = bf16(rng.standard_normal((num_tokens, hidden)) * 2)
    residual = backend.upload(x, harness.act)
    normed = harness.poisoned(x.shape)
    ids, weights = harness.poisoned((num_tokens, 2), DType.I32), harness.poisoned((num_tokens, 2), DType.F32)
    outputs = []
    for accumulate in (True, False):
        out = backend.upload(np.zeros_like(x), harness.act) if accumulate else harness.poisoned(x.shape)
        backend.moe.route(residual, moe, normed, ids, weights)  # experts follow their own route call
        backend.moe.experts(normed, moe, ids, weights, out, accumulate=accumulate)
        outputs.append(harness.host(out))
    added, written = outputs
    assert np.isfinite(written).all() and np.abs(added).max() > 0
    np.testing.assert_array_equal(written, added)


# -- against transformers ------------------------------------------------------------------------


def _randomise(module, rng, scale=0.1):
    import torch

    with torch.no_grad():
        for parameter in module.parameters():
            values = bf16(rng.standard_normal(tuple(parameter.shape)) * scale)
            parameter.copy_(torch.from_numpy(values))


def _against_block(harness, rng, block, host: HostMoe, hidden: int):
    """Our route + experts against the transformers block on the normed rows (bf16 values)."""
    import torch

    x = bf16(rng.standard_normal((19, hidden)) * 2)
    normed = rmsnorm(x, host.input_norm.weight, EPS).astype(np.float32)
    with torch.no_grad():
        output = block(torch.from_numpy(normed)[None])
    output = output[0] if isinstance(output, tuple) else output
    expected = x.astype(np.float64) + output[0].double().numpy()
    residual = _run(harness, host, x)[3]
    assert rel(residual - x, expected - x) < harness.tolerance * 5


def _t(tensor) -> np.ndarray:
    return tensor.detach().float().numpy()


def test_qwen3_moe_block_matches_transformers(harness, rng):
    pytest.importorskip("transformers")
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    hidden = 64
    config = Qwen3MoeConfig(hidden_size=hidden, moe_intermediate_size=32, num_experts=16, num_experts_per_tok=4,
                            norm_topk_prob=True, hidden_act="silu")
    block = Qwen3MoeSparseMoeBlock(config)
    _randomise(block, rng)
    host = HostMoe(
        input_norm=RmsNorm(bf16(1 + 0.2 * rng.standard_normal(hidden)), EPS),
        router=HostLinear(_t(block.gate.weight)),
        gate_up=HostLinear(_t(block.experts.gate_up_proj)),
        down=HostLinear(_t(block.experts.down_proj)),
        activation=Activation.SILU,
        routing=Routing(16, 4, Scoring.SOFTMAX, renormalize=True),
    )
    _against_block(harness, rng, block, host, hidden)


def test_gpt_oss_block_matches_transformers(harness, rng):
    """Router bias, softmax over the top-k logits, interleaved gate/up with biases, the clamped
    SwiGLU (alpha 1.702, limit 7)."""
    pytest.importorskip("transformers")
    from transformers import GptOssConfig
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssMLP

    hidden, inner = 64, 32
    config = GptOssConfig(hidden_size=hidden, intermediate_size=inner, num_local_experts=8, num_experts_per_tok=2,
                          num_attention_heads=4, num_key_value_heads=2, head_dim=16)
    block = GptOssMLP(config)
    _randomise(block, rng, scale=0.5)  # activations past the clamp limit
    gate_up = _t(block.experts.gate_up_proj)  # [E, H, 2I], gate and up interleaved
    gate_up_bias = _t(block.experts.gate_up_proj_bias)
    host = HostMoe(
        input_norm=RmsNorm(bf16(1 + 0.2 * rng.standard_normal(hidden)), EPS),
        router=HostLinear(_t(block.router.weight), _t(block.router.bias)),
        gate_up=HostLinear(
            np.concatenate([gate_up[:, :, 0::2], gate_up[:, :, 1::2]], axis=2).transpose(0, 2, 1),
            np.concatenate([gate_up_bias[:, 0::2], gate_up_bias[:, 1::2]], axis=1),
        ),
        down=HostLinear(_t(block.experts.down_proj).transpose(0, 2, 1), _t(block.experts.down_proj_bias)),
        activation=ClampedSwiglu(alpha=block.experts.alpha, limit=block.experts.limit),
        routing=Routing(8, 2, Scoring.SOFTMAX, renormalize=True),
    )
    _against_block(harness, rng, block, host, hidden)


def test_qwen3_next_block_with_its_gated_shared_expert_matches_transformers(harness, rng):
    pytest.importorskip("transformers")
    from transformers import Qwen3NextConfig
    from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextSparseMoeBlock

    hidden = 64
    config = Qwen3NextConfig(hidden_size=hidden, moe_intermediate_size=32, shared_expert_intermediate_size=48,
                             num_experts=16, num_experts_per_tok=4, norm_topk_prob=True, hidden_act="silu",
                             num_attention_heads=4, num_key_value_heads=2, head_dim=16)
    block = Qwen3NextSparseMoeBlock(config)
    _randomise(block, rng)
    shared = block.shared_expert
    host = HostMoe(
        input_norm=RmsNorm(bf16(1 + 0.2 * rng.standard_normal(hidden)), EPS),
        router=HostLinear(_t(block.gate.weight)),
        gate_up=HostLinear(_t(block.experts.gate_up_proj)),
        down=HostLinear(_t(block.experts.down_proj)),
        activation=Activation.SILU,
        routing=Routing(16, 4, Scoring.SOFTMAX, renormalize=True),
        shared=HostSharedExpert(
            HostLinear(np.concatenate([_t(shared.gate_proj.weight), _t(shared.up_proj.weight)])),
            HostLinear(_t(shared.down_proj.weight)),
            HostLinear(_t(block.shared_expert_gate.weight)),
        ),
    )
    _against_block(harness, rng, block, host, hidden)
