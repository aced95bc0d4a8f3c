"""Convert a llama-architecture GGUF file into a Hugging Face model folder.

The folder holds config.json, generation_config.json, model.safetensors (bf16, HF tensor
names; sharded with an index above `max_shard_bytes`), tokenizer.json, tokenizer_config.json
and special_tokens_map.json, so both `transformers` and Atlas's own adapters load it. It is
written into a temporary sibling folder and renamed into place at the end: an interrupted
import never leaves a folder that looks complete.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import sys
import tempfile
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np

from atlas.adapters.weights.gguf import GgufFile, GgufImportError
from atlas.adapters.weights.gguf_tokenizer import tokenizer_files
from atlas.adapters.weights.safetensors import (
    SafetensorsWriter,
    TensorSpec,
    plan_shards,
    shard_filenames,
    write_index,
)

SUPPORTED_ARCHITECTURES = ("llama",)
DEFAULT_MAX_SHARD_BYTES = 5 * 1024**3
# Dequantise at most this many float32 bytes at once, so a 128k-row embedding never needs
# a full float32 copy.
CHUNK_BYTES = 64 * 1024**2
BF16 = np.dtype(ml_dtypes.bfloat16)

GLOBAL_TENSORS = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
LAYER_TENSORS = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
# Tensors that only feed config.json (Llama 3.1 rope scaling factors).
CONFIG_ONLY_TENSORS = ("rope_freqs.weight",)
_LAYER_NAME = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")


class ImportDestinationError(ValueError):
    """The output folder already holds something and overwriting was not asked for."""


@dataclass(frozen=True, slots=True)
class PlannedTensor:
    """One output tensor: where it comes from, and the head count to unpermute q/k rows by."""

    gguf_name: str
    hf_name: str
    shape: tuple[int, ...]
    unpermute_heads: int | None


def unpermute_rotary_rows(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's reordering of q/k projection rows (weights or biases).

    llama.cpp interleaves each head's two rotary halves so RoPE can rotate adjacent pairs; HF
    keeps the halves apart. Per head of `head_dim` rows (i < head_dim/2):

        GGUF row  i*2 + 0  <->  HF row  i                    (first half)
        GGUF row  i*2 + 1  <->  HF row  i + head_dim/2       (second half)
    """
    head_dim = weight.shape[0] // num_heads
    grouped = weight.reshape(num_heads, head_dim // 2, 2, *weight.shape[1:])
    return grouped.swapaxes(1, 2).reshape(weight.shape)


def import_gguf(
    gguf_path: Path | str,
    out_dir: Path | str,
    progress: bool = True,
    overwrite: bool = False,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
) -> Path:
    """Write an HF-format folder for the GGUF file at `gguf_path` into `out_dir`; returns it.

    Raises GgufError for an unreadable file, GgufImportError for an architecture, tensor type,
    tokenizer or rope scaling the importer does not handle, and ImportDestinationError when
    `out_dir` is a non-empty folder and `overwrite` is False. Progress (tensor i/N, MB) goes to
    stderr.
    """
    out_dir = Path(out_dir)
    if out_dir.exists() and any(out_dir.iterdir()) and not overwrite:
        raise ImportDestinationError(f"{out_dir} already exists and is not empty; choose another folder or remove it")
    report = _Progress(progress)
    with GgufFile(gguf_path) as gguf:
        config = llama_config(gguf)
        plan = plan_tensors(gguf, config)
        out_dir.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.importing-", dir=out_dir.parent))
        try:
            staging.chmod(0o755)  # mkdtemp makes it private; a model folder is an ordinary one
            _write_json(staging / "config.json", config)
            for filename, content in tokenizer_files(gguf.metadata, gguf.path, config).items():
                _write_json(staging / filename, content)
            _write_json(staging / "generation_config.json", _generation_config(config, gguf.metadata))
            _write_weights(gguf, plan, staging, max_shard_bytes, report)
            _replace_folder(staging, out_dir)
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise
    report.done(out_dir)
    return out_dir


def _key(metadata: Mapping[str, Any], key: str, path: Path) -> Any:
    if key not in metadata:
        raise GgufImportError(f"{path}: metadata {key!r} is missing; the GGUF file is incomplete")
    return metadata[key]


def llama_config(gguf: GgufFile) -> dict[str, Any]:
    """The HF LlamaForCausalLM config.json for the file (GgufImportError when not llama)."""
    meta, path = gguf.metadata, gguf.path
    arch = meta.get("general.architecture")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise GgufImportError(
            f"{path}: architecture {arch!r} cannot be imported (supported: {', '.join(SUPPORTED_ARCHITECTURES)}); "
            "use the model's Hugging Face safetensors folder instead"
        )
    hidden_size = int(_key(meta, f"{arch}.embedding_length", path))
    num_heads = int(_key(meta, f"{arch}.attention.head_count", path))
    head_dim = int(meta.get(f"{arch}.attention.key_length", hidden_size // num_heads))
    rotary_dim = int(meta.get(f"{arch}.rope.dimension_count", head_dim))
    if rotary_dim != head_dim:
        raise GgufImportError(f"{path}: partial rotary ({rotary_dim} of {head_dim} dims) is not supported for llama")
    embed = gguf.tensors.get("token_embd.weight")
    if embed is None:
        raise GgufImportError(f"{path}: tensor 'token_embd.weight' is missing; the GGUF file is incomplete")
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": embed.shape[0],
        "hidden_size": hidden_size,
        "intermediate_size": int(_key(meta, f"{arch}.feed_forward_length", path)),
        "num_hidden_layers": int(_key(meta, f"{arch}.block_count", path)),
        "num_attention_heads": num_heads,
        "num_key_value_heads": int(meta.get(f"{arch}.attention.head_count_kv", num_heads)),
        "head_dim": head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": int(meta.get(f"{arch}.context_length", 4096)),
        "rms_norm_eps": _float32(meta.get(f"{arch}.attention.layer_norm_rms_epsilon", 1e-6)),
        "rope_theta": _float32(meta.get(f"{arch}.rope.freq_base", 10000.0)),
        "rope_scaling": _rope_scaling(gguf, arch, head_dim),
        "attention_bias": "blk.0.attn_q.bias" in gguf.tensors,
        "mlp_bias": False,
        "tie_word_embeddings": "output.weight" not in gguf.tensors,
        "bos_token_id": meta.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": meta.get("tokenizer.ggml.eos_token_id"),
        "pad_token_id": meta.get("tokenizer.ggml.padding_token_id"),
        "initializer_range": 0.02,
        "attention_dropout": 0.0,
        "pretraining_tp": 1,
        "use_cache": True,
        "torch_dtype": "bfloat16",
    }


def _float32(value: float) -> float:
    """GGUF stores f32; print the shortest decimal that round-trips (1e-05, not 9.99e-06)."""
    return float(str(np.float32(value)))


def _rope_scaling(gguf: GgufFile, arch: str, head_dim: int) -> dict[str, Any] | None:
    """Linear scaling from metadata, or Llama 3.1 scaling recovered from `rope_freqs.weight`."""
    meta = gguf.metadata
    kind = meta.get(f"{arch}.rope.scaling.type", "none")
    if kind == "linear":
        return {"rope_type": "linear", "factor": _float32(meta[f"{arch}.rope.scaling.factor"])}
    if kind not in ("none", None):
        raise GgufImportError(f"{gguf.path}: rope scaling {kind!r} is not supported by the importer (linear is)")
    if "rope_freqs.weight" not in gguf.tensors:
        return None
    factors = gguf.dequantize("rope_freqs.weight").astype(np.float64)
    theta = float(meta.get(f"{arch}.rope.freq_base", 10000.0))
    # Every Llama 3.x release uses these band edges; only the factor varies (8 for 3.1, 32 for 3.2).
    parameters = {"factor": float(factors.max()), "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                  "original_max_position_embeddings": 8192}
    if not np.allclose(factors, llama3_rope_factors(parameters, theta, head_dim), rtol=1e-3):
        raise GgufImportError(
            f"{gguf.path}: rope_freqs.weight does not match Llama 3 rope scaling, which is the only per-frequency "
            "scaling config.json can express"
        )
    return {"rope_type": "llama3", **parameters}


def llama3_rope_factors(scaling: Mapping[str, float], theta: float, head_dim: int) -> np.ndarray:
    """The per-frequency divisors Llama 3.1 scaling applies (what llama.cpp stores as rope_freqs)."""
    inv_freq = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    wavelength = 2 * np.pi / inv_freq
    original, factor = scaling["original_max_position_embeddings"], scaling["factor"]
    low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
    smooth = (original / wavelength - low) / (high - low)
    blended = 1.0 / ((1 - smooth) / factor + smooth)
    return np.where(wavelength < original / high, 1.0, np.where(wavelength > original / low, factor, blended))


def plan_tensors(gguf: GgufFile, config: Mapping[str, Any]) -> list[PlannedTensor]:
    """HF names and shapes for every GGUF tensor, in HF order; GgufImportError on unknown ones."""
    plan = []
    for info in gguf.tensors.values():
        if info.name in CONFIG_ONLY_TENSORS:
            continue
        hf_name, num_heads = _hf_name(info.name, config)
        if hf_name is None:
            raise GgufImportError(
                f"{gguf.path}: tensor {info.name!r} has no Hugging Face llama equivalent "
                "(mixture-of-experts and multimodal llama GGUFs are not supported)"
            )
        plan.append(PlannedTensor(info.name, hf_name, info.shape, num_heads))
    return sorted(plan, key=lambda t: _hf_order(t.hf_name))


def _hf_name(gguf_name: str, config: Mapping[str, Any]) -> tuple[str | None, int | None]:
    if gguf_name in GLOBAL_TENSORS:
        return GLOBAL_TENSORS[gguf_name], None
    match = _LAYER_NAME.fullmatch(gguf_name)
    if match is None or match.group(2) not in LAYER_TENSORS:
        return None, None
    layer, kind, suffix = match.groups()
    num_heads = {"attn_q": config["num_attention_heads"], "attn_k": config["num_key_value_heads"]}.get(kind)
    return f"model.layers.{layer}.{LAYER_TENSORS[kind]}.{suffix}", num_heads


def _hf_order(hf_name: str) -> tuple[int, int, str]:
    """embed_tokens, then layers in numeric order, then norm and lm_head."""
    match = re.match(r"model\.layers\.(\d+)\.", hf_name)
    if match:
        return 1, int(match.group(1)), hf_name
    return (0, 0, hf_name) if "embed_tokens" in hf_name else (2, 0, hf_name)


def _generation_config(config: Mapping[str, Any], meta: Mapping[str, Any]) -> dict[str, Any]:
    """eos lists end-of-turn and end-of-message ids too, which a chat model stops on."""
    eos_ids: list[int] = []
    for key in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id"):
        if key in meta and meta[key] not in eos_ids:
            eos_ids.append(int(meta[key]))
    generation = {"bos_token_id": config["bos_token_id"], "eos_token_id": eos_ids[0] if len(eos_ids) == 1 else eos_ids}
    if config.get("pad_token_id") is not None:
        generation["pad_token_id"] = config["pad_token_id"]
    return {key: value for key, value in generation.items() if value not in (None, [])}


def _write_weights(
    gguf: GgufFile, plan: list[PlannedTensor], folder: Path, max_shard_bytes: int, report: _Progress
) -> None:
    specs = [TensorSpec(t.hf_name, BF16, t.shape) for t in plan]
    shards = plan_shards(specs, max_shard_bytes)
    filenames = shard_filenames(len(shards))
    by_name = {t.hf_name: t for t in plan}
    report.start(len(specs), sum(spec.num_bytes for spec in specs))
    metadata = {"format": "pt", "source": f"atlas import-gguf {gguf.path.name}"}
    for shard, filename in zip(shards, filenames, strict=True):
        with SafetensorsWriter(folder / filename, shard, metadata) as writer:
            for spec in shard:
                writer.write(spec.name, _converted(gguf, by_name[spec.name]))
                report.tensor_written(spec.name, spec.num_bytes)
    if len(shards) > 1:
        write_index(folder, shards, filenames)


def _converted(gguf: GgufFile, tensor: PlannedTensor) -> np.ndarray:
    """The tensor dequantised to bf16 in HF layout, converted a bounded chunk of rows at a time."""
    out = np.empty(tensor.shape, dtype=BF16)
    rows = out.reshape(-1, tensor.shape[-1]) if tensor.shape else out.reshape(1, 1)
    rows_per_chunk = max(1, CHUNK_BYTES // (4 * rows.shape[1]))
    for row_start in range(0, rows.shape[0], rows_per_chunk):
        row_stop = min(row_start + rows_per_chunk, rows.shape[0])
        rows[row_start:row_stop] = gguf.dequantize(tensor.gguf_name, row_start, row_stop).astype(BF16)
    if tensor.unpermute_heads is not None:
        out = unpermute_rotary_rows(out, tensor.unpermute_heads)
    return out


def _write_json(path: Path, content: Any) -> None:
    path.write_text(json.dumps(content, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def _replace_folder(staging: Path, out_dir: Path) -> None:
    """Move the finished folder into place; an existing one is swapped out, then deleted."""
    if out_dir.exists() and not any(out_dir.iterdir()):
        out_dir.rmdir()
    if not out_dir.exists():
        staging.rename(out_dir)
        return
    retired = out_dir.with_name(f".{out_dir.name}.replaced-{os.getpid()}")
    out_dir.rename(retired)
    staging.rename(out_dir)
    shutil.rmtree(retired, ignore_errors=True)


class _Progress:
    """`tensor i/N name  done/total MB` on stderr: one rewritten line on a terminal, else every 10%."""

    def __init__(self, enabled: bool, write: Callable[[str], object] | None = None) -> None:
        self.enabled = enabled
        self.write = write or sys.stderr.write
        self.interactive = enabled and sys.stderr.isatty()
        self.num_tensors = self.total_bytes = self.done_tensors = self.done_bytes = 0
        self.next_report_fraction = 0.1

    def start(self, num_tensors: int, total_bytes: int) -> None:
        self.num_tensors, self.total_bytes = num_tensors, total_bytes

    def tensor_written(self, name: str, num_bytes: int) -> None:
        self.done_tensors += 1
        self.done_bytes += num_bytes
        if not self.enabled:
            return
        line = (f"importing: tensor {self.done_tensors}/{self.num_tensors} {name}  "
                f"{self.done_bytes / 1e6:.1f}/{self.total_bytes / 1e6:.1f} MB")
        if self.interactive:
            self.write(f"\r\x1b[K{line}")
        elif self.done_bytes >= self.next_report_fraction * self.total_bytes or self.done_tensors == self.num_tensors:
            self.write(line + "\n")
            while self.next_report_fraction * self.total_bytes <= self.done_bytes and self.next_report_fraction < 1:
                self.next_report_fraction += 0.1

    def done(self, out_dir: Path) -> None:
        if self.enabled:
            self.write(("\n" if self.interactive else "") + f"imported {self.num_tensors} tensors into {out_dir}\n")
