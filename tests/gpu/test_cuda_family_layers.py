"""Gemma 3 and GPT-OSS on the CUDA kinds against transformers, within transformers' own bf16
error. Each is built from a small random transformers model by the mapping its loader does
(norms, sandwich norms and (1 + w) weights, GeGLU, the embedding scale, soft-capped logits, per-type RoPE
and sliding windows; GPT-OSS's sinks, biases, YaRN and its MoE with the clamped SwiGLU) over
head dims of the real models (256 and 64), and run over a prompt and the decodes after it."""

from __future__ import annotations

import copy

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from atlas.domain.models.cache_groups import KvShape, group_caches  # noqa: E402
from atlas.domain.models.feed_forward import DenseFeedForward, MoeFeedForward  # noqa: E402
from atlas.domain.models.layers import Layer  # noqa: E402
from atlas.domain.models.mixers import AttentionMixer  # noqa: E402
from atlas.domain.models.model import Model, StepTensors  # noqa: E402
from atlas.ports.gpu import DType  # noqa: E402
from atlas.ports.kernels.attention import AttentionLayer, AttentionMetadata, HeadLayout, HostAttention, KvCacheSpec  # noqa: E402
from atlas.ports.kernels.dense import HostProjection, HostVocab  # noqa: E402
from atlas.ports.kernels.host_weights import Activation, ClampedSwiglu, HostLinear, RmsNorm  # noqa: E402
from atlas.ports.kernels.moe import HostMoe, Routing, Scoring  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.oracle]
BLOCK_SIZE = 16
MAX_POSITIONS = 256
_DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _randomise(model, scale: float) -> None:
    with torch.no_grad():
        for name, parameter in model.named_parameters():  # bf16 values: both sides read the same
            values = torch.randn_like(parameter) * (0.5 if name.endswith("sinks") else scale)
            parameter.copy_(values.bfloat16().float())


def gemma3():
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    torch.manual_seed(0)
    config = Gemma3TextConfig(
        vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=256, query_pre_attn_scalar=256, sliding_window=32,
        layer_types=["sliding_attention", "sliding_attention", "sliding_attention", "full_attention"],
        final_logit_softcapping=30.0, hidden_activation="gelu_pytorch_tanh",
        max_position_embeddings=MAX_POSITIONS, rms_norm_eps=1e-6, tie_word_embeddings=True,
    )  # fmt: skip
    model = Gemma3ForCausalLM(config).eval()  # (Gemma 3's attention has no soft-cap; its logits do)
    _randomise(model, 0.05)
    return model


def gpt_oss():
    from transformers import GptOssConfig, GptOssForCausalLM

    torch.manual_seed(0)
    config = GptOssConfig(
        vocab_size=512, hidden_size=256, intermediate_size=256, num_hidden_layers=4, num_attention_heads=8,
        num_key_value_heads=2, head_dim=64, num_local_experts=8, num_experts_per_tok=2, sliding_window=16,
        layer_types=["sliding_attention", "full_attention"] * 2, max_position_embeddings=MAX_POSITIONS,
        rope_scaling=dict(rope_type="yarn", factor=4.0, beta_fast=32.0, beta_slow=1.0,
                          original_max_position_embeddings=64, truncate=False),
        rms_norm_eps=1e-5, tie_word_embeddings=False,
    )  # fmt: skip
    config._attn_implementation = "eager"  # sinks
    model = GptOssForCausalLM(config).eval()
    _randomise(model, 0.05)
    return model


def _tables(reference, backend) -> dict[str, object]:
    """The RoPE table of each layer type ([positions, r]: cos of the pair angles, then sin),
    from transformers' own rotary embedding (YaRN's scaling included)."""
    rotary, config = reference.model.rotary_emb, reference.config
    positions = torch.arange(MAX_POSITIONS)[None]
    dummy = torch.zeros(1, dtype=torch.float32)
    tables = {}
    for layer_type in sorted(set(config.layer_types)):
        if config.model_type.startswith("gemma"):  # a table per layer type
            cos, sin = rotary(dummy, positions, layer_type)
        else:
            cos, sin = rotary(dummy, positions)
        half = cos.shape[-1] if cos.shape[-1] == config.head_dim // 2 else cos.shape[-1] // 2
        table = torch.cat([cos[0, :, :half], sin[0, :, :half]], dim=-1).float().numpy()
        tables[layer_type] = backend.upload(np.ascontiguousarray(table), DType.F32)
    return tables


