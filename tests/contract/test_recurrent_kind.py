"""The recurrent kind: state slots, the causal conv1d and the gated delta rule, against float64
references token by token and against transformers' Qwen3-Next Gated DeltaNet."""

from __future__ import annotations

import numpy as np
import pytest
from contract_harness import prepared_or_skip, require_kind
from kind_references import bf16, causal_conv, delta_rule, rel, rmsnorm, sigmoid
from tiny_models import ba_rows, qkvz_rows

from atlas.ports.gpu import DType, Kind
from atlas.ports.kernels.dense import HostProjection
from atlas.ports.kernels.host_weights import HostLinear, RmsNorm
from atlas.ports.kernels.recurrent import DeltaNetLayer, HostDeltaNet, RecurrentMetadata, RecurrentStateSpec

EPS = 1e-6


@pytest.fixture(autouse=True)
def _needs_the_kind(harness):
    require_kind(harness, Kind.RECURRENT)
LAYER = DeltaNetLayer(state_layer=1, num_key_heads=2, num_value_heads=4, key_head_dim=16, value_head_dim=8,
                      conv_kernel=4)


def _host(rng, layer: DeltaNetLayer) -> HostDeltaNet:
    return HostDeltaNet(
        conv_weight=bf16(rng.standard_normal((layer.conv_dim, layer.conv_kernel)) * 0.5),
        a_log=np.log(rng.uniform(1, 16, layer.num_value_heads)).astype(np.float32),
        dt_bias=bf16(rng.standard_normal(layer.num_value_heads) * 0.5),
        norm=RmsNorm(bf16(1 + 0.2 * rng.standard_normal(layer.value_head_dim)), EPS),
    )


def _state(harness, layer: DeltaNetLayer, slots: int = 8):
    spec = RecurrentStateSpec(2, slots, layer.conv_dim, layer.conv_kernel, layer.num_value_heads,
                              layer.key_head_dim, layer.value_head_dim)
    return harness.backend.recurrent.allocate_state(spec)


def _metadata(backend, query_lens, context_lens, slots, snapshots=None) -> RecurrentMetadata:
    return RecurrentMetadata(
        query_start_loc=backend.upload(np.concatenate([[0], np.cumsum(query_lens)]).astype(np.int32)),
        seq_lens=backend.upload(np.asarray(context_lens, np.int32)),
        state_slots=backend.upload(np.asarray(slots, np.int32)),
        num_tokens=int(sum(query_lens)),
        num_seqs=len(query_lens),
        max_query_len=max(query_lens),
        snapshot_slots=None if snapshots is None else backend.upload(np.asarray(snapshots, np.int32)),
    )


class Reference:
    """Float64 per-sequence conv and delta-rule state, advanced as the backend's should be."""

    def __init__(self, layer: DeltaNetLayer, host: HostDeltaNet) -> None:
        self.layer, self.host = layer, host
        self.conv: dict[int, np.ndarray] = {}
        self.state: dict[int, np.ndarray] = {}

    def step(self, projected: np.ndarray, query_lens, context_lens, slots) -> tuple[np.ndarray, np.ndarray]:
        layer, host = self.layer, self.host
        mixed = np.zeros((projected.shape[0], layer.conv_dim))
        out = np.zeros((projected.shape[0], layer.value_dim))
        start = 0
        heads, group = layer.num_value_heads, layer.num_value_heads // layer.num_key_heads
        for length, context, slot in zip(query_lens, context_lens, slots, strict=True):
            rows = slice(start, start + length)
            start += length
            fresh = context == length
            history = np.zeros((layer.conv_kernel - 1, layer.conv_dim)) if fresh else self.conv[slot]
            mixed[rows], self.conv[slot] = causal_conv(projected[rows, : layer.conv_dim], host.conv_weight, history)
            q = mixed[rows, : layer.key_dim].reshape(length, -1, layer.key_head_dim).repeat(group, axis=1)
            k = mixed[rows, layer.key_dim : 2 * layer.key_dim].reshape(length, -1, layer.key_head_dim).repeat(group, axis=1)
            v = mixed[rows, 2 * layer.key_dim :].reshape(length, heads, layer.value_head_dim)
            extra = projected[rows, layer.conv_dim :].astype(np.float64)
            z = extra[:, : layer.value_dim].reshape(length, heads, layer.value_head_dim)
            beta = sigmoid(extra[:, layer.value_dim : layer.value_dim + heads])
            a = extra[:, layer.value_dim + heads :]
            decay = -np.exp(host.a_log.astype(np.float64)) * np.log1p(np.exp(a + host.dt_bias))
            q = q / np.sqrt((q * q).sum(-1, keepdims=True) + 1e-6) * layer.key_head_dim**-0.5
            k = k / np.sqrt((k * k).sum(-1, keepdims=True) + 1e-6)
            state = np.zeros((heads, layer.key_head_dim, layer.value_head_dim)) if fresh else self.state[slot]
            core, self.state[slot] = delta_rule(q, k, v, beta, decay, state)
            gated = rmsnorm(core, host.norm.weight, EPS) * z * sigmoid(z)
            out[rows] = gated.reshape(length, layer.value_dim)
        return mixed, out


