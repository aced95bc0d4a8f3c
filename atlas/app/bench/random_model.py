"""Random-weight checkpoints of real model configs, for benchmarks.

`write_random_model("llama-3.1-8b", folder)` writes an HF-format folder (config.json, sharded
bf16 safetensors, a tokenizer) that Atlas and transformers load alike. The values come from a
pool of normal samples read at random offsets, so 8 billion parameters take seconds, not the
minutes i.i.d. sampling would; no two tensors share content and none is zero. The tokenizer is
a placeholder of one word-level token per id: ids 1.. are the common English words `atlas bench
serve` writes its prompts with (`workload.WORDS`), so served text becomes varied ids as in a real
model and prompts share prefixes only where the benchmark means them to; every other id is
"t<id>", and any other word reads as id 0.

With `files=False` the folder holds no weights, only `random_weights.json`: Atlas then reads
`GeneratedWeights`, whose every matrix is a strided view of the same kind of pool (rows at
staggered offsets), so a 70B model needs no 140 GB of files and a tensor-parallel rank copies
only its part (transformers cannot load such a folder).

With `fp8=True` the layer projections are written as llm-compressor writes FP8_DYNAMIC models
(compressed-tensors "float-quantized", one scale per output channel): E4M3 bytes from a pool of
normal samples quantized once, `<module>.weight_scale` [out, 1] in bf16 around the bf16 model's
spread; the embedding, norms and LM head stay bf16, as in the published checkpoints.
"""

from __future__ import annotations

import json
import os
import sys
import zlib
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np

from atlas.adapters.weights.safetensors import (
    SafetensorsWriter,
    TensorSpec,
    plan_shards,
    shard_filenames,
    write_index,
)
from atlas.app.bench.folders import staged_folder
from atlas.domain.models.quantization_weights import E4M3, E4M3_MAX, quantized_at_load

CONFIGS: dict[str, dict[str, Any]] = {
    "llama-3.1-8b": dict(
        architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=128256, hidden_size=4096,
        intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
        head_dim=128, max_position_embeddings=131072, rms_norm_eps=1e-5, rope_theta=500000.0,
        rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                          original_max_position_embeddings=8192),
        tie_word_embeddings=False, bos_token_id=128000, eos_token_id=128001, hidden_act="silu",
        attention_bias=False, mlp_bias=False, torch_dtype="bfloat16",
    ),
    "qwen3-8b": dict(
        architectures=["Qwen3ForCausalLM"], model_type="qwen3", vocab_size=151936, hidden_size=4096,
        intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8,
        head_dim=128, max_position_embeddings=40960, rms_norm_eps=1e-6, rope_theta=1000000.0,
        tie_word_embeddings=False, bos_token_id=151643, eos_token_id=151645, hidden_act="silu",
        attention_bias=False, torch_dtype="bfloat16",
    ),
    "llama-3.1-70b": dict(
        architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=128256, hidden_size=8192,
        intermediate_size=28672, num_hidden_layers=80, num_attention_heads=64, num_key_value_heads=8,
        head_dim=128, max_position_embeddings=131072, rms_norm_eps=1e-5, rope_theta=500000.0,
        rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                          original_max_position_embeddings=8192),
        tie_word_embeddings=False, bos_token_id=128000, eos_token_id=128001, hidden_act="silu",
        attention_bias=False, mlp_bias=False, torch_dtype="bfloat16",
    ),
    "qwen3-30b-a3b": dict(
        architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe", vocab_size=151936, hidden_size=2048,
        intermediate_size=6144, moe_intermediate_size=768, num_experts=128, num_experts_per_tok=8,
        norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[], num_hidden_layers=48,
        num_attention_heads=32, num_key_value_heads=4, head_dim=128, max_position_embeddings=40960,
        rms_norm_eps=1e-6, rope_theta=1000000.0, tie_word_embeddings=False, bos_token_id=151643,
        eos_token_id=151645, hidden_act="silu", attention_bias=False, torch_dtype="bfloat16",
    ),
    "smollm2-135m": dict(
        architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=49152, hidden_size=576,
        intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
        head_dim=64, max_position_embeddings=8192, rms_norm_eps=1e-5, rope_theta=100000.0,
        tie_word_embeddings=True, bos_token_id=1, eos_token_id=2, hidden_act="silu", torch_dtype="bfloat16",
    ),
}


