"""The safetensors adapter: round trips, the sharded index, and every corruption we detect."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

from atlas.adapters.weights.safetensors import (
    INDEX_FILENAME,
    SafetensorsWeights,
    SafetensorsWriter,
    TensorSpec,
    plan_shards,
    shard_filenames,
    write_index,
    write_safetensors,
)
from atlas.ports.weights import WeightError


def _sample_tensors(rng: np.random.Generator) -> dict[str, np.ndarray]:
    return {
        "embed.bf16": rng.standard_normal((7, 5)).astype(ml_dtypes.bfloat16),
        "norm.f16": rng.standard_normal(9).astype(np.float16),
        "proj.f32": rng.standard_normal((3, 4, 2)).astype(np.float32),
        "positions.i32": rng.integers(-1000, 1000, size=11, dtype=np.int32),
        "ids.i64": rng.integers(-(2**40), 2**40, size=(2, 3), dtype=np.int64),
        "mask.u8": rng.integers(1, 255, size=13, dtype=np.uint8),
        "scale.f8": rng.uniform(-4, 4, size=(4, 4)).astype(ml_dtypes.float8_e4m3fn),
        "flag.bool": rng.integers(0, 2, size=6).astype(bool),
        "scalar.f32": np.array(3.25, dtype=np.float32),
    }


def _header(path: Path) -> tuple[int, dict]:
    raw = path.read_bytes()
    (length,) = struct.unpack("<Q", raw[:8])
    return length, json.loads(raw[8 : 8 + length])


def _rewrite_header(path: Path, header: dict) -> None:
    """Replace the header, keeping the data region (offsets are relative to it)."""
    length, _ = _header(path)
    data = path.read_bytes()[8 + length :]
    encoded = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(encoded)) + encoded + data)


def test_round_trip_keeps_every_dtype_shape_and_bit(tmp_path: Path, rng: np.random.Generator) -> None:
    tensors = _sample_tensors(rng)
    write_safetensors(tmp_path / "model.safetensors", tensors, {"format": "pt", "note": "ünïcode"})
    weights = SafetensorsWeights(tmp_path)
    assert sorted(weights.names()) == sorted(tensors)
    assert weights.metadata() == {"format": "pt", "note": "ünïcode"}
    for name, expected in tensors.items():
        got = weights.get(name)
        assert got.dtype == expected.dtype, name
        assert got.shape == expected.shape == weights.shape(name), name
        assert got.tobytes() == expected.tobytes(), name
    assert "embed.bf16" in weights and "missing" not in weights


def test_get_is_a_read_only_view_of_the_mapped_file(tmp_path: Path, rng: np.random.Generator) -> None:
    write_safetensors(tmp_path / "model.safetensors", {"w": rng.standard_normal((64, 32)).astype(np.float32)})
    weights = SafetensorsWeights(tmp_path)
    view = weights.get("w")
    assert not view.flags.writeable
    again = weights.get("w")
    assert np.shares_memory(view, again)  # both views of the one mapping, no copies


def test_data_region_is_eight_byte_aligned(tmp_path: Path, rng: np.random.Generator) -> None:
    write_safetensors(tmp_path / "a.safetensors", {"odd_name_x": rng.standard_normal(3).astype(np.float32)})
    length, _ = _header(tmp_path / "a.safetensors")
    assert length % 8 == 0


def test_interoperates_with_the_safetensors_package(tmp_path: Path, rng: np.random.Generator) -> None:
    safetensors_numpy = pytest.importorskip("safetensors.numpy")
    ours = {"a": rng.standard_normal((4, 6)).astype(np.float32), "b": rng.integers(1, 9, size=5, dtype=np.int64)}
    write_safetensors(tmp_path / "ours.safetensors", ours)
    loaded = safetensors_numpy.load_file(str(tmp_path / "ours.safetensors"))
    assert all(np.array_equal(loaded[k], v) for k, v in ours.items())

    theirs_dir = tmp_path / "theirs"
    theirs_dir.mkdir()
    theirs = {"x": rng.standard_normal((3, 3)).astype(np.float16), "y": rng.standard_normal(8).astype(np.float32)}
    safetensors_numpy.save_file(theirs, str(theirs_dir / "model.safetensors"))
    weights = SafetensorsWeights(theirs_dir)
    assert all(np.array_equal(weights.get(k), v) for k, v in theirs.items())


def test_sharded_index_spreads_tensors_over_files(tmp_path: Path, rng: np.random.Generator) -> None:
    tensors = {f"layer.{i}.w": rng.standard_normal((16, 16)).astype(np.float32) for i in range(5)}
    specs = [TensorSpec(name, t.dtype, t.shape) for name, t in tensors.items()]
    shards = plan_shards(specs, max_shard_bytes=2 * 16 * 16 * 4)
    assert [len(shard) for shard in shards] == [2, 2, 1]
    filenames = shard_filenames(len(shards))
    assert filenames[0] == "model-00001-of-00003.safetensors"
    for shard, filename in zip(shards, filenames, strict=True):
        write_safetensors(tmp_path / filename, {spec.name: tensors[spec.name] for spec in shard})
    write_index(tmp_path, shards, filenames)
    index = json.loads((tmp_path / INDEX_FILENAME).read_text())
    assert index["weight_map"]["layer.4.w"] == "model-00003-of-00003.safetensors"
    assert index["metadata"]["total_size"] == 5 * 16 * 16 * 4

    weights = SafetensorsWeights(tmp_path)
    assert sorted(weights.names()) == sorted(tensors)
    for name, expected in tensors.items():
        assert np.array_equal(weights.get(name), expected)
    assert weights.total_bytes() == 5 * 16 * 16 * 4


def test_a_tensor_bigger_than_the_shard_limit_gets_its_own_shard() -> None:
    specs = [
        TensorSpec("small", np.dtype(np.float32), (4,)),
        TensorSpec("big", np.dtype(np.float32), (100,)),
        TensorSpec("tail", np.dtype(np.float32), (4,)),
    ]
    assert [[s.name for s in shard] for shard in plan_shards(specs, max_shard_bytes=64)] == [
        ["small"],
        ["big"],
        ["tail"],
    ]
    assert shard_filenames(1) == ["model.safetensors"]


def test_index_naming_a_missing_shard_is_reported(tmp_path: Path, rng: np.random.Generator) -> None:
    write_safetensors(tmp_path / "model-00001-of-00002.safetensors", {"a": rng.standard_normal(4).astype(np.float32)})
    (tmp_path / INDEX_FILENAME).write_text(
        json.dumps({"weight_map": {"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}})
    )
    with pytest.raises(WeightError, match=r"model-00002-of-00002\.safetensors.*missing.*re-download or re-import"):
        SafetensorsWeights(tmp_path)


def test_index_disagreeing_with_the_shards_is_reported(tmp_path: Path, rng: np.random.Generator) -> None:
    write_safetensors(tmp_path / "model-00001-of-00001.safetensors", {"a": rng.standard_normal(4).astype(np.float32)})
    (tmp_path / INDEX_FILENAME).write_text(
        json.dumps(
            {"weight_map": {"a": "model-00001-of-00001.safetensors", "ghost": "model-00001-of-00001.safetensors"}}
        )
    )
    with pytest.raises(WeightError, match=r"'ghost' is not in model-00001-of-00001"):
        SafetensorsWeights(tmp_path)


def test_truncated_file_names_the_file_and_the_fix(tmp_path: Path, rng: np.random.Generator) -> None:
    path = tmp_path / "model.safetensors"
    write_safetensors(
        path, {"a": rng.standard_normal((8, 8)).astype(np.float32), "b": rng.standard_normal(8).astype(np.float32)}
    )
    path.write_bytes(path.read_bytes()[:-5])
    with pytest.raises(WeightError) as info:
        SafetensorsWeights(tmp_path)
    message = str(info.value)
    assert str(path) in message and "5 bytes" in message and "re-download or re-import the model" in message


def test_file_cut_inside_the_header_is_reported(tmp_path: Path, rng: np.random.Generator) -> None:
    path = tmp_path / "model.safetensors"
    write_safetensors(path, {"a": rng.standard_normal(8).astype(np.float32)})
    path.write_bytes(path.read_bytes()[:20])
    with pytest.raises(WeightError, match="header length .* exceeds the file size 20"):
        SafetensorsWeights(tmp_path)
    path.write_bytes(b"\x01\x02")
    with pytest.raises(WeightError, match="too short"):
        SafetensorsWeights(tmp_path)


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (lambda h: h["a"].update(dtype="Q4_K"), "dtype 'Q4_K'"),
        (lambda h: h["a"].update(shape=[3, 3]), "spans 32 bytes but shape \\[3, 3\\]"),
        (lambda h: h["a"].update(shape=[-8]), "invalid shape"),
        (lambda h: h["a"].update(data_offsets=[0]), "invalid data_offsets"),
        (lambda h: h["b"].update(data_offsets=[16, 48]), "'a' and 'b' overlap"),
    ],
)
def test_corrupt_header_entries_are_reported(tmp_path: Path, rng: np.random.Generator, mutate, message: str) -> None:
    path = tmp_path / "model.safetensors"
    write_safetensors(
        path, {"a": rng.standard_normal(8).astype(np.float32), "b": rng.standard_normal(8).astype(np.float32)}
    )
    _, header = _header(path)
    mutate(header)
    _rewrite_header(path, header)
    with pytest.raises(WeightError, match=message) as info:
        SafetensorsWeights(tmp_path)
    assert str(path) in str(info.value)


def test_garbage_header_is_not_json(tmp_path: Path) -> None:
    path = tmp_path / "model.safetensors"
    path.write_bytes(struct.pack("<Q", 12) + b"{not json!!}" + b"\0" * 16)
    with pytest.raises(WeightError, match="not valid JSON"):
        SafetensorsWeights(tmp_path)


def test_folder_without_weights_says_how_to_get_them(tmp_path: Path) -> None:
    with pytest.raises(WeightError, match="no .safetensors files.*import-gguf"):
        SafetensorsWeights(tmp_path)
    with pytest.raises(WeightError, match="not a folder"):
        SafetensorsWeights(tmp_path / "absent")


def test_same_tensor_in_two_files_is_ambiguous(tmp_path: Path, rng: np.random.Generator) -> None:
    for name in ("one.safetensors", "two.safetensors"):
        write_safetensors(tmp_path / name, {"w": rng.standard_normal(4).astype(np.float32)})
    with pytest.raises(WeightError, match="'w' appears in both one.safetensors and two.safetensors"):
        SafetensorsWeights(tmp_path)


def test_absent_tensor_is_a_key_error_naming_it(tmp_path: Path, rng: np.random.Generator) -> None:
    write_safetensors(tmp_path / "model.safetensors", {"w": rng.standard_normal(4).astype(np.float32)})
    weights = SafetensorsWeights(tmp_path)
    with pytest.raises(KeyError, match="'lm_head.weight'"):
        weights.get("lm_head.weight")
    with pytest.raises(KeyError):
        weights.shape("lm_head.weight")


def test_writer_enforces_the_declared_order_and_shapes(tmp_path: Path, rng: np.random.Generator) -> None:
    specs = [TensorSpec("first", np.dtype(np.float32), (2, 2)), TensorSpec("second", np.dtype(np.float32), (3,))]
    writer = SafetensorsWriter(tmp_path / "w.safetensors", specs)
    with pytest.raises(ValueError, match="expected tensor 'first'"):
        writer.write("second", rng.standard_normal(3).astype(np.float32))
    with pytest.raises(ValueError, match=r"float32 \(2, 2\), got 'first' float32 \(4,\)"):
        writer.write("first", rng.standard_normal(4).astype(np.float32))
    writer.write("first", rng.standard_normal((2, 2)).astype(np.float32))
    with pytest.raises(ValueError, match="never written, first 'second'"):
        writer.close()


def test_non_contiguous_and_big_endian_arrays_are_written_correctly(tmp_path: Path, rng: np.random.Generator) -> None:
    base = rng.standard_normal((6, 4)).astype(np.float32)
    tensors = {"transposed": base.T, "big_endian": base.astype(">f4")}
    write_safetensors(tmp_path / "model.safetensors", tensors)
    weights = SafetensorsWeights(tmp_path)
    assert np.array_equal(weights.get("transposed"), base.T)
    assert np.array_equal(weights.get("big_endian"), base)