def _run_step(harness, layer, state, projected, query_lens, context_lens, slots, snapshots=None):
    backend = harness.backend
    meta = _metadata(backend, query_lens, context_lens, slots, snapshots)
    projected_tensor = backend.upload(projected, harness.act)
    mixed = harness.poisoned((projected.shape[0], LAYER.conv_dim))
    out = harness.poisoned((projected.shape[0], LAYER.value_dim))
    backend.recurrent.causal_conv1d(projected_tensor, layer, meta, state, mixed)
    backend.recurrent.gated_delta_rule(mixed, projected_tensor, layer, meta, state, out)
    return harness.host(mixed), harness.host(out)


def test_a_mixed_step_then_continuations_match_the_token_by_token_reference(harness, rng):
    """Fresh prompts (one longer than a chunk), decodes and continued chunks in one batch, then
    again from the slots each left: the states carry between steps, each in its own slot."""
    backend = harness.backend
    host = _host(rng, LAYER)
    layer = prepared_or_skip(backend.recurrent.prepare, host, LAYER)
    state = _state(harness, LAYER)
    reference = Reference(LAYER, host)
    context = {}
    steps = [
        ([70, 1, 5, 3], [5, 2, 7, 0]),  # (tokens per sequence, slot) of each sequence, all fresh
        ([1, 1, 20, 1], [5, 2, 7, 0]),  # continue: decodes and a chunk
        ([1, 9, 1, 66], [0, 2, 7, 5]),  # continue, another order of slots
    ]
    for query_lens, slots in steps:
        contexts = [context.get(slot, 0) + length for length, slot in zip(query_lens, slots, strict=True)]
        context.update(zip(slots, contexts, strict=True))
        projected = bf16(rng.standard_normal((sum(query_lens), LAYER.projected_width)))
        mixed, out = _run_step(harness, layer, state, projected, query_lens, contexts, slots)
        expected_mixed, expected_out = reference.step(projected, query_lens, contexts, slots)
        assert rel(mixed, expected_mixed) < harness.tolerance
        assert rel(out, expected_out) < harness.tolerance * 10


def test_a_prompt_in_chunks_equals_the_prompt_at_once(harness, rng):
    """The state a chunk leaves is what the next chunk starts from: 100 tokens in chunks of 37,
    1, 62 give the outputs of the 100 in one step (to float32 rounding)."""
    backend = harness.backend
    host = _host(rng, LAYER)
    layer = prepared_or_skip(backend.recurrent.prepare, host, LAYER)
    projected = bf16(rng.standard_normal((100, LAYER.projected_width)))
    whole = _run_step(harness, layer, _state(harness, LAYER), projected, [100], [100], [3])[1]
    state, parts, done = _state(harness, LAYER), [], 0
    for length in (37, 1, 62):
        parts.append(_run_step(harness, layer, state, projected[done : done + length], [length], [done + length], [3])[1])
        done += length
    assert rel(np.concatenate(parts), whole) < harness.tolerance * 10


def test_a_verify_chunk_leaves_the_state_after_each_inner_token_in_its_snapshot_slots(harness, rng):
    """Two sequences after a prompt each verify a chunk of 4 tokens (the last token and 3
    drafts), naming 3 snapshot slots (one sequence a -1: that state is not wanted). Each
    snapshot then serves as a slot: continuing from it gives what continuing after the chunk's
    first j + 1 tokens gives, and the sequences' own slots hold the state after all 4."""
    import copy

    if not harness.backend.capabilities.state_snapshots:
        pytest.skip(f"the {harness.name} backend writes no state snapshots (Capabilities.state_snapshots)")
    backend = harness.backend
    host = _host(rng, LAYER)
    layer = prepared_or_skip(backend.recurrent.prepare, host, LAYER)
    state = _state(harness, LAYER, slots=12)
    prompt_lens, slots = [9, 70], [4, 1]
    prompt = bf16(rng.standard_normal((sum(prompt_lens), LAYER.projected_width)))
    reference = Reference(LAYER, host)
    _run_step(harness, layer, state, prompt, prompt_lens, prompt_lens, slots)
    reference.step(prompt, prompt_lens, prompt_lens, slots)

    chunk = bf16(rng.standard_normal((8, LAYER.projected_width)))
    snapshots = [[7, 0, 10], [3, -1, 11]]
    contexts = [length + 4 for length in prompt_lens]
    mixed, out = _run_step(harness, layer, state, chunk, [4, 4], contexts, slots, snapshots)
    whole = copy.deepcopy(reference)
    expected_mixed, expected_out = whole.step(chunk, [4, 4], contexts, slots)
    assert rel(mixed, expected_mixed) < harness.tolerance
    assert rel(out, expected_out) < harness.tolerance * 10

    after = bf16(rng.standard_normal((4, LAYER.projected_width)))  # two more tokens, from one slot
    for seq, (length, slot) in enumerate(zip(prompt_lens, slots, strict=True)):
        rows = chunk[4 * seq : 4 * seq + 4]
        for token, snapshot in [*enumerate(snapshots[seq][:3]), (3, slot)]:
            if snapshot < 0:
                continue
            partial = copy.deepcopy(reference)
            partial.step(rows[: token + 1], [token + 1], [length + token + 1], [slot])
            expected = partial.step(after[2 * seq : 2 * seq + 2], [2], [length + token + 3], [slot])[1]
            got = _run_step(harness, layer, state, after[2 * seq : 2 * seq + 2], [2], [length + token + 3],
                            [snapshot])[1]
            assert rel(got, expected) < harness.tolerance * 10, (seq, token)


