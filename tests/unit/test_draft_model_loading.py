"""`--speculative-config '{"method": "draft_model", ...}'` through the builder: the draft loads like a
target on the mock, greedy output is the plain engine's, both caches come back whole, and a
missing draft or one with another vocabulary is a one-line error naming the field."""

from __future__ import annotations

import json

import pytest

from atlas.app.bench.tiny_model import TinyModelShape, write_tiny_model
from atlas.app.cli import main
from atlas.app.llm import LLM
from atlas.app.settings import EngineSettings, SettingsError
from atlas.domain.requests import SamplingParams

PROMPTS = ["Once upon a time", "Engineers measure throughput in tokens"]


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("draft")
    return {
        "target": write_tiny_model(root / "target"),
        "draft": write_tiny_model(root / "draft", seed=1, shape=TinyModelShape(num_layers=1)),
        "other-vocab": write_tiny_model(root / "other-vocab", shape=TinyModelShape(vocab_size=512)),
        "eagle3-head": eagle3_head(write_tiny_model(root / "eagle3-head")),
    }


def eagle3_head(folder):
    """A folder whose config.json names an EAGLE-3 head (the weights do not matter: it is refused first)."""
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "architectures": ["LlamaForCausalLMEagle3"]}))
    return folder


def draft_config(model, k=3):
    return {"method": "draft_model", "num_speculative_tokens": k, "model": str(model)}


def generate(llm, max_tokens=24):
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    return [r.outputs[0].token_ids for r in llm.generate(PROMPTS, params)]


def make_llm(folder, **kwargs):
    return LLM(str(folder), device="mock", show_progress=False, max_seq_len=256, kv_cache_gb=0.01, **kwargs)


@pytest.mark.parametrize("draft", ["draft", "target"])
def test_the_llm_drafts_with_a_draft_model_and_changes_no_token(folders, draft):
    llm = make_llm(folders["target"], speculative_config=draft_config(folders[draft]))
    assert generate(llm) == generate(make_llm(folders["target"]))
    stats = llm.engine.core.stats()
    assert stats.num_spec_draft_tokens > 0 and stats.num_blocks_free == stats.num_blocks_total
    if draft == "target":  # every greedy draft of the target's own argmax is accepted
        assert stats.num_spec_accepted_tokens == stats.num_spec_draft_tokens
    proposer = llm.engine.core.scheduler.speculation.proposer
    assert proposer.num_free_blocks == proposer.num_blocks > 0


def test_a_draft_with_another_vocabulary_is_refused_naming_the_field(folders):
    with pytest.raises(SettingsError, match=r"speculative_config\.model: .* does not share the target's tokenizer"):
        make_llm(folders["target"], speculative_config=draft_config(folders["other-vocab"]))


def test_a_missing_draft_is_refused_naming_the_field(folders, tmp_path):
    with pytest.raises(SettingsError, match=r"speculative_config\.model: draft '.*nowhere' .*not found"):
        make_llm(folders["target"], speculative_config=draft_config(tmp_path / "nowhere"))


@pytest.mark.parametrize("draft, expected", [("other-vocab", "does not share the target's tokenizer"),
                                             ("missing", "not found"),
                                             ("eagle3-head", 'is an EAGLE-3 head, which drafts from the target\'s '
                                                             'hidden states; use "method": "eagle3" with it')])
def test_the_cli_says_what_is_wrong_with_the_draft_in_one_line(folders, capsys, draft, expected):
    model = folders.get(draft, folders["target"].parent / "missing")
    code = main(["generate", str(folders["target"]), "--prompt", "x", "--device", "mock", "--kv-cache-gb", "0.01",
                 "--speculative-config", json.dumps(draft_config(model))])
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("atlas: error:")]
    assert code == 2 and len(lines) == 1 and "Traceback" not in err
    assert lines[0].startswith("atlas: error: --speculative-config: speculative_config.model: ")
    assert expected in lines[0]


def test_the_cli_generates_with_a_draft_model_what_it_generates_without(folders, capsys):
    args = ["generate", str(folders["target"]), "--prompt", "Once upon a time", "--device", "mock",
            "--max-tokens", "16", "--kv-cache-gb", "0.01"]
    assert main(args) == 0
    plain = capsys.readouterr().out
    assert main([*args, "--speculative-config", json.dumps(draft_config(folders["draft"]))]) == 0
    assert capsys.readouterr().out == plain


def test_a_draft_model_on_several_devices_is_refused_naming_the_flags(folders):
    with pytest.raises(SettingsError, match=r"speculative_config\.method: draft_model runs on one device; drop "
                                            r"--tensor-parallel-size"):
        EngineSettings(model=str(folders["target"]), tensor_parallel_size=2,
                       speculative_config=json.dumps(draft_config(folders["draft"])))
