"""A worker that keeps layer outputs (`WorkerConfig.keep_hidden_layers`) hands back, with each
step's sampled ids, the residual stream after those layers for every token of the step, in
batch order: the same rows an observer of the forward sees, eager or replayed from a graph."""

from __future__ import annotations

import numpy as np
import pytest
from fakes import TINY_LLAMA, DictWeights, random_llama_weights
from helpers.engines import make_worker

from atlas.adapters.mock.backend import MockGpuBackend
from atlas.domain.batch import SamplingRow, ScheduledBatch, ScheduledSequence
from atlas.domain.models.config import ModelConfig
from atlas.domain.models.families import load_model
from atlas.domain.worker import WorkerConfig

GREEDY = SamplingRow(temperature=0.0, top_k=0, top_p=1.0, min_p=0.0, seed=0, counter=0)
MAX_LEN = 64


def workers(keep, graph_sizes=()):
    backend = MockGpuBackend(emulate_graphs=bool(graph_sizes))
    model = load_model(ModelConfig.from_dict(TINY_LLAMA), DictWeights(random_llama_weights(TINY_LLAMA, 0)), backend,
                       MAX_LEN)
    keeping = make_worker(model, 16, 4, WorkerConfig(32, 8, MAX_LEN, graph_sizes, keep))
    reference = make_worker(model, 16, 4, WorkerConfig(32, 8, MAX_LEN))
    return keeping, reference


def observed(worker, batch, layers):
    """What an observer of the forward sees after each of `layers`, side by side."""
    seen = {}

    def observe(index, residual):
        seen[index] = worker.backend.download(residual).astype(np.float32).copy()

    worker.compute_logits(batch, observe)
    return np.concatenate([seen[layer] for layer in layers], axis=1)


PREFILL = ScheduledBatch(0, (ScheduledSequence("a", (5, 6, 7, 8, 9), 0, (0, 1), GREEDY),
                             ScheduledSequence("b", (11, 12, 13), 0, (2,), None)), 4)
DECODE = ScheduledBatch(1, (ScheduledSequence("a", (3,), 5, (0, 1), GREEDY),
                            ScheduledSequence("b", (4,), 3, (2,), GREEDY)), 4)


@pytest.mark.parametrize("keep", [(1,), (0, 1)], ids=["last", "both"])
def test_the_kept_layers_outputs_of_every_token_come_back_with_the_ids(keep):
    keeping, reference = workers(keep)
    result = keeping.execute(PREFILL)
    assert result.hidden_states.shape == (8, 64 * len(keep)) and result.hidden_states.dtype == np.float32
    np.testing.assert_allclose(result.hidden_states, observed(reference, PREFILL, keep), rtol=1e-5, atol=1e-5)
    assert np.abs(result.hidden_states).max() > 0.1


def test_a_decode_step_replayed_from_a_graph_keeps_them_too():
    keeping, reference = workers((1,), graph_sizes=(1, 2, 4))
    keeping.capture_graphs()
    keeping.execute(PREFILL)
    reference.execute(PREFILL)
    result = keeping.execute(DECODE)
    np.testing.assert_allclose(result.hidden_states, observed(reference, DECODE, (1,)), rtol=1e-5, atol=1e-5)


def test_a_worker_keeping_nothing_hands_back_none_and_a_missing_layer_is_refused():
    keeping, reference = workers(())
    assert keeping.execute(PREFILL).hidden_states is None
    with pytest.raises(ValueError, match="keep_hidden_layers \\[2\\]"):
        workers((2,))
