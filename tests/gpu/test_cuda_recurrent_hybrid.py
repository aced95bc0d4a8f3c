"""A hybrid Qwen3-Next on the CUDA kinds against transformers, within transformers' own bf16
error: Qwen3-Next's layer widths (linear heads of 128, gated attention heads of 256 with a
quarter rotated, MoE with a gated shared expert), fewer experts and 4 layers, built from
transformers' weights by the same mapping a loader does (tests/unit/test_layer_kinds.py) and run
over a prompt and the decodes after it (the recurrent state in its slot, K/V in pages)."""

from __future__ import annotations

import copy

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from tiny_models import ba_rows, qkvz_rows  # noqa: E402

from atlas.domain.models.cache_groups import KvShape, StateShape, group_caches, locate  # noqa: E402
from atlas.domain.models.feed_forward import MoeFeedForward  # noqa: E402
from atlas.domain.models.layers import Layer  # noqa: E402
from atlas.domain.models.mixers import AttentionMixer, DeltaNetMixer  # noqa: E402
from atlas.domain.models.model import Model, StepTensors  # noqa: E402
from atlas.ports.gpu import DType  # noqa: E402
from atlas.ports.kernels.attention import AttentionLayer, AttentionMetadata, HeadLayout, HostAttention, KvCacheSpec  # noqa: E402
from atlas.ports.kernels.dense import HostProjection, HostVocab  # noqa: E402
from atlas.ports.kernels.host_weights import Activation, HostLinear, RmsNorm  # noqa: E402
from atlas.ports.kernels.moe import HostMoe, HostSharedExpert, Routing, Scoring  # noqa: E402
from atlas.ports.kernels.recurrent import DeltaNetLayer, HostDeltaNet, RecurrentMetadata, RecurrentStateSpec  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.oracle]
BLOCK_SIZE = 16
_DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _reference(seed: int = 0):
    from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

    torch.manual_seed(seed)
    config = Qwen3NextConfig(
        vocab_size=1024, hidden_size=512, intermediate_size=512, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=1, head_dim=256, partial_rotary_factor=0.25, linear_num_value_heads=8,
        linear_num_key_heads=4, linear_key_head_dim=128, linear_value_head_dim=128, linear_conv_kernel_dim=4,
        num_experts=32, num_experts_per_tok=4, moe_intermediate_size=128, shared_expert_intermediate_size=256,
        norm_topk_prob=True, max_position_embeddings=1024, rms_norm_eps=1e-6, tie_word_embeddings=False,
    )  # fmt: skip
    model = Qwen3NextForCausalLM(config).eval()
    with torch.no_grad():
        for parameter in model.parameters():  # bf16 values: both sides read the same weights
            parameter.copy_((torch.randn_like(parameter) * 0.05).bfloat16().float())
        for layer in model.model.layers:
            if hasattr(layer, "linear_attn"):
                layer.linear_attn.A_log.copy_(torch.log(torch.empty(8).uniform_(1, 16)))
    return model


def _load(reference, backend) -> Model:
    """A Qwen3-Next loader's mapping (as tests/unit/test_layer_kinds.py's)."""
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
    angles = np.arange(1024)[:, None] * inverse[None, :]
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
        shared = HostSharedExpert(
            HostLinear(np.concatenate([weights[p + "shared_expert.gate_proj.weight"],
                                       weights[p + "shared_expert.up_proj.weight"]])),
            HostLinear(weights[p + "shared_expert.down_proj.weight"]),
            HostLinear(weights[p + "shared_expert_gate.weight"]),
        )
        routing = Routing(config.num_experts, config.num_experts_per_tok, Scoring.SOFTMAX, renormalize=True)
        host = HostMoe(post_norm, HostLinear(weights[p + "gate.weight"]), HostLinear(weights[p + "experts.gate_up_proj"]),
                       HostLinear(weights[p + "experts.down_proj"]), Activation.SILU, routing, shared=shared)
        feed_forward = MoeFeedForward(backend.moe.prepare(host), routing.top_k, hidden,
                                      max(config.moe_intermediate_size, config.shared_expert_intermediate_size))
        layers.append(Layer(mixer, feed_forward))
    vocab = dense.prepare_vocab(HostVocab(weights["model.embed_tokens.weight"], plus_one("model.norm.weight"),
                                          HostLinear(weights["lm_head.weight"])))
    return Model(backend, vocab, layers, groups, hidden, config.vocab_size)


def _step(backend, tokens, start: int) -> StepTensors:
    """One sequence's tokens at positions start.., its pages 0, 1, 2, ... and state slot 1."""
    count, context = len(tokens), start + len(tokens)
    positions = np.arange(start, context, dtype=np.int32)
    tables = np.arange(256 // BLOCK_SIZE, dtype=np.int32)[None, :]
    query_start, seq_lens = np.array([0, count], np.int32), np.array([context], np.int32)
    meta = AttentionMetadata(
        backend.upload(positions), backend.upload(positions), backend.upload(query_start), backend.upload(seq_lens),
        backend.upload(tables), count, 1, count, context,
    )  # block i holds positions 16i..16i+15: a token's slot is its position
    recurrent = RecurrentMetadata(backend.upload(query_start), backend.upload(seq_lens),
                                  backend.upload(np.array([1], np.int32)), count, 1, count)
    return StepTensors(backend.upload(np.asarray(tokens, np.int32)), meta, None, recurrent)


def _hf_logits(model, tokens, dtype) -> np.ndarray:
    copied = copy.deepcopy(model)
    if dtype is not torch.float32:
        for parameter in copied.parameters():
            parameter.data = parameter.data.to(dtype)
    copied = copied.to(_DEVICE)
    with torch.no_grad():
        return copied(torch.tensor([tokens], device=_DEVICE)).logits[0].float().cpu().numpy()


def _relative(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def test_a_hybrid_qwen3_next_on_cuda_is_within_transformers_bf16_error(cuda_backend, rng):
    reference = _reference()
    tokens = [int(t) for t in rng.integers(0, 1024, size=100)]
    exact, hf_bf16 = _hf_logits(reference, tokens, torch.float32), _hf_logits(reference, tokens, torch.bfloat16)
    backend = cuda_backend
    model = _load(reference, backend)
    state_group, kv_group = model.cache_groups
    kv = backend.attention.allocate_cache(KvCacheSpec(len(kv_group.layers), 256 // BLOCK_SIZE, BLOCK_SIZE, 1, 256,
                                                      DType.BF16))
    shape = state_group.shape
    state = backend.recurrent.allocate_state(RecurrentStateSpec(
        len(state_group.layers), 2, shape.conv_dim, shape.conv_kernel, shape.num_heads, shape.key_dim,
        shape.value_dim))
    workspace = model.allocate_workspace(128, 128)
    prompt = 96  # a prompt (chunks of GDN staging, an MoE past the grouped GEMV), then decodes
    got = [backend.download(model.forward(_step(backend, tokens[:prompt], 0), (state, kv), workspace, prompt))]
    for position in range(prompt, len(tokens)):
        step = _step(backend, tokens[position : position + 1], position)
        got.append(backend.download(model.forward(step, (state, kv), workspace, 1)))
    logits = np.concatenate(got).astype(np.float64)
    for rows, label in ((slice(0, prompt), "prompt"), (slice(prompt, None), "decodes")):
        ours, theirs = _relative(logits[rows], exact[rows]), _relative(hf_bf16[rows], exact[rows])
        print(f"qwen3-next hybrid {label}: atlas {ours:.2e} transformers-bf16 {theirs:.2e}")
        assert ours <= 1.5 * theirs, (label, ours, theirs)
