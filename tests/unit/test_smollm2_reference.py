"""The real SmolLM2-135M-Instruct on the mock backend against transformers on the same weights.

Needs the imported model (`atlas pull smollm2`, or ATLAS_SMOLLM2_DIR) and the `oracle` extra.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from chat_prompts import CHAT_PROMPTS  # noqa: E402

from atlas.app.llm import LLM  # noqa: E402
from atlas.app.model_store import models_dir  # noqa: E402
from atlas.domain.batch import SamplingRow, ScheduledBatch, ScheduledSequence  # noqa: E402
from atlas.domain.requests import SamplingParams  # noqa: E402

pytestmark = [pytest.mark.oracle, pytest.mark.e2e]

GREEDY_ROW = SamplingRow(temperature=0.0, top_k=0, top_p=1.0, min_p=0.0, seed=0, counter=0)


def _model_dir() -> Path:
    folder = Path(os.environ.get("ATLAS_SMOLLM2_DIR", models_dir() / "smollm2"))
    if not (folder / "config.json").exists():
        pytest.skip("SmolLM2 is not pulled (run `atlas pull smollm2`)")
    return folder


@pytest.fixture(scope="module")
def atlas_llm():
    return LLM(str(_model_dir()), device="mock", show_progress=False, max_seq_len=1024, max_prefill_tokens=512)


@pytest.fixture(scope="module")
def reference():
    model = transformers.AutoModelForCausalLM.from_pretrained(_model_dir(), dtype=torch.float32)
    model.eval()
    return model


def _atlas_final_logits(llm: LLM, token_ids: list[int]) -> np.ndarray:
    """The logits after the last prompt token, from one prefill through the worker."""
    engine = llm.engine
    block_size = engine.settings.block_size
    num_blocks = -(-len(token_ids) // block_size)
    sequence = ScheduledSequence("ref", tuple(token_ids), 0, tuple(range(num_blocks)), GREEDY_ROW)
    worker = engine.core.executor
    return worker.compute_logits(ScheduledBatch(0, (sequence,), block_size))[0]


@pytest.mark.parametrize("length", [1, 7, 300])
def test_final_logits_agree_with_transformers(atlas_llm, reference, length):
    rng = np.random.default_rng(length)
    token_ids = [int(t) for t in rng.integers(0, atlas_llm.engine.config.vocab_size, size=length)]
    ours = _atlas_final_logits(atlas_llm, token_ids).astype(np.float64)
    with torch.no_grad():
        theirs = reference(torch.tensor([token_ids])).logits[0, -1].double().numpy()
    max_relative = np.max(np.abs(ours - theirs)) / np.max(np.abs(theirs))
    l2_relative = np.linalg.norm(ours - theirs) / np.linalg.norm(theirs)
    assert max_relative <= 1e-3 and l2_relative <= 1e-3, (max_relative, l2_relative)


def test_greedy_chat_matches_transformers_token_for_token(atlas_llm, reference):
    params = SamplingParams(temperature=0.0, max_tokens=48)
    conversations = [[{"role": "user", "content": prompt}] for prompt in CHAT_PROMPTS]
    results = atlas_llm.chat(conversations, params)
    eos = sorted(atlas_llm.tokenizer.eos_token_ids)
    for result in results:
        prompt_ids = torch.tensor([result.prompt_token_ids])
        with torch.no_grad():
            generated = reference.generate(
                prompt_ids,
                attention_mask=torch.ones_like(prompt_ids),
                max_new_tokens=48,
                do_sample=False,
                eos_token_id=eos,
                pad_token_id=eos[0],
            )
        expected = generated[0, prompt_ids.shape[1] :].tolist()
        assert result.outputs[0].token_ids == expected, result.prompt


def test_the_capital_of_france_is_paris(atlas_llm):
    answer = atlas_llm.chat([{"role": "user", "content": "What is the capital of France?"}],
                            SamplingParams(temperature=0.0, max_tokens=32))
    assert "Paris" in answer[0].outputs[0].text


def test_sixteen_prompts_in_one_batch_give_the_tokens_each_gives_alone(atlas_llm):
    subjects = ["the moon", "bread", "a river", "chess", "rain", "a violin", "winter", "bees",
                "a lighthouse", "coffee", "maps", "volcanoes", "a library", "trains", "salt", "clocks"]
    conversations = [[{"role": "user", "content": f"Tell me one fact about {s}."}] for s in subjects]
    params = SamplingParams(temperature=0.0, max_tokens=16)
    together = [r.outputs[0].token_ids for r in atlas_llm.chat(conversations, params)]
    alone = [atlas_llm.chat(c, params)[0].outputs[0].token_ids for c in conversations]
    assert together == alone
    assert len({tuple(t) for t in together}) > 8  # different prompts, different answers