def _load(reference, backend) -> Model:
    config = reference.config
    gemma = config.model_type.startswith("gemma")
    weights = {name: value.detach().float().numpy() for name, value in reference.state_dict().items()}
    hidden, eps, head_dim = config.hidden_size, config.rms_norm_eps, config.head_dim
    heads = HeadLayout(config.num_attention_heads, config.num_key_value_heads, head_dim)

    def norm(name: str) -> RmsNorm:
        return RmsNorm(1 + weights[name] if gemma else weights[name], eps)

    tables = _tables(reference, backend)
    dense = backend.dense
    layers = []
    for index, layer_type in enumerate(config.layer_types):
        p = f"model.layers.{index}."
        a = p + "self_attn."
        qkv = np.concatenate([weights[a + f"{n}_proj.weight"] for n in "qkv"])
        window = config.sliding_window if layer_type == "sliding_attention" else None
        if gemma:
            spec = AttentionLayer(heads, index, config.query_pre_attn_scalar**-0.5, tables[layer_type], window)
            host = HostAttention(norm(p + "input_layernorm.weight"), HostLinear(qkv), norm(a + "q_norm.weight"),
                                 norm(a + "k_norm.weight"))
            output = HostProjection(HostLinear(weights[a + "o_proj.weight"]),
                                    output_norm=norm(p + "post_attention_layernorm.weight"))
            gate_up = np.concatenate([weights[p + "mlp.gate_proj.weight"], weights[p + "mlp.up_proj.weight"]])
            feed_forward = DenseFeedForward(
                dense.prepare(HostProjection(HostLinear(gate_up), norm(p + "pre_feedforward_layernorm.weight"),
                                             Activation.GELU_TANH)),
                dense.prepare(HostProjection(HostLinear(weights[p + "mlp.down_proj.weight"]),
                                             output_norm=norm(p + "post_feedforward_layernorm.weight"))),
                config.intermediate_size, hidden,
            )
        else:
            bias = np.concatenate([weights[a + f"{n}_proj.bias"] for n in "qkv"])
            spec = AttentionLayer(heads, index, head_dim**-0.5, tables[layer_type], window)
            host = HostAttention(norm(p + "input_layernorm.weight"), HostLinear(qkv, bias), sinks=weights[a + "sinks"])
            output = HostProjection(HostLinear(weights[a + "o_proj.weight"], weights[a + "o_proj.bias"]))
            m = p + "mlp."
            gate_up, gate_up_bias = weights[m + "experts.gate_up_proj"], weights[m + "experts.gate_up_proj_bias"]
            experts = reference.model.layers[index].mlp.experts
            moe = HostMoe(
                input_norm=norm(p + "post_attention_layernorm.weight"),
                router=HostLinear(weights[m + "router.weight"], weights[m + "router.bias"]),
                gate_up=HostLinear(np.concatenate([gate_up[:, :, 0::2], gate_up[:, :, 1::2]], axis=2).transpose(0, 2, 1),
                                   np.concatenate([gate_up_bias[:, 0::2], gate_up_bias[:, 1::2]], axis=1)),
                down=HostLinear(weights[m + "experts.down_proj"].transpose(0, 2, 1), weights[m + "experts.down_proj_bias"]),
                activation=ClampedSwiglu(alpha=experts.alpha, limit=experts.limit),
                routing=Routing(config.num_local_experts, config.num_experts_per_tok, Scoring.SOFTMAX,
                                renormalize=True),
            )
            feed_forward = MoeFeedForward(backend.moe.prepare(moe), config.num_experts_per_tok, hidden,
                                          config.intermediate_size)
        mixer = AttentionMixer(spec, 0, backend.attention.prepare(host, spec), dense.prepare(output), hidden)
        layers.append(Layer(mixer, feed_forward))
    lm_head = None if config.tie_word_embeddings else HostLinear(weights["lm_head.weight"])
    vocab = dense.prepare_vocab(HostVocab(
        weights["model.embed_tokens.weight"], norm("model.norm.weight"), lm_head,
        embedding_scale=float(hidden**0.5) if gemma else 1.0,
        logit_softcap=getattr(config, "final_logit_softcapping", None),
    ))  # fmt: skip
    groups = group_caches([KvShape(heads.num_kv_heads, head_dim)] * config.num_hidden_layers)
    return Model(backend, vocab, layers, groups, hidden, config.vocab_size)


def _step(backend, tokens, start: int) -> StepTensors:
    """One sequence's tokens at positions start.., its pages 0, 1, 2, ...: a slot is a position."""
    count, context = len(tokens), start + len(tokens)
    positions = np.arange(start, context, dtype=np.int32)
    tables = np.arange(MAX_POSITIONS // BLOCK_SIZE, dtype=np.int32)[None, :]
    query_start, seq_lens = np.array([0, count], np.int32), np.array([context], np.int32)
    meta = AttentionMetadata(
        backend.upload(positions), backend.upload(positions), backend.upload(query_start), backend.upload(seq_lens),
        backend.upload(tables), count, 1, count, context,
    )
    return StepTensors(backend.upload(np.asarray(tokens, np.int32)), meta, None)


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


def run_family(reference, backend, kv_dtype: DType, prompt: int = 60, total: int = 64) -> np.ndarray:
    """Our logits of a `prompt`-token prompt, then one token at a time up to `total`."""
    tokens = [int(t) for t in np.random.default_rng(1).integers(0, reference.config.vocab_size, size=total)]
    model = _load(reference, backend)
    config = reference.config
    kv = backend.attention.allocate_cache(KvCacheSpec(config.num_hidden_layers, MAX_POSITIONS // BLOCK_SIZE,
                                                      BLOCK_SIZE, config.num_key_value_heads, config.head_dim,
                                                      kv_dtype))
    workspace = model.allocate_workspace(prompt, prompt)
    got = [backend.download(model.forward(_step(backend, tokens[:prompt], 0), (kv,), workspace, prompt))]
    for position in range(prompt, total):
        got.append(backend.download(model.forward(_step(backend, tokens[position : position + 1], position), (kv,),
                                                  workspace, 1)))
    return tokens, np.concatenate(got).astype(np.float64)


@pytest.mark.parametrize("family", [gemma3, gpt_oss], ids=["gemma3", "gpt_oss"])
def test_a_family_on_cuda_is_within_transformers_bf16_error(cuda_backend, family):
    reference = family()
    tokens, logits = run_family(reference, cuda_backend, DType.BF16)
    exact, hf_bf16 = _hf_logits(reference, tokens, torch.float32), _hf_logits(reference, tokens, torch.bfloat16)
    prompt = 60
    for rows, label in ((slice(0, prompt), "prompt"), (slice(prompt, None), "decodes")):
        ours, theirs = _relative(logits[rows], exact[rows]), _relative(hf_bf16[rows], exact[rows])
        print(f"{family.__name__} {label}: atlas {ours:.2e} transformers-bf16 {theirs:.2e}")
        assert ours <= 1.5 * theirs, (label, ours, theirs)
