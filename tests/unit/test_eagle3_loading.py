"""`--speculative-config '{"method": "eagle3", "model": HEAD}'` through the builder: a head folder in
the common format loads beside a tiny Llama target on the mock, greedy output is the plain
engine's, and a missing or malformed head is a one-line error naming the field."""

from __future__ import annotations

import json

import pytest
from helpers.draft_heads import TINY_EAGLE3, random_eagle3_weights

from atlas.adapters.weights.safetensors import write_safetensors
from atlas.app.bench.tiny_model import TinyModelShape, write_tiny_model
from atlas.app.cli import main
from atlas.app.llm import LLM
from atlas.app.settings import SettingsError
from atlas.domain.requests import SamplingParams

PROMPTS = ["Once upon a time", "Engineers measure throughput in tokens"]


def write_head(folder, vocab_size, **config):
    folder.mkdir()
    config = {**TINY_EAGLE3, "vocab_size": vocab_size, "draft_vocab_size": 256, **config}
    (folder / "config.json").write_text(json.dumps(config))
    write_safetensors(folder / "model.safetensors", random_eagle3_weights(config))
    return folder


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("eagle3")
    target = write_tiny_model(root / "target", shape=TinyModelShape(num_layers=4))
    vocab_size = json.loads((target / "config.json").read_text())["vocab_size"]
    return {
        "target": target,
        "head": write_head(root / "head", vocab_size),
        "deep-head": write_head(root / "deep-head", vocab_size, num_hidden_layers=2),
    }


def eagle3(head, k=3):
    return {"method": "eagle3", "num_speculative_tokens": k, "model": str(head)}


def generate(llm, max_tokens=24):
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    return [r.outputs[0].token_ids for r in llm.generate(PROMPTS, params)]


def make_llm(folder, **kwargs):
    return LLM(str(folder), device="mock", show_progress=False, max_seq_len=256, kv_cache_gb=0.01, **kwargs)


def test_the_llm_drafts_with_an_eagle3_head_and_changes_no_token(folders):
    llm = make_llm(folders["target"], speculative_config=eagle3(folders["head"]))
    assert generate(llm) == generate(make_llm(folders["target"]))
    stats = llm.engine.core.stats()
    assert stats.num_spec_draft_tokens > 0 and stats.num_blocks_free == stats.num_blocks_total
    proposer = llm.engine.core.scheduler.speculation.proposer
    assert proposer.num_free_blocks == proposer.num_blocks


@pytest.mark.parametrize("head, expected", [
    ("deep-head", "num_hidden_layers: 2; Atlas runs EAGLE-3 heads of one layer"),
    ("missing", "not found"),
])
def test_a_head_atlas_cannot_run_is_refused_naming_the_field(folders, tmp_path, head, expected):
    path = folders.get(head, tmp_path / "nowhere")
    with pytest.raises(SettingsError, match=expected) as error:
        make_llm(folders["target"], speculative_config=eagle3(path))
    assert str(error.value).startswith("--speculative-config: speculative_config.model: ")


def test_the_cli_generates_with_eagle3_what_it_generates_without(folders, capsys):
    args = ["generate", str(folders["target"]), "--prompt", "hello there", "--device", "mock", "--max-tokens", "12",
            "--max-seq-len", "256", "--kv-cache-gb", "0.01"]
    assert main(args) == 0
    plain = capsys.readouterr().out
    assert main([*args, "--speculative-config", json.dumps(eagle3(folders["head"], k=2))]) == 0
    assert capsys.readouterr().out == plain
