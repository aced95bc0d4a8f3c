"""The random-weight checkpoints' placeholder tokenizer: the serving benchmark's words are
distinct ids, so its prompts share prefixes only where it means them to."""

from __future__ import annotations

import json

import numpy as np
import pytest
from tokenizers import Tokenizer

from atlas.app.bench.random_model import CONFIGS, GeneratedWeights, write_random_model
from atlas.app.bench.workload import WORDS

CONFIG = {**CONFIGS["smollm2-135m"], "vocab_size": 400, "num_hidden_layers": 1}


def test_the_benchmark_words_are_distinct_ids_and_every_other_id_round_trips(tmp_path):
    folder = write_random_model(CONFIG, tmp_path / "model", files=False, progress=False)
    tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
    ids = [tokenizer.encode(word).ids for word in WORDS]
    assert all(len(one) == 1 for one in ids)
    word_ids = {one[0] for one in ids}
    assert len(word_ids) == len(WORDS) and not word_ids & {0, CONFIG["bos_token_id"], CONFIG["eos_token_id"]}
    assert tokenizer.encode("the of zebra").ids == [ids[0][0], ids[1][0], 0]  # an unknown word is id 0
    rest = [i for i in range(CONFIG["vocab_size"]) if i not in word_ids]
    assert tokenizer.encode(tokenizer.decode(rest)).ids == rest
    config = json.loads((folder / "tokenizer_config.json").read_text())
    assert config["eos_token"] == f"t{CONFIG['eos_token_id']}"


def test_a_folder_written_before_the_word_vocabulary_gets_it_when_reused(tmp_path):
    folder = write_random_model(CONFIG, tmp_path / "model", files=False, progress=False)
    current = (folder / "tokenizer.json").read_text()
    (folder / "tokenizer.json").write_text("{}")
    marker = (folder / "random_weights.json").stat().st_mtime_ns
    assert write_random_model(CONFIG, folder, files=False, progress=False) == folder
    assert (folder / "tokenizer.json").read_text() == current
    assert (folder / "random_weights.json").stat().st_mtime_ns == marker  # the folder itself was kept


@pytest.mark.parametrize("name", ["llama-3.1-8b", "qwen3-30b-a3b", "smollm2-135m"])
def test_generated_tensors_stay_inside_their_pool_with_staggered_contiguous_rows(name):
    """Every generated tensor is a view whose last element lies inside the pool (a wide matrix,
    columns > rows, read past it and crashed the 8B's load), with contiguous rows."""
    weights = GeneratedWeights(CONFIGS[name], seed=0)
    pool = weights._pool
    pool_start = pool.__array_interface__["data"][0]
    pool_end = pool_start + pool.nbytes
    for tensor_name in weights.names():
        array = weights.get(tensor_name)
        if array.ndim == 1:
            continue
        start = array.__array_interface__["data"][0]
        last = start + sum((extent - 1) * stride for extent, stride in zip(array.shape, array.strides))
        assert pool_start <= start and last + array.itemsize <= pool_end, tensor_name
        assert array.strides[-1] == array.itemsize, tensor_name
    if name == "llama-3.1-8b":
        down = weights.get("model.layers.0.mlp.down_proj.weight")
        assert down.shape[1] > down.shape[0] and np.isfinite(down[-1].astype(np.float32)).all()
