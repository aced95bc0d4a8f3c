"""The layer kinds and the generic loop hold a hybrid model: a tiny random Qwen3-Next (Gated
DeltaNet and gated attention mixers; MoE with a gated shared expert and a dense GLU
feed-forward) built from transformers' weights by a test-local mapping, as a family loader
would, matches transformers' logits over a prompt and the decode steps after it (the recurrent
state carried in its slot, K/V in pages)."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from tiny_models import ba_rows, qkvz_rows  # noqa: E402

from atlas.adapters.mock.backend import MockGpuBackend  # noqa: E402
from atlas.domain.models.cache_groups import KvShape, StateShape, group_caches, locate  # noqa: E402
from atlas.domain.models.feed_forward import DenseFeedForward, MoeFeedForward  # noqa: E402
from atlas.domain.models.layers import Layer  # noqa: E402
from atlas.domain.models.mixers import AttentionMixer, DeltaNetMixer  # noqa: E402
from atlas.domain.models.model import Model, StepTensors  # noqa: E402
from atlas.ports.gpu import DType, Kind  # noqa: E402
from atlas.ports.kernels.attention import AttentionLayer, AttentionMetadata, HeadLayout, HostAttention, KvCacheSpec  # noqa: E402
from atlas.ports.kernels.dense import HostProjection, HostVocab  # noqa: E402
from atlas.ports.kernels.host_weights import Activation, HostLinear, RmsNorm  # noqa: E402
from atlas.ports.kernels.moe import HostMoe, HostSharedExpert, Routing, Scoring  # noqa: E402
from atlas.ports.kernels.recurrent import DeltaNetLayer, HostDeltaNet, RecurrentMetadata, RecurrentStateSpec  # noqa: E402

pytestmark = pytest.mark.oracle
BLOCK_SIZE = 4


def _reference(seed: int = 0):
    from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

    torch.manual_seed(seed)
    config = Qwen3NextConfig(
        vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, linear_num_value_heads=4, linear_num_key_heads=2,
        linear_key_head_dim=16, linear_value_head_dim=16, linear_conv_kernel_dim=4, num_experts=8,
        num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=48, norm_topk_prob=True,
        mlp_only_layers=[2], max_position_embeddings=256, rms_norm_eps=1e-6, tie_word_embeddings=False,
    )  # fmt: skip
    model = Qwen3NextForCausalLM(config).eval()
    with torch.no_grad():
        for parameter in model.parameters():  # bf16 values: what the mock stores is what it reads
            parameter.copy_((torch.randn_like(parameter) * 0.1).bfloat16().float())
        for layer in model.model.layers:
            if hasattr(layer, "linear_attn"):
                layer.linear_attn.A_log.copy_(torch.log(torch.empty(4).uniform_(1, 16)))
    return model


def _load(reference, backend) -> Model:
    """What a Qwen3-Next loader does: map the weights onto the layer kinds (1 + w norms as plain
    multipliers, in_proj and q_proj rows into the kinds' layouts) and declare the cache groups."""
    config = reference.config
    weights = {name: value.detach().float().numpy() for name, value in reference.state_dict().items()}
    hidden, eps, head_dim = config.hidden_size, config.rms_norm_eps, config.head_dim
    heads = HeadLayout(config.num_attention_heads, config.num_key_value_heads, head_dim)
    linear = DeltaNetLayer(0, config.linear_num_key_heads, config.linear_num_value_heads, config.linear_key_head_dim,
                           config.linear_value_head_dim, config.linear_conv_kernel_dim)

    def plus_one(name: str) -> RmsNorm:
        return RmsNorm(1 + weights[name], eps)

    shapes = [
        KvShape(heads.num_kv_heads, head_dim) if kind == "full_attention" else
        StateShape(linear.conv_dim, linear.conv_kernel, linear.num_value_heads, linear.key_head_dim,
                   linear.value_head_dim)
        for kind in config.layer_types
    ]  # fmt: skip
    groups = group_caches(shapes)
    rotary = int(head_dim * config.rope_parameters["partial_rotary_factor"])
    inverse = config.rope_parameters["rope_theta"] ** (-np.arange(0, rotary, 2, dtype=np.float64) / rotary)
    angles = np.arange(256)[:, None] * inverse[None, :]
    table = backend.upload(np.concatenate([np.cos(angles), np.sin(angles)], axis=1).astype(np.float32), DType.F32)
    dense = backend.dense
    layers = []
    for index, kind in enumerate(config.layer_types):
        prefix = f"model.layers.{index}."
        group, position = locate(groups, index)
        norm = plus_one(prefix + "input_layernorm.weight")
        if kind == "linear_attention":
            spec = DeltaNetLayer(position, *[getattr(linear, f) for f in (
                "num_key_heads", "num_value_heads", "key_head_dim", "value_head_dim", "conv_kernel")])
            p = prefix + "linear_attn."
            in_proj = np.concatenate([weights[p + "in_proj_qkvz.weight"][qkvz_rows(spec)],
                                      weights[p + "in_proj_ba.weight"][ba_rows(spec)]])
            host = HostDeltaNet(weights[p + "conv1d.weight"][:, 0], weights[p + "A_log"], weights[p + "dt_bias"],
                                RmsNorm(weights[p + "norm.weight"], eps))
            mixer = DeltaNetMixer(spec, group, dense.prepare(HostProjection(HostLinear(in_proj), norm)),
                                  backend.recurrent.prepare(host, spec),
                                  dense.prepare(HostProjection(HostLinear(weights[p + "out_proj.weight"]))), hidden)
        else:
            p = prefix + "self_attn."
            q_and_gate = weights[p + "q_proj.weight"].reshape(heads.num_q_heads, 2 * head_dim, hidden)
            qkv = np.concatenate([q_and_gate[:, :head_dim].reshape(-1, hidden), q_and_gate[:, head_dim:].reshape(-1, hidden),
                                  weights[p + "k_proj.weight"], weights[p + "v_proj.weight"]])
            spec = AttentionLayer(heads, position, head_dim**-0.5, table, gated_output=True)
            host = HostAttention(norm, HostLinear(qkv), plus_one(p + "q_norm.weight"), plus_one(p + "k_norm.weight"))
            mixer = AttentionMixer(spec, group, backend.attention.prepare(host, spec),
                                   dense.prepare(HostProjection(HostLinear(weights[p + "o_proj.weight"]))), hidden)
        post_norm, p = plus_one(prefix + "post_attention_layernorm.weight"), prefix + "mlp."
        if index in config.mlp_only_layers:
            gate_up = np.concatenate([weights[p + "gate_proj.weight"], weights[p + "up_proj.weight"]])
            feed_forward = DenseFeedForward(
                dense.prepare(HostProjection(HostLinear(gate_up), post_norm, Activation.SILU)),
                dense.prepare(HostProjection(HostLinear(weights[p + "down_proj.weight"]))), config.intermediate_size, hidden,
            )
        else:
            shared = HostSharedExpert(
                HostLinear(np.concatenate([weights[p + "shared_expert.gate_proj.weight"],
                                           weights[p + "shared_expert.up_proj.weight"]])),
                HostLinear(weights[p + "shared_expert.down_proj.weight"]),
                HostLinear(weights[p + "shared_expert_gate.weight"]),
            )
            routing = Routing(config.num_experts, config.num_experts_per_tok, Scoring.SOFTMAX, renormalize=True)
            host = HostMoe(post_norm, HostLinear(weights[p + "gate.weight"]),
                           HostLinear(weights[p + "experts.gate_up_proj"]), HostLinear(weights[p + "experts.down_proj"]),
                           Activation.SILU, routing, shared=shared)
            feed_forward = MoeFeedForward(backend.moe.prepare(host), routing.top_k, hidden,
                                          config.shared_expert_intermediate_size)
        layers.append(Layer(mixer, feed_forward))
    vocab = dense.prepare_vocab(HostVocab(weights["model.embed_tokens.weight"], plus_one("model.norm.weight"),
                                          HostLinear(weights["lm_head.weight"])))
    return Model(backend, vocab, layers, groups, hidden, config.vocab_size)


def _step(backend, tokens, start: int) -> StepTensors:
    """One sequence's tokens at positions start.., its pages 0, 1, 2, ... and state slot 1."""
    count, context = len(tokens), start + len(tokens)
    positions = np.arange(start, context, dtype=np.int32)
    tables = np.arange(64 // BLOCK_SIZE, dtype=np.int32)[None, :]
    query_start, seq_lens = np.array([0, count], np.int32), np.array([context], np.int32)
    meta = AttentionMetadata(
        backend.upload(positions), backend.upload(positions), backend.upload(query_start), backend.upload(seq_lens),
        backend.upload(tables), count, 1, count, context,
    )  # block i holds positions 4i..4i+3: a token's slot is its position
    recurrent = RecurrentMetadata(backend.upload(query_start), backend.upload(seq_lens),
                                  backend.upload(np.array([1], np.int32)), count, 1, count)
    return StepTensors(backend.upload(np.asarray(tokens, np.int32)), (recurrent, meta), None)


def test_a_hybrid_qwen3_next_matches_transformers_over_a_prompt_and_decodes(rng):
    reference = _reference()
    tokens = [int(t) for t in rng.integers(0, 128, size=23)]
    with torch.no_grad():
        expected = reference(torch.tensor([tokens])).logits[0].numpy()
    backend = MockGpuBackend()
    model = _load(reference, backend)
    assert model.kinds == {Kind.DENSE, Kind.ATTENTION, Kind.RECURRENT, Kind.MOE}
    assert [type(g.shape) for g in model.cache_groups] == [StateShape, KvShape]
    assert [g.layers for g in model.cache_groups] == [(0, 1, 2), (3,)]
    state_group, kv_group = model.cache_groups
    kv = backend.attention.allocate_cache(
        KvCacheSpec(len(kv_group.layers), 64 // BLOCK_SIZE, BLOCK_SIZE, 2, 32, DType.F32))
    shape = state_group.shape
    state = backend.recurrent.allocate_state(RecurrentStateSpec(
        len(state_group.layers), 2, shape.conv_dim, shape.conv_kernel, shape.num_heads, shape.key_dim,
        shape.value_dim))
    workspace = model.allocate_workspace(32, 32)
    got = [backend.download(model.forward(_step(backend, tokens[:20], 0), (state, kv), workspace, 20))]
    for position in range(20, 23):  # decodes: one token from the state and pages the prompt left
        step = _step(backend, tokens[position : position + 1], position)
        got.append(backend.download(model.forward(step, (state, kv), workspace, 1)))
    logits = np.concatenate(got)
    relative = np.linalg.norm(logits - expected) / np.linalg.norm(expected)
    assert relative < 1e-4
    assert (logits.argmax(axis=1) == expected.argmax(axis=1)).all()
