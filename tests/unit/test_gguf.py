"""GGUF reading, dequantisation and import.

Dequantisation is checked against scalar loops written from the block layouts (Q4/Q5/Q8) and,
for every type, against the `gguf` package (a test dependency); the importer against tiny llama GGUFs written by a separate
writer (tests/helpers/checkpoints.py) and, when present, the real SmolLM2 file.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
from helpers.checkpoints import (
    ARRAY,
    BOOL,
    FLOAT32,
    FLOAT64,
    INT8,
    INT16,
    INT32,
    INT64,
    STRING,
    UINT8,
    UINT16,
    UINT32,
    UINT64,
    GgufBuilder,
    llama_cpp_permute,
    smollm2_folder,
    smollm2_gguf,
    tiny_llama_gguf,
)

from atlas.adapters.weights.gguf import GgmlType, GgufError, GgufFile, dequantize_rows
from atlas.adapters.weights.gguf_import import (
    GgufImportError,
    ImportDestinationError,
    import_gguf,
    llama3_rope_factors,
    unpermute_rotary_rows,
)
from atlas.adapters.weights.gguf_quants import BLOCK_DEQUANTIZERS
from atlas.adapters.weights.safetensors import SafetensorsWeights

# ----------------------------------------------------------------------------- scalar references


def _f16(block: bytes, at: int) -> float:
    return float(np.frombuffer(block[at : at + 2], "<f2")[0])


def _ref_q4_0(b: bytes) -> list[float]:
    d, qs = _f16(b, 0), b[2:18]
    return [((qs[j] & 0xF) - 8) * d for j in range(16)] + [((qs[j] >> 4) - 8) * d for j in range(16)]


def _ref_q4_1(b: bytes) -> list[float]:
    d, m, qs = _f16(b, 0), _f16(b, 2), b[4:20]
    return [(qs[j] & 0xF) * d + m for j in range(16)] + [(qs[j] >> 4) * d + m for j in range(16)]


def _ref_q5(b: bytes, has_min: bool) -> list[float]:
    d = _f16(b, 0)
    m = _f16(b, 2) if has_min else 0.0
    start = 4 if has_min else 2
    qh = struct.unpack("<I", b[start : start + 4])[0]
    qs = b[start + 4 : start + 20]
    low, high = [], []
    for j in range(16):
        x0 = (qs[j] & 0x0F) | (((qh >> j) << 4) & 0x10)
        x1 = (qs[j] >> 4) | ((qh >> (j + 12)) & 0x10)
        low.append(x0 * d + m if has_min else (x0 - 16) * d)
        high.append(x1 * d + m if has_min else (x1 - 16) * d)
    return low + high


def _ref_q8_0(b: bytes) -> list[float]:
    d = _f16(b, 0)
    return [q * d for q in np.frombuffer(b[2:34], np.int8).tolist()]


REFERENCES = {
    "Q4_0": _ref_q4_0,
    "Q4_1": _ref_q4_1,
    "Q5_0": lambda b: _ref_q5(b, False),
    "Q5_1": lambda b: _ref_q5(b, True),
    "Q8_0": _ref_q8_0,
}
# The K-quants (super-blocks with packed 6-bit scales) are checked against the `gguf` package,
# the llama.cpp project's own Python reader, rather than against a second hand-written loop.
K_QUANTS = ("Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K")
# Byte positions of the fp16 scales in each block, kept finite so results are comparable.
F16_FIELDS = {
    "Q4_0": (0,),
    "Q4_1": (0, 2),
    "Q5_0": (0,),
    "Q5_1": (0, 2),
    "Q8_0": (0,),
    "Q2_K": (80, 82),
    "Q3_K": (108,),
    "Q4_K": (0, 2),
    "Q5_K": (0, 2),
    "Q6_K": (208,),
}


def random_blocks(type_name: str, num_blocks: int, rng: np.random.Generator) -> np.ndarray:
    _, block_bytes, _ = BLOCK_DEQUANTIZERS[type_name]
    blocks = rng.integers(0, 256, size=(num_blocks, block_bytes), dtype=np.uint8)
    for at in F16_FIELDS[type_name]:
        blocks[:, at : at + 2] = rng.uniform(-0.5, 0.5, size=(num_blocks, 1)).astype("<f2").view(np.uint8)
    return blocks


@pytest.mark.parametrize("type_name", sorted(REFERENCES))
def test_dequantisation_matches_scalar_reference_loops(type_name: str, rng: np.random.Generator) -> None:
    block_elems, _, _ = BLOCK_DEQUANTIZERS[type_name]
    blocks = random_blocks(type_name, 6, rng)
    got = dequantize_rows(blocks.reshape(2, -1), GgmlType[type_name], 3 * block_elems)
    expected = np.array([REFERENCES[type_name](row.tobytes()) for row in blocks], dtype=np.float64).reshape(2, -1)
    assert got.dtype == np.float32 and got.shape == (2, 3 * block_elems)
    assert np.abs(expected).max() > 0.1
    np.testing.assert_allclose(got, expected, rtol=2e-6, atol=1e-6 * np.abs(expected).max())


@pytest.mark.parametrize("type_name", sorted(REFERENCES) + list(K_QUANTS))
def test_dequantisation_is_bit_identical_to_the_gguf_package(type_name: str, rng: np.random.Generator) -> None:
    gguf_quants = pytest.importorskip("gguf.quants")
    from gguf.constants import GGMLQuantizationType

    block_elems, _, _ = BLOCK_DEQUANTIZERS[type_name]
    rows = random_blocks(type_name, 32, rng).reshape(4, -1)
    ours = dequantize_rows(rows, GgmlType[type_name], 8 * block_elems)
    theirs = gguf_quants.dequantize(rows, GGMLQuantizationType[type_name])
    assert np.array_equal(ours, theirs)


def test_plain_types_decode_to_float32(rng: np.random.Generator) -> None:
    values = rng.standard_normal((3, 8)).astype(np.float32)
    for ggml_type, dtype in (
        (GgmlType.F32, np.float32),
        (GgmlType.F16, np.float16),
        (GgmlType.BF16, ml_dtypes.bfloat16),
    ):
        stored = values.astype(dtype)
        got = dequantize_rows(stored.view(np.uint8).reshape(3, -1), ggml_type, 8)
        assert np.array_equal(got, stored.astype(np.float32)), ggml_type.name


# ----------------------------------------------------------------------------- the reader


def test_reader_decodes_every_metadata_type_and_the_tensor_table(tmp_path: Path, rng: np.random.Generator) -> None:
    weights = rng.standard_normal((3, 64)).astype(np.float32)
    builder = GgufBuilder(alignment_bytes=64)
    for key, value_type, value in (
        ("u8", UINT8, 200),
        ("i8", INT8, -100),
        ("u16", UINT16, 60000),
        ("i16", INT16, -30000),
        ("u32", UINT32, 4_000_000_000),
        ("i32", INT32, -2_000_000_000),
        ("f32", FLOAT32, 0.5),
        ("bool", BOOL, True),
        ("u64", UINT64, 2**60),
        ("i64", INT64, -(2**60)),
        ("f64", FLOAT64, 1e-300),
        ("text", STRING, "héllo ✓"),
    ):
        builder.add(f"test.{key}", value_type, value)
    builder.add_array("test.ints", INT32, [3, -1, 7]).add_array("test.words", STRING, ["a", "ü", ""])
    builder.add_array("test.nested", ARRAY, [(UINT8, [1, 2]), (STRING, ["x"])])
    builder.add_f32("w", weights).add_f16("h", weights[:1])
    path = builder.write(tmp_path / "t.gguf")
    with GgufFile(path) as gguf:
        meta = gguf.metadata
        assert gguf.version == 3 and gguf.alignment_bytes == 64 and gguf.data_start % 64 == 0
        assert (meta["test.u8"], meta["test.i8"], meta["test.u16"], meta["test.i16"]) == (200, -100, 60000, -30000)
        assert (meta["test.u32"], meta["test.i32"], meta["test.u64"], meta["test.i64"]) == (
            4_000_000_000,
            -2_000_000_000,
            2**60,
            -(2**60),
        )
        assert meta["test.f32"] == 0.5 and meta["test.f64"] == 1e-300 and meta["test.bool"] is True
        assert (
            meta["test.text"] == "héllo ✓" and meta["test.ints"] == [3, -1, 7] and meta["test.words"] == ["a", "ü", ""]
        )
        assert meta["test.nested"] == [[1, 2], ["x"]]
        assert gguf.tensors["w"].dims == (64, 3) and gguf.tensors["w"].shape == (3, 64)
        assert all(info.offset_bytes % 64 == 0 for info in gguf.tensors.values())
        assert np.array_equal(gguf.dequantize("w"), weights)
        assert np.array_equal(gguf.dequantize("w", 1, 3), weights[1:3])
        assert np.array_equal(gguf.dequantize("h"), weights[:1].astype(np.float16).astype(np.float32))
        with pytest.raises(KeyError, match="'absent'"):
            gguf.dequantize("absent")


def test_bad_magic_old_version_and_big_endian_files_are_refused(tmp_path: Path) -> None:
    path = tmp_path / "x.gguf"
    path.write_bytes(b"GGML" + bytes(20))
    with pytest.raises(GgufError, match="not a GGUF file"):
        GgufFile(path)
    path.write_bytes(b"GGUF" + struct.pack("<IQQ", 1, 0, 0))
    with pytest.raises(GgufError, match="version 1 is not supported"):
        GgufFile(path)
    path.write_bytes(b"GGUF" + struct.pack(">IQQ", 3, 0, 0))
    with pytest.raises(GgufError, match="big-endian"):
        GgufFile(path)


def test_truncated_files_name_what_was_being_read(tmp_path: Path, rng: np.random.Generator) -> None:
    full = (
        GgufBuilder()
        .add("general.name", STRING, "x" * 50)
        .add_f32("w", rng.standard_normal(64).astype(np.float32))
        .to_bytes()
    )
    path = tmp_path / "cut.gguf"
    path.write_bytes(full[:70])
    with pytest.raises(GgufError, match="truncated while reading metadata 'general.name'.*re-download"):
        GgufFile(path)
    path.write_bytes(full[:-10])
    with pytest.raises(GgufError, match="tensor 'w' ends 10 bytes past the end"):
        GgufFile(path)


def test_inconsistent_layouts_are_corruption(tmp_path: Path, rng: np.random.Generator) -> None:
    odd = GgufBuilder(alignment_bytes=24).add_f32("w", rng.standard_normal(8).astype(np.float32))
    path = odd.write(tmp_path / "a.gguf")
    with pytest.raises(GgufError, match="alignment 24 is not a power of two"):
        GgufFile(path)
    partial_block = GgufBuilder().add_tensor("w", (48, 2), int(GgmlType.Q8_0), bytes(34 * 3)).write(tmp_path / "b.gguf")
    with pytest.raises(GgufError, match="rows of 48 values are not whole Q8_0 blocks of 32"):
        GgufFile(partial_block)
    raw = bytearray(GgufBuilder().add_f32("w", rng.standard_normal(64).astype(np.float32)).to_bytes())
    offset_at = raw.index(b"w") + 1 + 4 + 8 + 4  # name, rank, one dim, type -> the u64 offset
    raw[offset_at : offset_at + 8] = struct.pack("<Q", 4)
    (tmp_path / "c.gguf").write_bytes(bytes(raw))
    with pytest.raises(GgufError, match="unaligned offset 4"):
        GgufFile(tmp_path / "c.gguf")


def test_unsupported_tensor_type_names_it_and_the_supported_ones(tmp_path: Path) -> None:
    path = GgufBuilder().add_tensor("w", (256, 1), int(GgmlType.IQ2_XXS), bytes(66)).write(tmp_path / "iq.gguf")
    with GgufFile(path) as gguf, pytest.raises(GgufError) as info:
        gguf.dequantize("w")
    assert "IQ2_XXS" in str(info.value) and "Q4_K" in str(info.value) and "Q8_0" in str(info.value)


# ----------------------------------------------------------------------------- import


@pytest.mark.parametrize(("num_heads", "rows_per_head", "cols"), [(1, 4, 3), (4, 8, 5), (3, 64, 2)])
def test_unpermute_inverts_llama_cpp_permutation(
    num_heads: int, rows_per_head: int, cols: int, rng: np.random.Generator
) -> None:
    weight = rng.standard_normal((num_heads * rows_per_head, cols))
    assert np.array_equal(unpermute_rotary_rows(llama_cpp_permute(weight, num_heads), num_heads), weight)
    bias = rng.standard_normal(num_heads * rows_per_head)
    assert np.array_equal(unpermute_rotary_rows(llama_cpp_permute(bias, num_heads), num_heads), bias)


def test_unpermute_moves_interleaved_pairs_back_to_halves() -> None:
    # one head of 6 rows stored by llama.cpp as (r0, r3, r1, r4, r2, r5)
    stored = np.array([0, 3, 1, 4, 2, 5])
    assert unpermute_rotary_rows(stored, 1).tolist() == [0, 1, 2, 3, 4, 5]


@pytest.mark.parametrize("tie", [False, True])
def test_import_writes_an_hf_folder_with_exact_weights(tmp_path: Path, rng: np.random.Generator, tie: bool) -> None:
    expected = tiny_llama_gguf(tmp_path / "tiny.gguf", rng, tie=tie)
    out = import_gguf(tmp_path / "tiny.gguf", tmp_path / "out", progress=False)
    assert sorted(p.name for p in out.iterdir()) == sorted(
        [
            "config.json",
            "generation_config.json",
            "model.safetensors",
            "special_tokens_map.json",
            "tokenizer.json",
            "tokenizer_config.json",
        ]
    )
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and config["model_type"] == "llama"
    assert (config["hidden_size"], config["num_attention_heads"], config["num_key_value_heads"]) == (64, 4, 2)
    assert (config["num_hidden_layers"], config["intermediate_size"], config["head_dim"]) == (2, 96, 16)
    assert config["vocab_size"] == expected["model.embed_tokens.weight"].shape[0]
    assert (config["rope_theta"], config["rms_norm_eps"], config["max_position_embeddings"]) == (500000.0, 1e-05, 256)
    assert config["tie_word_embeddings"] is tie and config["torch_dtype"] == "bfloat16"
    assert (config["bos_token_id"], config["eos_token_id"]) == (1, 2)
    weights = SafetensorsWeights(out)
    assert sorted(weights.names()) == sorted(expected)
    for name, values in expected.items():
        stored = weights.get(name)
        assert stored.dtype == ml_dtypes.bfloat16, name
        np.testing.assert_array_equal(
            stored.astype(np.float32), values.astype(ml_dtypes.bfloat16).astype(np.float32), err_msg=name
        )
    generation = json.loads((out / "generation_config.json").read_text())
    assert generation == {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 2}
    tokenizer_config = json.loads((out / "tokenizer_config.json").read_text())
    assert tokenizer_config["eos_token"] == "<|im_end|>" and tokenizer_config["bos_token"] == "<|im_start|>"
    assert tokenizer_config["chat_template"].startswith("{% for message in messages %}")
    assert tokenizer_config["add_bos_token"] is False and tokenizer_config["model_max_length"] == 256


def test_import_shards_large_checkpoints_with_an_index(tmp_path: Path, rng: np.random.Generator) -> None:
    expected = tiny_llama_gguf(tmp_path / "tiny.gguf", rng)
    out = import_gguf(tmp_path / "tiny.gguf", tmp_path / "out", progress=False, max_shard_bytes=40_000)
    shards = sorted(p.name for p in out.glob("*.safetensors"))
    assert len(shards) > 2 and (out / "model.safetensors.index.json").is_file()
    weights = SafetensorsWeights(out)
    assert np.array_equal(weights.get("lm_head.weight").astype(np.float32), expected["lm_head.weight"])


def test_import_reports_progress_on_stderr(
    tmp_path: Path, rng: np.random.Generator, capsys: pytest.CaptureFixture[str]
) -> None:
    tiny_llama_gguf(tmp_path / "tiny.gguf", rng)
    import_gguf(tmp_path / "tiny.gguf", tmp_path / "out")
    err = capsys.readouterr().err
    assert "tensor 21/21" in err and " MB" in err and "imported 21 tensors" in err


def test_import_refuses_to_overwrite_unless_asked(tmp_path: Path, rng: np.random.Generator) -> None:
    tiny_llama_gguf(tmp_path / "tiny.gguf", rng)
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    with pytest.raises(ImportDestinationError, match="not empty"):
        import_gguf(tmp_path / "tiny.gguf", out, progress=False)
    assert (out / "keep.txt").read_text() == "mine"
    import_gguf(tmp_path / "tiny.gguf", out, progress=False, overwrite=True)
    assert not (out / "keep.txt").exists() and (out / "config.json").is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out", "tiny.gguf"]


def test_failed_import_leaves_no_folder_behind(tmp_path: Path, rng: np.random.Generator) -> None:
    builder = GgufBuilder().add("general.architecture", STRING, "llama")
    for key, value in (
        ("block_count", 1),
        ("embedding_length", 256),
        ("feed_forward_length", 256),
        ("attention.head_count", 2),
    ):
        builder.add(f"llama.{key}", UINT32, value)
    builder.add("tokenizer.ggml.model", STRING, "gpt2").add("tokenizer.ggml.pre", STRING, "gpt-2")
    builder.add_array("tokenizer.ggml.tokens", STRING, ["a", "b"]).add_array("tokenizer.ggml.merges", STRING, ["a b"])
    builder.add_f32("token_embd.weight", rng.standard_normal((2, 256)).astype(np.float32))
    builder.add_tensor("blk.0.attn_q.weight", (256, 256), int(GgmlType.IQ2_XXS), bytes(66 * 256))
    path = builder.write(tmp_path / "bad.gguf")
    with pytest.raises(GgufError, match="IQ2_XXS"):
        import_gguf(path, tmp_path / "out", progress=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.gguf"]


def test_other_architectures_are_refused_with_the_supported_list(tmp_path: Path) -> None:
    path = GgufBuilder().add("general.architecture", STRING, "gemma2").write(tmp_path / "g.gguf")
    with pytest.raises(GgufImportError, match="architecture 'gemma2' cannot be imported \\(supported: llama\\)"):
        import_gguf(path, tmp_path / "out", progress=False)
    assert not (tmp_path / "out").exists()


def _reference_llama3_factors(factor: float, theta: float, head_dim: int) -> list[float]:
    """Llama 3.1's scaling written as in Meta's reference code, one frequency at a time."""
    out = []
    for i in range(0, head_dim, 2):
        freq = 1.0 / theta ** (i / head_dim)
        wavelength = 2 * np.pi / freq
        if wavelength < 8192 / 4.0:
            out.append(1.0)
        elif wavelength > 8192 / 1.0:
            out.append(factor)
        else:
            smooth = (8192 / wavelength - 1.0) / (4.0 - 1.0)
            out.append(1.0 / ((1 - smooth) / factor + smooth))
    return out


def test_llama3_rope_scaling_is_recovered_from_rope_freqs(tmp_path: Path, rng: np.random.Generator) -> None:
    factors = np.array(_reference_llama3_factors(8.0, 500000.0, 16), dtype=np.float32)
    assert ((factors > 1.0) & (factors < 8.0)).any()  # the head dim reaches the smoothed band, not only the extremes
    scaling = {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    np.testing.assert_allclose(llama3_rope_factors(scaling, 500000.0, 16), factors, rtol=1e-6)

    tiny_llama_gguf(tmp_path / "tiny.gguf", rng, rope_freqs=factors)
    out = import_gguf(tmp_path / "tiny.gguf", tmp_path / "out", progress=False)
    config = json.loads((out / "config.json").read_text())
    assert config["rope_scaling"] == {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }
    assert "rope_freqs.weight" not in SafetensorsWeights(out)


def test_rope_freqs_that_are_not_llama3_scaling_are_refused(tmp_path: Path, rng: np.random.Generator) -> None:
    tiny_llama_gguf(tmp_path / "tiny.gguf", rng, rope_freqs=np.linspace(1, 3, 8, dtype=np.float32))
    with pytest.raises(GgufImportError, match="does not match Llama 3 rope scaling"):
        import_gguf(tmp_path / "tiny.gguf", tmp_path / "out", progress=False)


# ----------------------------------------------------------------------------- the real SmolLM2 file


@pytest.fixture(scope="module")
def smollm2_import(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    gguf_path = smollm2_gguf()
    if gguf_path is None:
        pytest.skip("set ATLAS_SMOLLM2_GGUF to the SmolLM2-135M-Instruct .gguf to run the real-model import tests")
    out = import_gguf(gguf_path, tmp_path_factory.mktemp("smollm2") / "model", progress=False)
    return gguf_path, out


def test_smollm2_import_config_and_weights(smollm2_import: tuple[Path, Path]) -> None:
    gguf_path, out = smollm2_import
    config = json.loads((out / "config.json").read_text())
    assert (config["hidden_size"], config["num_hidden_layers"], config["num_attention_heads"]) == (576, 30, 9)
    assert (config["num_key_value_heads"], config["vocab_size"], config["tie_word_embeddings"]) == (3, 49152, True)
    assert (config["rope_theta"], config["max_position_embeddings"], config["eos_token_id"]) == (100000.0, 8192, 2)
    weights = SafetensorsWeights(out)
    assert len(list(weights.names())) == 272 and "lm_head.weight" not in weights
    with GgufFile(gguf_path) as gguf:
        for layer in (0, 29):
            for kind, heads in (("q", 9), ("k", 3)):
                raw = gguf.dequantize(f"blk.{layer}.attn_{kind}.weight")
                hf = weights.get(f"model.layers.{layer}.self_attn.{kind}_proj.weight").astype(np.float32)
                expected = unpermute_rotary_rows(raw, heads).astype(ml_dtypes.bfloat16).astype(np.float32)
                assert np.array_equal(hf, expected)
                assert not np.array_equal(hf, raw.astype(ml_dtypes.bfloat16).astype(np.float32))
        embed = gguf.dequantize("token_embd.weight")
        assert np.array_equal(
            weights.get("model.embed_tokens.weight").astype(np.float32),
            embed.astype(ml_dtypes.bfloat16).astype(np.float32),
        )


@pytest.mark.oracle
def test_smollm2_import_answers_paris_in_transformers() -> None:
    """Weights, the q/k unpermutation, tokenizer and template together: the imported model
    (pulled, or imported from $ATLAS_SMOLLM2_GGUF) answers the README question correctly."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    out = smollm2_folder()
    if out is None:
        pytest.skip("no SmolLM2: run `atlas pull smollm2` or set ATLAS_SMOLLM2_GGUF")
    tokenizer = transformers.AutoTokenizer.from_pretrained(out)
    model = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}], add_generation_prompt=True, tokenize=False
    )
    input_ids = tokenizer(prompt, return_tensors="pt", add_special_tokens=False).input_ids
    with torch.no_grad():
        output = model.generate(input_ids, max_new_tokens=24, do_sample=False)
    answer = tokenizer.decode(output[0, input_ids.shape[1] :], skip_special_tokens=True)
    assert "Paris" in answer, answer


@pytest.mark.oracle
def test_tiny_import_matches_the_source_model_in_transformers(tmp_path: Path, rng: np.random.Generator) -> None:
    """A random llama with GQA through GGUF and back: logits equal the source model's (the
    unpermute and the name mapping are right, or logits diverge)."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    expected = tiny_llama_gguf(tmp_path / "tiny.gguf", rng, quantize_embedding=False)
    out = import_gguf(tmp_path / "tiny.gguf", tmp_path / "out", progress=False)
    imported = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    source = transformers.LlamaForCausalLM(imported.config).eval()
    source.load_state_dict({name: torch.from_numpy(values) for name, values in expected.items()})
    tokens = torch.tensor([[5, 80, 17, 200, 3, 99, 41, 260]])
    with torch.no_grad():
        got, want = imported(tokens).logits, source(tokens).logits
    assert want.abs().max() > 0.1
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    swapped = {
        name: torch.from_numpy(llama_cpp_permute(v, 4) if name.endswith("q_proj.weight") else v)
        for name, v in expected.items()
    }
    source.load_state_dict(swapped)
    with torch.no_grad():
        assert not torch.allclose(source(tokens).logits, got, atol=1e-3)
