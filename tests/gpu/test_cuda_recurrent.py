"""The CUDA recurrent kind at Qwen3-Next's Gated DeltaNet shape against the mock: prompts longer
than a staging round, decodes and continuations in one step, states carried in their slots over
steps; a decode step captured in a graph replays as eager runs compute it."""

from __future__ import annotations

import numpy as np
import pytest
from cuda_harness import bf16, host, poisoned, rel_l2

from atlas.adapters.mock.backend import MockGpuBackend
from atlas.ports.gpu import DType
from atlas.ports.kernels.host_weights import RmsNorm
from atlas.ports.kernels.recurrent import DeltaNetLayer, HostDeltaNet, RecurrentMetadata, RecurrentStateSpec

pytestmark = pytest.mark.gpu

QWEN3_NEXT = DeltaNetLayer(state_layer=1, num_key_heads=16, num_value_heads=32, key_head_dim=128, value_head_dim=128,
                           conv_kernel=4)
ODD = DeltaNetLayer(state_layer=0, num_key_heads=2, num_value_heads=6, key_head_dim=40, value_head_dim=48,
                    conv_kernel=3)


def _host(rng, layer):
    return HostDeltaNet(
        conv_weight=bf16(rng.standard_normal((layer.conv_dim, layer.conv_kernel)) * 0.5),
        a_log=np.log(rng.uniform(1, 16, layer.num_value_heads)).astype(np.float32),
        dt_bias=bf16(rng.standard_normal(layer.num_value_heads) * 0.5),
        norm=RmsNorm(bf16(1 + 0.2 * rng.standard_normal(layer.value_head_dim)), 1e-6),
    )


def _meta(backend, query_lens, context_lens, slots):
    return RecurrentMetadata(
        query_start_loc=backend.upload(np.concatenate([[0], np.cumsum(query_lens)]).astype(np.int32)),
        seq_lens=backend.upload(np.asarray(context_lens, np.int32)),
        state_slots=backend.upload(np.asarray(slots, np.int32)),
        num_tokens=int(sum(query_lens)), num_seqs=len(query_lens), max_query_len=max(query_lens),
    )


def _spec(layer, slots=6):
    return RecurrentStateSpec(2, slots, layer.conv_dim, layer.conv_kernel, layer.num_value_heads, layer.key_head_dim,
                              layer.value_head_dim)


def _step(backend, act, layer, prepared, state, projected, query_lens, context_lens, slots):
    meta = _meta(backend, query_lens, context_lens, slots)
    tokens = projected.shape[0]
    source = backend.upload(projected, act)
    if act is DType.BF16:
        mixed, out = poisoned(backend, (tokens, layer.conv_dim), act), poisoned(backend, (tokens, layer.value_dim), act)
    else:
        mixed = backend.upload(np.full((tokens, layer.conv_dim), np.nan, np.float32), act)
        out = backend.upload(np.full((tokens, layer.value_dim), np.nan, np.float32), act)
    backend.recurrent.causal_conv1d(source, prepared, meta, state, mixed)
    backend.recurrent.gated_delta_rule(mixed, source, prepared, meta, state, out)
    return (np.asarray(backend.begin_download(mixed).wait(), np.float64),
            np.asarray(backend.begin_download(out).wait(), np.float64))


@pytest.mark.parametrize("layer", [QWEN3_NEXT, ODD], ids=["qwen3_next", "odd"])
def test_steps_of_prompts_decodes_and_continuations_match_the_mock(cuda_backend, rng, layer):
    host_layer = _host(rng, layer)
    mock = MockGpuBackend(activation_dtype=DType.F32)
    backends = [(cuda_backend, DType.BF16), (mock, DType.F32)]
    prepared = [b.recurrent.prepare(host_layer, layer) for b, _ in backends]
    states = [b.recurrent.allocate_state(_spec(layer)) for b, _ in backends]
    context = {}
    for query_lens, slots in (([150, 1, 7], [4, 0, 2]), ([1, 40, 1], [4, 0, 2]), ([1, 1, 1], [2, 4, 0])):
        contexts = [context.get(s, 0) + q for q, s in zip(query_lens, slots, strict=True)]
        context.update(zip(slots, contexts, strict=True))
        projected = bf16(rng.standard_normal((sum(query_lens), layer.projected_width)))
        (mixed, out), (m_mixed, m_out) = (
            _step(b, act, layer, p, s, projected, query_lens, contexts, slots)
            for (b, act), p, s in zip(backends, prepared, states, strict=True)
        )
        assert rel_l2(mixed, m_mixed) < 1e-2
        assert rel_l2(out, m_out) < 2e-2


def test_a_decode_step_replays_from_a_graph(cuda_backend, rng):
    """Two slot sets with the same history: the captured step replayed on one gives the bits an
    eager step gives on the other, twice (the replay reads and advances its slots)."""
    backend, layer = cuda_backend, QWEN3_NEXT
    prepared = backend.recurrent.prepare(_host(rng, layer), layer)
    states = [backend.recurrent.allocate_state(_spec(layer)) for _ in range(2)]
    prompt = bf16(rng.standard_normal((40, layer.projected_width)))
    for state in states:
        _step(backend, DType.BF16, layer, prepared, state, prompt, [20, 20], [20, 20], [1, 3])
    source = backend.upload(bf16(rng.standard_normal((2, layer.projected_width))), DType.BF16)
    mixed, out = backend.empty((2, layer.conv_dim), DType.BF16), backend.empty((2, layer.value_dim), DType.BF16)

    def step(state, meta):
        backend.recurrent.causal_conv1d(source, prepared, meta, state, mixed)
        backend.recurrent.gated_delta_rule(mixed, source, prepared, meta, state, out)

    metas = [_meta(backend, [1, 1], [21 + i, 21 + i], [1, 3]) for i in range(2)]
    captured_meta = _meta(backend, [1, 1], [21, 21], [1, 3])
    graph = backend.capture(lambda: step(states[0], captured_meta))
    for i in range(2):
        backend.copy_from_host(captured_meta.seq_lens, np.asarray([21 + i, 21 + i], np.int32))
        graph.replay()
        replayed = host(backend, out)
        step(states[1], metas[i])
        np.testing.assert_array_equal(replayed, host(backend, out))
        assert np.isfinite(replayed).all()
