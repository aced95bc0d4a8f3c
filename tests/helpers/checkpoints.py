"""Test helpers for checkpoints: a GGUF writer written from the spec, tiny llama GGUFs, an
independent byte-level BPE reference, and locating the real SmolLM2 files.

The GGUF writer here is deliberately separate from `atlas.adapters.weights.gguf` so the reader
is checked against the format, not against itself.
"""

from __future__ import annotations

import atexit
import os
import shutil
import struct
import tempfile
from collections.abc import Iterable, Mapping, Sequence
from functools import cache
from pathlib import Path
from typing import Any

import numpy as np

# gguf.h value types
UINT8, INT8, UINT16, INT16, UINT32, INT32, FLOAT32, BOOL, STRING, ARRAY, UINT64, INT64, FLOAT64 = range(13)
_SCALAR_FORMATS = {
    UINT8: "<B",
    INT8: "<b",
    UINT16: "<H",
    INT16: "<h",
    UINT32: "<I",
    INT32: "<i",
    FLOAT32: "<f",
    BOOL: "<?",
    UINT64: "<Q",
    INT64: "<q",
    FLOAT64: "<d",
}
# ggml type ids and block layouts used by the helpers
GGML_F32, GGML_F16, GGML_Q4_0, GGML_Q4_1, GGML_Q8_0, GGML_BF16 = 0, 1, 2, 3, 8, 30

SMOLLM2_GGUF_ENV = "ATLAS_SMOLLM2_GGUF"


def _string(text: str) -> bytes:
    raw = text.encode("utf-8")
    return struct.pack("<Q", len(raw)) + raw


def _value(value_type: int, value: Any) -> bytes:
    if value_type in _SCALAR_FORMATS:
        return struct.pack(_SCALAR_FORMATS[value_type], value)
    if value_type == STRING:
        return _string(value)
    raise ValueError(f"use array() for arrays, got type {value_type}")


class GgufBuilder:
    """Assemble a GGUF v3 file: typed metadata, then tensors given as raw stored bytes."""

    def __init__(self, alignment_bytes: int = 32, version: int = 3) -> None:
        self.alignment_bytes = alignment_bytes
        self.version = version
        self.kv: list[bytes] = []
        self.tensors: list[tuple[str, tuple[int, ...], int, bytes]] = []
        if alignment_bytes != 32:
            self.add("general.alignment", UINT32, alignment_bytes)

    def add(self, key: str, value_type: int, value: Any) -> GgufBuilder:
        self.kv.append(_string(key) + struct.pack("<I", value_type) + _value(value_type, value))
        return self

    def add_array(self, key: str, element_type: int, values: Sequence[Any]) -> GgufBuilder:
        self.kv.append(_string(key) + struct.pack("<I", ARRAY) + self._array(element_type, values))
        return self

    def _array(self, element_type: int, values: Sequence[Any]) -> bytes:
        body = struct.pack("<IQ", element_type, len(values))
        if element_type == ARRAY:  # values: (inner_type, inner_values) pairs
            return body + b"".join(self._array(inner_type, inner) for inner_type, inner in values)
        return body + b"".join(_value(element_type, v) for v in values)

    def add_tensor(self, name: str, dims: tuple[int, ...], ggml_type: int, stored: bytes) -> GgufBuilder:
        """`dims` in ggml order (innermost first); `stored` the exact bytes of the tensor."""
        self.tensors.append((name, dims, ggml_type, stored))
        return self

    def add_f32(self, name: str, array: np.ndarray) -> GgufBuilder:
        return self.add_tensor(
            name, tuple(reversed(array.shape)), GGML_F32, np.ascontiguousarray(array, "<f4").tobytes()
        )

    def add_f16(self, name: str, array: np.ndarray) -> GgufBuilder:
        return self.add_tensor(
            name, tuple(reversed(array.shape)), GGML_F16, np.ascontiguousarray(array, "<f2").tobytes()
        )

    def to_bytes(self) -> bytes:
        offsets, offset = [], 0
        for _, _, _, stored in self.tensors:
            offset += -offset % self.alignment_bytes
            offsets.append(offset)
            offset += len(stored)
        head = b"GGUF" + struct.pack("<IQQ", self.version, len(self.tensors), len(self.kv)) + b"".join(self.kv)
        for (name, dims, ggml_type, _), tensor_offset in zip(self.tensors, offsets, strict=True):
            head += _string(name) + struct.pack("<I", len(dims)) + struct.pack(f"<{len(dims)}Q", *dims)
            head += struct.pack("<IQ", ggml_type, tensor_offset)
        data = bytearray()
        for (_, _, _, stored), tensor_offset in zip(self.tensors, offsets, strict=True):
            data += b"\0" * (tensor_offset - len(data)) + stored
        return head + b"\0" * (-len(head) % self.alignment_bytes) + bytes(data)

    def write(self, path: Path) -> Path:
        path.write_bytes(self.to_bytes())
        return path