def _family(**config: Any) -> dict[str, Any]:
    """A config of the model-families issue (its loaders read these checkpoints' names)."""
    return dict(max_position_embeddings=131072, torch_dtype="bfloat16", bos_token_id=1, eos_token_id=2, **config)


_QWEN3_NEXT_80B_A3B = dict(
    architectures=["Qwen3NextForCausalLM"], model_type="qwen3_next", vocab_size=151936, hidden_size=2048,
    intermediate_size=5120, moe_intermediate_size=512, shared_expert_intermediate_size=512, num_experts=512,
    num_experts_per_tok=10, norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[], num_hidden_layers=48,
    num_attention_heads=16, num_key_value_heads=2, head_dim=256, partial_rotary_factor=0.25,
    full_attention_interval=4, linear_num_key_heads=16, linear_num_value_heads=32, linear_key_head_dim=128,
    linear_value_head_dim=128, linear_conv_kernel_dim=4, rms_norm_eps=1e-6, rope_theta=10000000.0,
    tie_word_embeddings=False, hidden_act="silu", attention_bias=False,
)
# The families' real configs, and Qwen3-Next (3.3 GB a layer) cut at full width (which sets every
# kernel's shape) to as many layers as an H200 (36) or an H100 (20) holds with its caches.
CONFIGS.update({
    "qwen3-next-80b-a3b": _family(**_QWEN3_NEXT_80B_A3B),
    **{f"qwen3-next-{layers}l": _family(**{**_QWEN3_NEXT_80B_A3B, "num_hidden_layers": layers}) for layers in (20, 36)},
    "gemma-3-12b": _family(
        architectures=["Gemma3ForCausalLM"], model_type="gemma3_text", vocab_size=262208, hidden_size=3840,
        intermediate_size=15360, num_hidden_layers=48, num_attention_heads=16, num_key_value_heads=8, head_dim=256,
        query_pre_attn_scalar=256, sliding_window=1024, sliding_window_pattern=6, rope_theta=1000000.0,
        rope_local_base_freq=10000.0, rope_scaling=dict(rope_type="linear", factor=8.0), rms_norm_eps=1e-6,
        hidden_activation="gelu_pytorch_tanh", final_logit_softcapping=None, attn_logit_softcapping=None,
        tie_word_embeddings=True, attention_bias=False,
    ),
    "gpt-oss-20b": _family(
        architectures=["GptOssForCausalLM"], model_type="gpt_oss", vocab_size=201088, hidden_size=2880,
        intermediate_size=2880, num_local_experts=32, num_experts_per_tok=4, num_hidden_layers=24,
        num_attention_heads=64, num_key_value_heads=8, head_dim=64, sliding_window=128,
        layer_types=["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(24)],
        rope_theta=150000.0, rope_scaling=dict(rope_type="yarn", factor=32.0, beta_fast=32.0, beta_slow=1.0,
                                               original_max_position_embeddings=4096, truncate=False),
        swiglu_limit=7.0, rms_norm_eps=1e-5, tie_word_embeddings=False, attention_bias=True, hidden_act="silu",
    ),
})

_POOL_SIZE = 1 << 26  # 64M bf16 values (128 MB)
_WEIGHT_STD = 0.02
GENERATED_MARKER = "random_weights.json"
_FP8_SPREAD = 4.5  # the pool's E4M3 bytes hold normal samples scaled so 4.5 sigma is 448
FP8_QUANTIZATION_CONFIG: dict[str, Any] = {
    "quant_method": "compressed-tensors", "format": "float-quantized", "quantization_status": "compressed",
    "config_groups": {"group_0": {
        "targets": ["Linear"],
        "weights": {"num_bits": 8, "type": "float", "symmetric": True, "dynamic": False, "strategy": "channel"},
        "input_activations": {"num_bits": 8, "type": "float", "symmetric": True, "dynamic": True, "strategy": "token"},
    }},
    "ignore": ["lm_head"],
}  # fmt: skip


def tensor_shapes(config: dict[str, Any]) -> list[tuple[str, tuple[int, ...]]]:
    """HF checkpoint names and shapes for `config`: the Llama family, Qwen3-MoE, Qwen3-Next,
    Gemma 3 and GPT-OSS (as their published checkpoints name them)."""
    hidden = config["hidden_size"]
    shapes = [("model.embed_tokens.weight", (config["vocab_size"], hidden))]
    for layer in range(config["num_hidden_layers"]):
        prefix = f"model.layers.{layer}"
        mixer = _mixer_shapes(config, layer, prefix)
        head_norms = [shape for shape in mixer if shape[0].endswith(("q_norm.weight", "k_norm.weight"))]
        if config["model_type"] in ("qwen3", "qwen3_moe"):  # after the MLP, as this file has always written
            mixer = [shape for shape in mixer if shape not in head_norms]
        shapes += [(f"{prefix}.input_layernorm.weight", (hidden,)), *mixer,
                   (f"{prefix}.post_attention_layernorm.weight", (hidden,)), *_feed_forward_shapes(config, prefix)]
        if config["model_type"] in ("qwen3", "qwen3_moe"):
            shapes += head_norms
    shapes.append(("model.norm.weight", (hidden,)))
    if not config.get("tie_word_embeddings"):
        shapes.append(("lm_head.weight", (config["vocab_size"], hidden)))
    return shapes


def _mixer_shapes(config: dict[str, Any], layer: int, prefix: str) -> list[tuple[str, tuple[int, ...]]]:
    hidden, model_type = config["hidden_size"], config["model_type"]
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    head_dim = config.get("head_dim") or hidden // heads
    if model_type == "qwen3_next" and (layer + 1) % config["full_attention_interval"]:
        key_dim = config["linear_num_key_heads"] * config["linear_key_head_dim"]
        value_heads = config["linear_num_value_heads"]
        value_dim = value_heads * config["linear_value_head_dim"]
        conv_dim = 2 * key_dim + value_dim
        linear = f"{prefix}.linear_attn"
        return [
            (f"{linear}.in_proj_qkvz.weight", (2 * key_dim + 2 * value_dim, hidden)),
            (f"{linear}.in_proj_ba.weight", (2 * value_heads, hidden)),
            (f"{linear}.conv1d.weight", (conv_dim, 1, config["linear_conv_kernel_dim"])),
            (f"{linear}.dt_bias", (value_heads,)),
            (f"{linear}.A_log", (value_heads,)),
            (f"{linear}.norm.weight", (config["linear_value_head_dim"],)),
            (f"{linear}.out_proj.weight", (hidden, value_dim)),
        ]
    attn = f"{prefix}.self_attn"
    gated = 2 if model_type == "qwen3_next" else 1  # a gate head per q head
    shapes = [
        (f"{attn}.q_proj.weight", (gated * heads * head_dim, hidden)),
        (f"{attn}.k_proj.weight", (kv_heads * head_dim, hidden)),
        (f"{attn}.v_proj.weight", (kv_heads * head_dim, hidden)),
        (f"{attn}.o_proj.weight", (hidden, heads * head_dim)),
    ]
    if config.get("attention_bias"):
        shapes += [(f"{attn}.{name}_proj.bias", (rows,)) for name, rows in
                   (("q", heads * head_dim), ("k", kv_heads * head_dim), ("v", kv_heads * head_dim), ("o", hidden))]
    if model_type in ("qwen3", "qwen3_moe", "qwen3_next", "gemma3_text"):
        shapes += [(f"{attn}.q_norm.weight", (head_dim,)), (f"{attn}.k_norm.weight", (head_dim,))]
    if model_type == "gpt_oss":
        shapes.append((f"{attn}.sinks", (heads,)))
    return shapes


def _feed_forward_shapes(config: dict[str, Any], prefix: str) -> list[tuple[str, tuple[int, ...]]]:
    hidden, model_type = config["hidden_size"], config["model_type"]
    mlp = f"{prefix}.mlp"
    if model_type in ("qwen3_moe", "qwen3_next"):
        experts, inner = config["num_experts"], config["moe_intermediate_size"]
        shapes = [(f"{mlp}.gate.weight", (experts, hidden))]
        for expert in range(experts):
            shapes += [(f"{mlp}.experts.{expert}.{name}_proj.weight", shape) for name, shape in
                       (("gate", (inner, hidden)), ("up", (inner, hidden)), ("down", (hidden, inner)))]
        if config.get("shared_expert_intermediate_size"):
            shared = config["shared_expert_intermediate_size"]
            shapes += [(f"{mlp}.shared_expert.{name}_proj.weight", shape) for name, shape in
                       (("gate", (shared, hidden)), ("up", (shared, hidden)), ("down", (hidden, shared)))]
            shapes.append((f"{mlp}.shared_expert_gate.weight", (1, hidden)))
        return shapes
    if model_type == "gpt_oss":
        experts, inner = config["num_local_experts"], config["intermediate_size"]
        return [
            (f"{mlp}.router.weight", (experts, hidden)),
            (f"{mlp}.router.bias", (experts,)),
            (f"{mlp}.experts.gate_up_proj", (experts, hidden, 2 * inner)),
            (f"{mlp}.experts.gate_up_proj_bias", (experts, 2 * inner)),
            (f"{mlp}.experts.down_proj", (experts, inner, hidden)),
            (f"{mlp}.experts.down_proj_bias", (experts, hidden)),
        ]
    inner = config["intermediate_size"]
    shapes = [(f"{mlp}.{name}_proj.weight", shape) for name, shape in
              (("gate", (inner, hidden)), ("up", (inner, hidden)), ("down", (hidden, inner)))]
    if model_type == "gemma3_text":
        shapes += [(f"{prefix}.pre_feedforward_layernorm.weight", (hidden,)),
                   (f"{prefix}.post_feedforward_layernorm.weight", (hidden,))]
    return shapes


def write_random_model(name_or_config: str | dict[str, Any], out_dir: Path | str, seed: int = 0,
                       progress: bool = True, files: bool = True, fp8: bool = False) -> Path:
    """Write the folder atomically; an existing complete folder with the same config is reused.
    `files=False`: no safetensors, weights generated when read (see the module docstring).
    `fp8`: the layer projections as a per-channel FP8 checkpoint (see the module's docstring)."""
    config = CONFIGS[name_or_config] if isinstance(name_or_config, str) else dict(name_or_config)
    if fp8:
        config = {**config, "quantization_config": FP8_QUANTIZATION_CONFIG}
    out_dir = Path(out_dir).expanduser().resolve()
    config_path = out_dir / "config.json"
    if config_path.exists() and json.loads(config_path.read_text()) == config:
        if not files or any(out_dir.glob("*.safetensors")):
            _update_tokenizer(config, out_dir)  # a folder written before the word vocabulary
            return out_dir
    with staged_folder(out_dir) as staging:
        if files:
            _write_weights(config, staging, np.random.default_rng(seed), progress, fp8)
        else:
            (staging / GENERATED_MARKER).write_text(json.dumps({"seed": seed}))
        _write_tokenizer(config, staging)
        (staging / "generation_config.json").write_text(json.dumps({"eos_token_id": config["eos_token_id"]}))
        (staging / "config.json").write_text(json.dumps(config, indent=2))
    return out_dir


def _write_weights(config: dict[str, Any], folder: Path, rng: np.random.Generator, progress: bool,
                   fp8: bool = False) -> None:
    normal = rng.standard_normal(_POOL_SIZE, dtype=np.float32)
    pool = (normal * _WEIGHT_STD).astype(ml_dtypes.bfloat16)
    fp8_pool = np.clip(normal * (E4M3_MAX / _FP8_SPREAD), -E4M3_MAX, E4M3_MAX).astype(E4M3) if fp8 else None
    bf16 = np.dtype(ml_dtypes.bfloat16)
    specs = []
    for name, shape in tensor_shapes(config):
        if fp8 and quantized_at_load(name, shape):
            specs.append(TensorSpec(name, E4M3, shape))
            specs.append(TensorSpec(name.removesuffix(".weight") + ".weight_scale", bf16, (shape[0], 1)))
        else:
            specs.append(TensorSpec(name, bf16, shape))
    shards = plan_shards(specs, 5 << 30)
    filenames = shard_filenames(len(shards))
    total = sum(spec.num_bytes for spec in specs)
    written = 0
    for shard, filename in zip(shards, filenames):
        with SafetensorsWriter(folder / filename, shard) as writer:
            for spec in shard:
                writer.write(spec.name, _tensor(spec, fp8_pool if spec.dtype == E4M3 else pool, rng))
                written += spec.num_bytes
                if progress:
                    print(f"\rwriting random weights: {written / 2**30:.1f}/{total / 2**30:.1f} GiB", end="",
                          file=sys.stderr, flush=True)
    if progress:
        print(file=sys.stderr)
    if len(shards) > 1:
        write_index(folder, shards, filenames)


def _tensor(spec: TensorSpec, pool: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    count = int(np.prod(spec.shape))
    if spec.name.endswith("norm.weight"):
        return (1.0 + 0.05 * rng.standard_normal(count)).astype(ml_dtypes.bfloat16).reshape(spec.shape)
    if spec.name.endswith(".weight_scale"):  # per row, around the bf16 model's spread
        spread = _WEIGHT_STD * _FP8_SPREAD / E4M3_MAX
        return (spread * rng.uniform(0.8, 1.25, size=count)).astype(ml_dtypes.bfloat16).reshape(spec.shape)
    start = int(rng.integers(0, _POOL_SIZE))
    if count <= _POOL_SIZE - start:
        return pool[start : start + count].reshape(spec.shape)
    pieces, remaining = [pool[start:]], count - (_POOL_SIZE - start)
    while remaining > 0:  # wrap around the pool
        pieces.append(pool[: min(remaining, _POOL_SIZE)])
        remaining -= pieces[-1].shape[0]
    return np.concatenate(pieces).reshape(spec.shape)


class GeneratedWeights:
    """The `WeightSource` of a folder written with `files=False`: each tensor a read-only view
    of a pool of bf16 normal samples, its rows at staggered offsets (rows overlap in part; none
    is zero), so reading a part copies only that part. Norm weights are 1 + small noise."""

    def __init__(self, config: dict[str, Any], seed: int) -> None:
        self._shapes = dict(tensor_shapes(config))
        rng = np.random.default_rng(seed)
        self._pool = (rng.standard_normal(_POOL_SIZE, dtype=np.float32) * _WEIGHT_STD).astype(ml_dtypes.bfloat16)
        self._seed = seed

    @classmethod
    def from_folder(cls, folder: Path, config: dict[str, Any]) -> GeneratedWeights:
        return cls(config, int(json.loads((folder / GENERATED_MARKER).read_text())["seed"]))

    def names(self) -> list[str]:
        return list(self._shapes)

    def __contains__(self, name: str) -> bool:
        return name in self._shapes

    def shape(self, name: str) -> tuple[int, ...]:
        return self._shapes[name]

    def get(self, name: str) -> np.ndarray:
        shape = self._shapes[name]
        rng = np.random.default_rng([self._seed, zlib.crc32(name.encode())])
        if len(shape) == 1:
            return (1.0 + 0.05 * rng.standard_normal(shape)).astype(ml_dtypes.bfloat16)
        columns = shape[-1]
        rows = int(np.prod(shape[:-1]))  # an expert stack or a conv1d weight: its rows in order
        start = int(rng.integers(0, _POOL_SIZE // 2))
        step = min(columns, (_POOL_SIZE - start - columns) // max(rows - 1, 1))
        if step < 1:
            raise ValueError(f"tensor {name!r} {shape} is too large for the pool of generated weights")
        itemsize = self._pool.itemsize
        strides = [step * itemsize, itemsize]  # row r starts `step` values after row r - 1
        for extent in reversed(shape[1:-1]):
            strides.insert(0, strides[0] * extent)
        return np.lib.stride_tricks.as_strided(self._pool[start:], shape, tuple(strides), writeable=False)


def open_generated(folder: Path, config: dict[str, Any]) -> GeneratedWeights | None:
    """The generated weights of a folder written with `files=False`; None for any other folder."""
    return GeneratedWeights.from_folder(folder, config) if (folder / GENERATED_MARKER).is_file() else None


def _write_tokenizer(config: dict[str, Any], folder: Path) -> None:
    for name, text in _tokenizer_files(config).items():
        (folder / name).write_text(text)


def _update_tokenizer(config: dict[str, Any], folder: Path) -> None:
    """Rewrite the tokenizer files that differ from `_tokenizer_files`, each atomically."""
    for name, text in _tokenizer_files(config).items():
        path = folder / name
        if not path.is_file() or path.read_text() != text:
            staged = path.with_name(f".{name}.tmp")
            staged.write_text(text)
            os.replace(staged, path)


def _tokenizer_files(config: dict[str, Any]) -> dict[str, str]:
    from tokenizers import Tokenizer, models, pre_tokenizers

    from atlas.app.bench.workload import WORDS

    vocab = {f"t{i}": i for i in range(config["vocab_size"])}
    specials = {config["bos_token_id"], config["eos_token_id"]}
    word_ids = [i for i in range(1, config["vocab_size"]) if i not in specials][: len(WORDS)]
    for word, token_id in zip(WORDS, word_ids):
        del vocab[f"t{token_id}"]
        vocab[word] = token_id
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="t0"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer_config = {
        "eos_token": f"t{config['eos_token_id']}", "bos_token": f"t{config['bos_token_id']}",
        "model_max_length": config["max_position_embeddings"],
        "chat_template": "{% for m in messages %}{{ m['content'] }} {% endfor %}",
    }
    return {"tokenizer.json": tokenizer.to_str(pretty=True), "tokenizer_config.json": json.dumps(tokenizer_config)}
