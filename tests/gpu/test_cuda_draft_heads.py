"""MTP and EAGLE-3 speculative decoding on CUDA against plain decoding on CUDA.

Each case writes a small random checkpoint (a Qwen3-Next of full-attention layers whose MTP layer
predicts as the target does; a 4-layer Llama with an EAGLE-3 head predicting from its hidden
states, and a random head) and generates greedily with and without the head, through
`atlas.LLM` on the GPU: the hidden-state capture inside the target's decode graphs, the head's
own worker and graphs, and the verify steps. CUDA's kernels are not batch-invariant, so greedy
paths may part, but only at a near-tie (the gap is printed); every block comes back.

Run on a GPU machine: `python -m pytest tests/gpu/test_cuda_draft_heads.py -m gpu -s`.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "unit"))  # the unit tests' fakes

from cuda_harness import gap_where_paths_part  # noqa: E402
from fakes import random_llama_weights  # noqa: E402
from helpers.draft_heads import (  # noqa: E402
    TINY_EAGLE3,
    TINY_QWEN3_NEXT,
    bigram_target,
    copying_mtp,
    predicting_eagle3,
    random_eagle3_weights,
    random_qwen3_next_weights,
    write_qwen3_next_folder,
)

from atlas.adapters.weights.safetensors import write_safetensors  # noqa: E402
from atlas.app.bench.tiny_model import TinyModelShape, write_tiny_model  # noqa: E402
from atlas.domain.requests import SamplingParams  # noqa: E402

pytestmark = pytest.mark.gpu

BLOCK_SIZE = 16
KV_GB = 1.0
_NEAR_TIE = 0.005  # relative logit gap under which greedy paths may part (see test_models.py)
# kernel-friendly sizes: head_dim 64 (Qwen3-Next's attention rotates its first quarter)
GPU_QWEN3_NEXT = {**TINY_QWEN3_NEXT, "hidden_size": 256, "intermediate_size": 512, "num_attention_heads": 4,
                  "num_key_value_heads": 2, "head_dim": 64, "num_experts": 8, "moe_intermediate_size": 128,
                  "shared_expert_intermediate_size": 256, "partial_rotary_factor": 0.25}
GPU_LLAMA = TinyModelShape(hidden_size=256, intermediate_size=512, num_layers=4, num_heads=4, num_kv_heads=2,
                           max_position_embeddings=1024)
PROMPTS = [[int(t) for t in np.random.default_rng(seed).integers(10, 500, size=length)]
           for seed, length in enumerate((5, 17, 40, 64, 9, 120, 33, 3))]
PARAMS = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)


@pytest.fixture(scope="module")
def folders(tmp_path_factory, kernel_cache_dir):
    root = tmp_path_factory.mktemp("draft-heads")

    def copying(config, **kwargs):
        return copying_mtp(random_qwen3_next_weights(config, **kwargs), config)

    target = write_tiny_model(root / "llama", shape=GPU_LLAMA)
    llama = json.loads((target / "config.json").read_text())
    bigram, follows = bigram_target(random_llama_weights(llama, seed=4))
    write_safetensors(target / "model.safetensors", bigram)
    head_config = {**TINY_EAGLE3, "vocab_size": llama["vocab_size"], "hidden_size": 256, "intermediate_size": 512,
                   "draft_vocab_size": llama["vocab_size"] * 7 // 8, "max_position_embeddings": 1024}
    heads = {}
    for name, weights in (("predicting", predicting_eagle3(bigram, follows, head_config)),
                          ("random", random_eagle3_weights(head_config))):
        heads[name] = root / f"eagle3-{name}"
        heads[name].mkdir()
        (heads[name] / "config.json").write_text(json.dumps(head_config))
        write_safetensors(heads[name] / "model.safetensors", weights)
    return {"qwen3-next": write_qwen3_next_folder(root / "qwen3-next", copying, GPU_QWEN3_NEXT, scale=0.1),
            "llama": target, **heads}


def _llm(folder, **kwargs):
    from atlas.app.llm import LLM

    return LLM(str(folder), device="cuda", show_progress=False, max_seq_len=1024, kv_cache_gb=KV_GB, **kwargs)


def _compare_with_plain(speculative, folder) -> None:
    """Greedy tokens with the head equal plain decoding's but where paths part at a near-tie;
    both caches come back whole."""
    with_drafts = [r.outputs[0].token_ids for r in speculative.generate(PROMPTS, PARAMS)]
    stats = speculative.engine.core.stats()
    proposer = speculative.engine.core.scheduler.speculation.proposer
    assert proposer.num_free_blocks == proposer.num_blocks and stats.num_blocks_free == stats.num_blocks_total
    length = (stats.num_spec_accepted_tokens + stats.num_spec_verify_steps) / max(stats.num_spec_verify_steps, 1)
    print(f"acceptance length {length:.2f}, accepted by position {stats.spec_accepted_by_position}")
    plain = _llm(folder)
    without = [r.outputs[0].token_ids for r in plain.generate(PROMPTS, PARAMS)]
    parted = []
    for prompt, got, expected in zip(PROMPTS, with_drafts, without):
        if got != expected:
            parted.append(gap_where_paths_part(plain, prompt, got, expected, BLOCK_SIZE))
            print(f"paths part: the plain engine's best logit {parted[-1]:.2%} above the speculative choice")
    assert all(gap < _NEAR_TIE for gap in parted) and len(parted) <= 1, parted


def _spy_graphs(proposer) -> list:
    """The decode-graph bucket of each head step whose rows are all single tokens that sample
    (None: it ran eagerly; a catch-up row that samples nothing runs eagerly by design)."""
    worker = proposer.runner.worker
    buckets = []
    original = worker.execute

    def spying_execute(batch):
        if all(s.num_tokens == 1 and s.sampling is not None for s in batch.sequences):
            buckets.append(worker._graph_bucket(batch))
        return original(batch)

    worker.execute = spying_execute
    return buckets


def test_mtp_layers_draft_on_cuda_through_graphs_and_match_plain_decoding(folders):
    speculative = _llm(folders["qwen3-next"], speculative_config={"method": "mtp", "num_speculative_tokens": 3})
    buckets = _spy_graphs(speculative.engine.core.scheduler.speculation.proposer)
    _compare_with_plain(speculative, folders["qwen3-next"])
    assert buckets and all(bucket is not None for bucket in buckets)
    stats = speculative.engine.core.stats()
    assert stats.num_spec_accepted_tokens >= 0.9 * stats.num_spec_draft_tokens  # the head predicts as the target


@pytest.mark.parametrize("head", ["predicting", "random"])
def test_an_eagle3_head_drafts_on_cuda_and_matches_plain_decoding(folders, head):
    config = {"method": "eagle3", "num_speculative_tokens": 3, "model": str(folders[head])}
    speculative = _llm(folders["llama"], speculative_config=config)
    buckets = _spy_graphs(speculative.engine.core.scheduler.speculation.proposer)
    _compare_with_plain(speculative, folders["llama"])
    assert buckets and all(bucket is not None for bucket in buckets)
    stats = speculative.engine.core.stats()
    if head == "predicting":  # its first draft is the target's next token (the later ones are not)
        assert stats.spec_accepted_by_position[0] >= 0.8 * stats.num_spec_verify_steps