def quantize_q8_0(values: np.ndarray) -> bytes:
    """ggml's reference Q8_0 quantiser (d = amax/127, q = round(x/d)) over rows of 32."""
    blocks = np.asarray(values, np.float32).reshape(-1, 32)
    scale = np.abs(blocks).max(axis=1, keepdims=True) / 127
    inverse = np.divide(1.0, scale, out=np.zeros_like(scale), where=scale != 0)
    quants = np.round(blocks * inverse).astype(np.int8)
    out = np.empty((blocks.shape[0], 34), np.uint8)
    out[:, :2] = scale.astype("<f2").view(np.uint8)
    out[:, 2:] = quants.view(np.uint8)
    return out.tobytes()


def llama_cpp_permute(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """What llama.cpp's converter does to q/k rows: each head's two rotary halves interleaved."""
    return (
        weight.reshape(num_heads, 2, weight.shape[0] // num_heads // 2, *weight.shape[1:])
        .swapaxes(1, 2)
        .reshape(weight.shape)
    )


# ----------------------------------------------------------------------------- byte-level BPE


@cache
def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character map."""
    printable = (
        list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    )
    mapping, extra = {}, 0
    for byte in range(256):
        if byte in printable:
            mapping[byte] = chr(byte)
        else:
            mapping[byte] = chr(256 + extra)
            extra += 1
    return mapping


LLAMA_CPP_GPT2_REGEX = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"


def reference_bpe_encode(
    text: str,
    vocab: Mapping[str, int],
    merges: Sequence[str],
    regexes: Sequence[str] = (r"\p{N}", LLAMA_CPP_GPT2_REGEX),
    special_tokens: Iterable[str] = (),
) -> list[int]:
    """llama.cpp's byte-level BPE, written plainly: split out special tokens, apply each regex
    in turn (matches and the gaps between them become pieces), map bytes to symbols, then merge
    the lowest-ranked adjacent pair until none applies."""
    import regex  # transformers depends on it; only needed by the tests that call this

    ranks = {tuple(m.split(" ", 1)): rank for rank, m in enumerate(merges)}
    byte_map = bytes_to_unicode()
    specials = sorted(special_tokens, key=len, reverse=True)
    ids: list[int] = []
    for chunk, is_special in _split_specials(text, specials):
        if is_special:
            ids.append(vocab[chunk])
            continue
        pieces = [chunk]
        for pattern in regexes:
            compiled = regex.compile(pattern)
            pieces = [part for piece in pieces for part in _regex_split(compiled, piece)]
        for piece in pieces:
            symbols = [byte_map[b] for b in piece.encode("utf-8")]
            while len(symbols) > 1:
                pairs = zip(symbols, symbols[1:], strict=False)
                ranked = [(ranks.get(pair, 1 << 60), i) for i, pair in enumerate(pairs)]
                best_rank, best_idx = min(ranked)
                if best_rank == 1 << 60:
                    break
                symbols[best_idx : best_idx + 2] = [symbols[best_idx] + symbols[best_idx + 1]]
            ids.extend(vocab[symbol] for symbol in symbols)
    return ids


def _split_specials(text: str, specials: Sequence[str]) -> list[tuple[str, bool]]:
    out: list[tuple[str, bool]] = []
    start = idx = 0
    while idx < len(text):
        match = next((s for s in specials if text.startswith(s, idx)), None)
        if match is None:
            idx += 1
            continue
        if idx > start:
            out.append((text[start:idx], False))
        out.append((match, True))
        idx += len(match)
        start = idx
    if start < len(text):
        out.append((text[start:], False))
    return out


def _regex_split(compiled: Any, text: str) -> list[str]:
    parts, position = [], 0
    for match in compiled.finditer(text):
        if match.start() > position:
            parts.append(text[position : match.start()])
        if match.group():
            parts.append(match.group())
        position = match.end()
    if position < len(text):
        parts.append(text[position:])
    return parts


# ----------------------------------------------------------------------------- tiny llama GGUF


def tiny_bpe_vocab() -> tuple[list[str], list[int], list[str]]:
    """(tokens, token types, merges): 3 control tokens, 256 byte symbols, a few merges."""
    byte_symbols = [bytes_to_unicode()[b] for b in range(256)]
    merges = ["h e", "l l", "he ll", "hell o", "Ġ w", "o r", "Ġw or", "Ġwor l", "Ġworl d", "Ġ hello", "1 2"]
    merged = [m.replace(" ", "") for m in merges]
    tokens = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", *byte_symbols, *merged]
    token_types = [3, 3, 3] + [1] * (len(tokens) - 3)
    return tokens, token_types, merges


CHATML_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def tiny_llama_gguf(
    path: Path,
    rng: np.random.Generator,
    *,
    hidden_size: int = 64,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    num_layers: int = 2,
    intermediate_size: int = 96,
    tie: bool = False,
    quantize_embedding: bool = True,
    rope_freqs: np.ndarray | None = None,
) -> dict[str, np.ndarray]:
    """Write a llama GGUF with random weights and return the HF-layout weights it encodes.

    Weights are float32 values exactly representable in bf16 (so the import can be compared
    exactly); q/k are stored permuted the way llama.cpp's converter stores them.
    """
    tokens, token_types, merges = tiny_bpe_vocab()
    vocab_size, head_dim = len(tokens), hidden_size // num_heads

    def weight(*shape: int) -> np.ndarray:
        # Magnitudes in [0.01, 0.2): exact in bf16 and, being normal numbers, in f16 too.
        import ml_dtypes

        values = rng.choice([-1.0, 1.0], size=shape) * rng.uniform(0.01, 0.2, size=shape)
        return values.astype(ml_dtypes.bfloat16).astype(np.float32)

    def norm_weight() -> np.ndarray:
        import ml_dtypes

        return (1 + weight(hidden_size)).astype(ml_dtypes.bfloat16).astype(np.float32)

    hf: dict[str, np.ndarray] = {
        "model.embed_tokens.weight": weight(vocab_size, hidden_size),
        "model.norm.weight": norm_weight(),
    }
    builder = GgufBuilder()
    builder.add("general.architecture", STRING, "llama").add("general.name", STRING, "tiny")
    for key, value in (
        ("block_count", num_layers),
        ("context_length", 256),
        ("embedding_length", hidden_size),
        ("feed_forward_length", intermediate_size),
        ("attention.head_count", num_heads),
        ("attention.head_count_kv", num_kv_heads),
        ("rope.dimension_count", head_dim),
    ):
        builder.add(f"llama.{key}", UINT32, value)
    builder.add("llama.rope.freq_base", FLOAT32, 500000.0).add("llama.attention.layer_norm_rms_epsilon", FLOAT32, 1e-5)
    builder.add("tokenizer.ggml.model", STRING, "gpt2").add("tokenizer.ggml.pre", STRING, "smollm")
    builder.add_array("tokenizer.ggml.tokens", STRING, tokens).add_array(
        "tokenizer.ggml.token_type", INT32, token_types
    )
    builder.add_array("tokenizer.ggml.merges", STRING, merges)
    builder.add("tokenizer.ggml.bos_token_id", UINT32, 1).add("tokenizer.ggml.eos_token_id", UINT32, 2)
    builder.add("tokenizer.ggml.unknown_token_id", UINT32, 0).add("tokenizer.ggml.padding_token_id", UINT32, 2)
    builder.add("tokenizer.ggml.add_bos_token", BOOL, False).add("tokenizer.chat_template", STRING, CHATML_TEMPLATE)
    embed = hf["model.embed_tokens.weight"]
    if quantize_embedding:
        # Q8_0 round trip first, so the expected weights are what the file really holds.
        stored = quantize_q8_0(embed)
        blocks = np.frombuffer(stored, np.uint8).reshape(-1, 34)
        scale = blocks[:, :2].copy().view("<f2").astype(np.float32)
        embed = (blocks[:, 2:].view(np.int8).astype(np.float32) * scale).reshape(embed.shape)
        hf["model.embed_tokens.weight"] = embed
        builder.add_tensor("token_embd.weight", (hidden_size, vocab_size), GGML_Q8_0, stored)
    else:
        builder.add_f32("token_embd.weight", embed)
    for layer in range(num_layers):
        prefix = f"model.layers.{layer}."
        shapes = {
            "self_attn.q_proj": (num_heads * head_dim, hidden_size),
            "self_attn.k_proj": (num_kv_heads * head_dim, hidden_size),
            "self_attn.v_proj": (num_kv_heads * head_dim, hidden_size),
            "self_attn.o_proj": (hidden_size, num_heads * head_dim),
            "mlp.gate_proj": (intermediate_size, hidden_size),
            "mlp.up_proj": (intermediate_size, hidden_size),
            "mlp.down_proj": (hidden_size, intermediate_size),
        }
        gguf_names = {
            "self_attn.q_proj": "attn_q",
            "self_attn.k_proj": "attn_k",
            "self_attn.v_proj": "attn_v",
            "self_attn.o_proj": "attn_output",
            "mlp.gate_proj": "ffn_gate",
            "mlp.up_proj": "ffn_up",
            "mlp.down_proj": "ffn_down",
        }
        for hf_part, shape in shapes.items():
            value = weight(*shape)
            hf[f"{prefix}{hf_part}.weight"] = value
            stored = value
            if hf_part == "self_attn.q_proj":
                stored = llama_cpp_permute(value, num_heads)
            elif hf_part == "self_attn.k_proj":
                stored = llama_cpp_permute(value, num_kv_heads)
            builder.add_f16(f"blk.{layer}.{gguf_names[hf_part]}.weight", stored)
        for hf_part, gguf_name in (("input_layernorm", "attn_norm"), ("post_attention_layernorm", "ffn_norm")):
            value = norm_weight()
            hf[f"{prefix}{hf_part}.weight"] = value
            builder.add_f32(f"blk.{layer}.{gguf_name}.weight", value)
    builder.add_f32("output_norm.weight", hf["model.norm.weight"])
    if not tie:
        hf["lm_head.weight"] = weight(vocab_size, hidden_size)
        builder.add_f32("output.weight", hf["lm_head.weight"])
    if rope_freqs is not None:
        builder.add_f32("rope_freqs.weight", rope_freqs)
    builder.write(path)
    return hf


# ----------------------------------------------------------------------------- the real model


def smollm2_gguf() -> Path | None:
    """The SmolLM2-135M-Instruct GGUF named by $ATLAS_SMOLLM2_GGUF, if it exists."""
    value = os.environ.get(SMOLLM2_GGUF_ENV)
    return Path(value) if value and Path(value).is_file() else None


@cache
def smollm2_folder() -> Path | None:
    """An imported SmolLM2 folder: a fresh import of $ATLAS_SMOLLM2_GGUF into a temporary folder
    (removed at exit) so the current importer is what gets tested, else the folder `atlas pull
    smollm2` made in Atlas's cache, else None."""
    from atlas.adapters.weights.gguf_import import import_gguf
    from atlas.app.model_store import is_model_folder, models_dir

    gguf_path = smollm2_gguf()
    if gguf_path is not None:
        scratch = Path(tempfile.mkdtemp(prefix="atlas-smollm2-"))
        atexit.register(shutil.rmtree, scratch, True)
        return import_gguf(gguf_path, scratch / "smollm2", progress=False)
    pulled = models_dir() / "smollm2"
    return pulled if is_model_folder(pulled) else None


# ----------------------------------------------------------------------------- transformers-written folders


def word_level_tokenizer(folder: Path, vocab_size: int) -> None:
    """A tokenizer.json of `vocab_size` whole-word tokens "t0", "t1", ... (prompts are given as
    ids; the tokenizer only has to load and decode)."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    tokenizer = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab_size)}, unk_token="t0"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.save(str(folder / "tokenizer.json"))


def save_transformers_folder(model: Any, folder: Path) -> Path:
    """`model` as transformers publishes it: config.json and bf16 safetensors (its own names,
    e.g. Qwen3-MoE's per-expert tensors), plus a word-level tokenizer. `model` itself is left
    as it is (a float32 reference whose values are bf16 already)."""
    import copy

    import torch

    copy.deepcopy(model).to(torch.bfloat16).save_pretrained(folder)
    word_level_tokenizer(folder, model.config.vocab_size)
    return folder


def quantize_mxfp4(values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """MXFP4 (blocks, scales) of `values` [..., K], K a multiple of 32: per block of 32 the
    smallest power-of-two scale that brings the largest magnitude within E2M1's 6, each element
    the nearest E2M1 value (a tie to the smaller magnitude); two elements a byte, low nibble
    first. Written from the OCP MX spec, apart from `atlas.domain.models.mxfp4`."""
    magnitudes = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6], np.float32)
    grouped = np.asarray(values, np.float32).reshape(*np.shape(values)[:-1], -1, 32)
    largest = np.maximum(np.abs(grouped).max(axis=-1), np.float32(2.0**-100))
    exponents = np.ceil(np.log2(largest / 6)).astype(np.int32)
    scaled = np.ldexp(grouped, -exponents[..., None])
    codes = np.abs(np.abs(scaled)[..., None] - magnitudes).argmin(axis=-1).astype(np.uint8)
    codes |= np.where(scaled < 0, 8, 0).astype(np.uint8)
    blocks = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return blocks.astype(np.uint8), (exponents + 127).astype(np.uint8)


def mxfp4_values(blocks: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """The float32 values [..., K] MXFP4 blocks [..., K/32, 16] and scales [..., K/32] stand for."""
    table = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6], np.float32)
    elements = np.stack([table[blocks & 0x0F], table[blocks >> 4]], axis=-1).reshape(*blocks.shape[:-1], 32)
    values = np.ldexp(elements, scales.astype(np.int32)[..., None] - 127)
    return values.reshape(*scales.shape[:-1], -1)
