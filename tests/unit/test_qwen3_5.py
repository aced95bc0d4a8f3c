"""Qwen3.5 and Qwen3.5-MoE on the mock (the Qwen3-Next loader): tiny random checkpoints that
transformers writes, served by `atlas.LLM`, match transformers' float32 logprobs under teacher
forcing; the language model of a vision-language checkpoint (`model.language_model.*`, a nested
`text_config`) loads as the text-only one does."""

from __future__ import annotations

import json
import shutil

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from safetensors.torch import load_file, save_file  # noqa: E402
from tiny_models import teacher_forced_gap, write_model_folder  # noqa: E402

import atlas  # noqa: E402
from atlas.domain.models.config import ModelConfig  # noqa: E402
from atlas.domain.requests import SamplingParams  # noqa: E402
from atlas.ports.gpu import Kind  # noqa: E402

pytestmark = pytest.mark.oracle

GREEDY = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True, logprobs=0)
PROMPTS = [[5, 17, 99, 42, 7, 250, 31, 64, 12, 8, 140, 77, 23], [300, 12, 45], list(range(40, 80))]


def _llm(folder):
    return atlas.LLM(str(folder), device="mock", show_progress=False, max_seq_len=128, max_prefill_tokens=16,
                     max_num_seqs=3, block_size=8)


@pytest.fixture(scope="module", params=["qwen3_5", "qwen3_5_moe"])
def checkpoint(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp(request.param)
    return request.param, folder, write_model_folder(folder, request.param)


def test_logprobs_match_transformers_under_teacher_forcing(checkpoint):
    family, folder, reference = checkpoint
    llm = _llm(folder)
    expected = {Kind.DENSE, Kind.ATTENTION, Kind.RECURRENT} | ({Kind.MOE} if family == "qwen3_5_moe" else set())
    assert llm.engine.model.kinds == expected
    outputs = llm.generate(PROMPTS, GREEDY)
    for prompt, output in zip(PROMPTS, outputs):
        choice = output.outputs[0]
        assert len(choice.token_ids) == 32
        assert teacher_forced_gap(reference, prompt, choice.token_ids, choice.logprobs) < 1e-3
    stats = llm.engine.core.stats()
    assert stats.num_blocks_free == stats.num_blocks_total


def test_a_vision_language_checkpoint_serves_its_language_model(checkpoint, tmp_path):
    """The published checkpoints are Qwen3_5(Moe)ForConditionalGeneration: the language model
    under model.language_model., a vision tower beside it, config.json's fields in text_config.
    The same weights laid out so give the text-only checkpoint's tokens and logprobs."""
    family, folder, _ = checkpoint
    text = json.loads((folder / "config.json").read_text())
    wrapper = "Qwen3_5MoeForConditionalGeneration" if family == "qwen3_5_moe" else "Qwen3_5ForConditionalGeneration"
    config = {
        "architectures": [wrapper], "model_type": family, "tie_word_embeddings": text.get("tie_word_embeddings", False),
        "text_config": {key: value for key, value in text.items() if key != "architectures"},
        "vision_config": {"depth": 1, "hidden_size": 16},
    }
    (tmp_path / "config.json").write_text(json.dumps(config))
    tensors = {(f"model.language_model.{name[len('model.'):]}" if name.startswith("model.") else name): tensor
               for name, tensor in load_file(folder / "model.safetensors").items()}
    tensors["model.visual.patch_embed.proj.weight"] = torch.zeros(16, 3, 2, 2, 2, dtype=torch.bfloat16)
    save_file(tensors, tmp_path / "model.safetensors")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(folder / name, tmp_path / name)
    assert ModelConfig.from_dict(config).hidden_size == text["hidden_size"]
    ours, theirs = _llm(tmp_path).generate(PROMPTS, GREEDY), _llm(folder).generate(PROMPTS, GREEDY)
    for a, b in zip(ours, theirs):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert a.outputs[0].logprobs == b.outputs[0].logprobs


def test_atlas_doctor_finds_every_layer_within_the_noise(checkpoint):
    """Float32 on the mock: summation-order error only, layer by layer against transformers."""
    from atlas.app.doctor import run_doctor

    family, folder, _ = checkpoint
    report = run_doctor(str(folder), device="mock", prompt="The capital of France is Paris.", write=lambda line: None)
    feed_forward = "moe" if family == "qwen3_5_moe" else "dense"
    assert report.passed and [check.kind for check in report.layers] == [
        f"gated deltanet + {feed_forward}", f"gated attention + {feed_forward}",
    ] * 2
    assert max(check.error for check in report.layers) < 1e-5