def test_gated_deltanet_mixer_matches_transformers(harness, rng):
    """in_proj (rows reordered into `DeltaNetLayer`'s layout), conv, rule, gated norm, out_proj on
    a prompt against transformers' Qwen3NextGatedDeltaNet."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from transformers import Qwen3NextConfig
    from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextGatedDeltaNet

    hidden, layer_shape = 64, DeltaNetLayer(0, 2, 4, 16, 8, 4)
    config = Qwen3NextConfig(hidden_size=hidden, linear_num_value_heads=4, linear_num_key_heads=2,
                             linear_key_head_dim=16, linear_value_head_dim=8, linear_conv_kernel_dim=4,
                             num_attention_heads=4, num_key_value_heads=2, head_dim=16, rms_norm_eps=EPS)
    module = Qwen3NextGatedDeltaNet(config, 0)
    with torch.no_grad():
        for parameter in module.parameters():
            parameter.copy_(torch.from_numpy(bf16(rng.standard_normal(tuple(parameter.shape)) * 0.2)))
        module.A_log.copy_(torch.from_numpy(np.log(rng.uniform(1, 16, 4)).astype(np.float32)))
    backend = harness.backend
    qkvz, ba = module.in_proj_qkvz.weight.detach().numpy(), module.in_proj_ba.weight.detach().numpy()
    in_proj = np.concatenate([qkvz[qkvz_rows(layer_shape)], ba[ba_rows(layer_shape)]])
    norm = RmsNorm(bf16(1 + 0.2 * rng.standard_normal(hidden)), EPS)
    projection = prepared_or_skip(backend.dense.prepare, HostProjection(HostLinear(in_proj), input_norm=norm))
    out_proj = prepared_or_skip(backend.dense.prepare, HostProjection(HostLinear(module.out_proj.weight.detach().numpy())))
    host = HostDeltaNet(module.conv1d.weight.detach().numpy()[:, 0], module.A_log.detach().numpy(),
                        module.dt_bias.detach().numpy(), RmsNorm(module.norm.weight.detach().numpy(), EPS))
    layer = prepared_or_skip(backend.recurrent.prepare, host, layer_shape)
    x = bf16(rng.standard_normal((90, hidden)))
    with torch.no_grad():
        expected = module(torch.from_numpy(rmsnorm(x, norm.weight, EPS).astype(np.float32))[None])[0].double().numpy()

    meta = _metadata(backend, [90], [90], [0])
    state = harness.backend.recurrent.allocate_state(RecurrentStateSpec(1, 1, layer_shape.conv_dim, 4, 4, 16, 8))
    residual = backend.upload(x, harness.act)
    projected = harness.poisoned((90, layer_shape.projected_width))
    mixed, out = harness.poisoned((90, layer_shape.conv_dim)), harness.poisoned((90, layer_shape.value_dim))
    backend.dense.project(residual, projection, projected)
    backend.recurrent.causal_conv1d(projected, layer, meta, state, mixed)
    backend.recurrent.gated_delta_rule(mixed, projected, layer, meta, state, out)
    backend.dense.project_add(out, out_proj, residual)
    assert rel(harness.host(residual) - x, expected) < harness.tolerance * 10


def test_a_state_too_large_says_how_many_slots_fit(harness):
    _, total = harness.backend.memory_info()
    spec = RecurrentStateSpec(48, 1, 8192, 4, 32, 128, 128, DType.F32)
    with pytest.raises(MemoryError, match="slots|fit"):
        harness.backend.recurrent.allocate_state(
            RecurrentStateSpec(48, 2 * total // spec.bytes_per_slot + 1, 8192, 4, 32, 128, 128, DType.F32)
        )
