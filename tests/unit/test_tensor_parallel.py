"""Tensor and expert parallelism on the mock: every rank of 2 or 4 gives the logits one device
gives, within float32 rounding, bit for bit the same on every rank; for the tiny Llama through
its loader and for a hybrid with every layer kind (MoE included) built from the kinds."""

from __future__ import annotations

import numpy as np
import pytest

from atlas.adapters.comm.harness import run_ranks
from atlas.adapters.mock.backend import MockGpuBackend
from atlas.domain.parallel import RankPlacement
from fakes import TINY_LLAMA, random_llama_weights
from helpers.parallel_models import (
    HybridShape,
    hybrid_model,
    hybrid_rank_model,
    llama_model,
    run_batch,
    run_prompt_and_decodes,
)

LLAMA = dict(TINY_LLAMA, vocab_size=96)  # heads 4, KV heads 2: 4 ranks replicate each KV head
PROMPT_LEN = 9


def _close(got: np.ndarray, expected: np.ndarray) -> None:
    relative = np.linalg.norm(got - expected) / np.linalg.norm(expected)
    assert relative < 2e-6, relative
    assert (got.argmax(axis=1) == expected.argmax(axis=1)).all()


def _on_ranks(world: int, build, run, expert_parallel: int = 1) -> np.ndarray:
    def rank_main(comm):
        backend = MockGpuBackend()
        placement = RankPlacement(comm.rank, world, expert_parallel)
        return run(backend, build(backend, comm, placement))

    results = run_ranks(world, rank_main, timeout_s=120)
    for other in results[1:]:
        np.testing.assert_array_equal(other, results[0])  # every rank holds the same logits
    return results[0]


@pytest.mark.parametrize("world", [2, 4])
def test_a_llama_on_2_and_4_ranks_decodes_the_logits_of_one_device(rng, world):
    tensors = random_llama_weights(LLAMA, seed=1)
    tokens = [int(t) for t in rng.integers(0, LLAMA["vocab_size"], size=PROMPT_LEN + 3)]

    def run(backend, model):
        return run_prompt_and_decodes(backend, model, tokens, PROMPT_LEN)

    backend = MockGpuBackend()
    expected = run(backend, llama_model(backend, LLAMA, tensors))
    got = _on_ranks(world, lambda backend, comm, placement: llama_model(backend, LLAMA, tensors, comm, placement), run)
    _close(got, expected)


@pytest.mark.parametrize(("world", "expert_parallel"), [(2, 1), (4, 1), (2, 2), (4, 2), (4, 4)])
def test_a_hybrid_with_moe_on_ranks_gives_the_logits_of_one_device(rng, world, expert_parallel):
    tokens = [int(t) for t in rng.integers(0, HybridShape().vocab_size, size=PROMPT_LEN + 3)]

    def run(backend, model):
        return np.concatenate([run_prompt_and_decodes(backend, model, tokens, PROMPT_LEN),
                               run_batch(backend, model, tokens[:5])])

    backend = MockGpuBackend()
    expected = run(backend, hybrid_model(backend))
    got = _on_ranks(world, lambda backend, comm, placement: hybrid_rank_model(backend, comm, placement), run,
                    expert_parallel)
    _close(got, expected)
