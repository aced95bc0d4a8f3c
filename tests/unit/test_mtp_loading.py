"""`--speculative-config '{"method": "mtp", ...}'` through the builder: the MTP layers of a tiny
Qwen3-Next checkpoint load as a draft head on the mock, greedy output is the plain engine's, both
caches come back whole, and a target without MTP layers is a one-line error naming the field."""

from __future__ import annotations

import pytest
from helpers.draft_heads import copying_mtp, random_qwen3_next_weights, write_qwen3_next_folder

from atlas.app.bench.tiny_model import write_tiny_model
from atlas.app.cli import main
from atlas.app.llm import LLM
from atlas.app.settings import EngineSettings, SettingsError
from atlas.domain.requests import SamplingParams

PROMPTS = ["Once upon a time", "Engineers measure throughput in tokens", "a b a b a b"]
MTP = {"method": "mtp", "num_speculative_tokens": 3}


def _copying(config, **kwargs):
    return copying_mtp(random_qwen3_next_weights(config, **kwargs), config)


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("mtp")
    return {
        "random": write_qwen3_next_folder(root / "random", seed=2),
        "copying": write_qwen3_next_folder(root / "copying", weights_of=_copying, seed=3),
        "no-mtp": write_qwen3_next_folder(root / "no-mtp", num_mtp_layers=0),
        "llama": write_tiny_model(root / "llama"),
    }


def generate(llm, max_tokens=24):
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    return [r.outputs[0].token_ids for r in llm.generate(PROMPTS, params)]


def make_llm(folder, **kwargs):
    return LLM(str(folder), device="mock", show_progress=False, max_seq_len=256, kv_cache_gb=0.01, **kwargs)


@pytest.mark.parametrize("head", ["random", "copying"])
def test_the_llm_drafts_with_the_checkpoints_mtp_layers_and_changes_no_token(folders, head):
    llm = make_llm(folders[head], speculative_config=MTP)
    assert generate(llm) == generate(make_llm(folders[head]))
    stats = llm.engine.core.stats()
    assert stats.num_spec_draft_tokens > 0
    if head == "copying":
        assert stats.num_spec_accepted_tokens == stats.num_spec_draft_tokens
    assert stats.num_blocks_free == stats.num_blocks_total
    proposer = llm.engine.core.scheduler.speculation.proposer
    assert proposer.num_free_blocks == proposer.num_blocks


@pytest.mark.parametrize("folder, expected", [
    ("no-mtp", "carries no MTP layers"),
    ("llama", "mtp runs the MTP layers of a Qwen3-Next-family checkpoint"),
])
def test_a_target_without_mtp_layers_is_refused_naming_the_field(folders, folder, expected):
    with pytest.raises(SettingsError, match=expected) as error:
        make_llm(folders[folder], speculative_config=MTP)
    assert "speculative_config.method" in str(error.value)


def test_mtp_on_several_devices_is_refused_naming_the_flags(folders):
    with pytest.raises(SettingsError, match="mtp runs on one device; drop --tensor-parallel-size"):
        EngineSettings(model=str(folders["random"]), tensor_parallel_size=2, speculative_config='{"method": "mtp", '
                       '"num_speculative_tokens": 2}')


def test_the_cli_generates_with_mtp_what_it_generates_without(folders, capsys):
    args = ["generate", str(folders["copying"]), "--prompt", "hello there", "--device", "mock", "--max-tokens", "12",
            "--max-seq-len", "256", "--kv-cache-gb", "0.01"]
    assert main(args) == 0
    plain = capsys.readouterr().out
    assert main([*args, "--speculative-config", '{"method": "mtp", "num_speculative_tokens": 2}']) == 0
    assert capsys.readouterr().out == plain
