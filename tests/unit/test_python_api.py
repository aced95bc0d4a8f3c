"""The Python API: `atlas.LLM(model).generate(...)` and `.chat(...)` on a tiny model."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
from helpers.checkpoints import tiny_llama_gguf

import atlas
from atlas.adapters.weights.gguf_import import import_gguf
from atlas.domain.requests import ParameterError


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    root = tmp_path_factory.mktemp("api")
    tiny_llama_gguf(root / "tiny.gguf", np.random.default_rng(3))
    folder = import_gguf(root / "tiny.gguf", root / "model", progress=False)
    return atlas.LLM(str(folder), device="mock", show_progress=False, max_seq_len=128)


def test_importing_atlas_loads_no_engine():
    code = "import sys, atlas; assert 'numpy' not in sys.modules and 'atlas.app' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_generate_keeps_prompt_order_and_counts(llm):
    params = atlas.SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    results = llm.generate(["hello world", [5, 6, 7], "a"], params)
    assert [r.prompt for r in results] == ["hello world", None, "a"]
    assert results[1].prompt_token_ids == [5, 6, 7]
    for result in results:
        (choice,) = result.outputs
        assert len(choice.token_ids) == 6 and choice.finish_reason == "length" and result.finished
        assert choice.text == llm.tokenizer.decode(choice.token_ids)


def test_one_sampling_params_per_prompt_as_vllm_takes_them(llm):
    short = atlas.SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    long = atlas.SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
    results = llm.generate([[5, 6, 7], [5, 6, 7], "a"], [short, long, short])
    assert [len(r.outputs[0].token_ids) for r in results] == [2, 5, 2]
    assert results[1].outputs[0].token_ids[:2] == results[0].outputs[0].token_ids
    (answer,) = llm.chat([{"role": "user", "content": "hi"}], [long])
    assert len(answer.outputs[0].token_ids) == 5
    with pytest.raises(ValueError, match=r"one per prompt \(3\)"):
        llm.generate([[5], [6], [7]], [short, long])


def test_n_choices_with_a_seed_reproduce_and_differ(llm):
    params = atlas.SamplingParams(n=3, temperature=1.5, max_tokens=8, seed=11, ignore_eos=True)
    first = [c.token_ids for c in llm.generate("hello", params)[0].outputs]
    again = [c.token_ids for c in llm.generate("hello", params)[0].outputs]
    assert first == again and len({tuple(t) for t in first}) > 1


def test_chat_applies_the_template_and_logprobs_come_back(llm):
    params = atlas.SamplingParams(temperature=0.0, max_tokens=4, logprobs=2, ignore_eos=True)
    (result,) = llm.chat([{"role": "user", "content": "hi"}], params)
    assert result.prompt.startswith("<|im_start|>user\nhi<|im_end|>")
    choice = result.outputs[0]
    assert len(choice.logprobs) == 4
    for token_id, entry in zip(choice.token_ids, choice.logprobs):
        assert entry.token_id == token_id and len(entry.top) == 2 and entry.top[0][0] == token_id  # greedy


def test_a_repeated_prompt_reports_its_cached_tokens_and_a_priority_needs_the_policy(llm):
    prompt = [5 + (i % 20) for i in range(40)]  # two full blocks of 16 before the block with the last token
    params = atlas.SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    (first,) = llm.generate(prompt, params)
    (again,) = llm.generate(prompt, params)
    assert again.outputs[0].token_ids == first.outputs[0].token_ids
    assert again.num_cached_tokens == 32 and first.num_cached_tokens < 32
    with pytest.raises(ParameterError, match="--scheduling-policy priority"):
        llm.generate(prompt, params, priority=1)
    assert not llm.engine.core.has_unfinished
