"""Folding RMSNorm weights into the projections they feed (`fold_norm_weights`), on the mock.

The mock itself never folds (it keeps the reference's rounding); `FoldingMock` folds as the CUDA
backend does for wide rows, so the model side (which norms go, which stay) is checked here and
the CUDA kernels against the mock in tests/gpu.
"""

from __future__ import annotations

import numpy as np
import pytest
from fakes import TINY_LLAMA, DictWeights, random_llama_weights

from atlas.adapters.mock.backend import MockGpuBackend
from atlas.adapters.mock.tensor import MockTensor
from atlas.domain.batch import SamplingRow, ScheduledBatch, ScheduledSequence
from atlas.domain.models.config import ModelConfig
from atlas.domain.models.families import load_model
from atlas.domain.worker import Worker, WorkerConfig
from atlas.ports.gpu import DType, KvCacheSpec

GREEDY = SamplingRow(temperature=0.0, top_k=0, top_p=1.0, min_p=0.0, seed=0, counter=0)


class FoldingMock(MockGpuBackend):
    """Folds every norm weight it is offered: weight[:, k] *= norm_weight[k], rounded once."""

    def __init__(self) -> None:
        super().__init__(activation_dtype=DType.F32)
        self.folded: list[tuple[int, ...]] = []

    def fold_rmsnorm(self, norm_weight: MockTensor, weight: MockTensor) -> bool:
        weight.data[...] = weight.as_f32() * norm_weight.as_f32()
        self.folded.append(weight.shape)
        return True


def _logits(backend: MockGpuBackend, config_dict: dict, prompt: list[int]):
    config = ModelConfig.from_dict(config_dict)
    model = load_model(config, DictWeights(random_llama_weights(config_dict, seed=3)), backend, 256)
    spec = KvCacheSpec(config.num_layers, 16, 4, config.num_kv_heads, config.head_dim, DType.F32)
    worker = Worker(backend, model, backend.allocate_kv_cache(spec), WorkerConfig(64, 4, 256))
    sequence = ScheduledSequence("s", tuple(prompt), 0, tuple(range(-(-len(prompt) // 4))), GREEDY)
    return model, worker.compute_logits(ScheduledBatch(0, (sequence,), 4))[0]


@pytest.mark.parametrize("tied", [False, True])
def test_folded_norms_give_the_same_logits(tied):
    """Each layer's two norms go into qkv and gate_up; the final norm into lm_head unless lm_head
    is the (tied) embedding, which the lookup reads unscaled. The logits move by bf16 rounding
    only (the folded weight is rounded once more)."""
    config = dict(TINY_LLAMA, tie_word_embeddings=tied)
    prompt = [5, 17, 3, 88, 42, 9]
    _, expected = _logits(MockGpuBackend(activation_dtype=DType.F32), config, prompt)
    backend = FoldingMock()
    model, logits = _logits(backend, config, prompt)
    assert all(layer.input_norm is None and layer.post_attention_norm is None for layer in model.layers)
    assert (model.final_norm is None) == (not tied)
    hidden, vocab = config["hidden_size"], config["vocab_size"]
    assert backend.folded.count((vocab, hidden)) == (0 if tied else 1)
    relative = np.linalg.norm(logits - expected) / np.linalg.norm(expected)
    assert 0 < relative < 1e-2


def test_mock_rmsnorm_linear_without_a_norm_weight_is_the_folded_product(rng):
    backend = MockGpuBackend(activation_dtype=DType.F32)
    x = rng.standard_normal((3, 32)).astype(np.float32)
    norm = (1 + 0.3 * rng.standard_normal(32)).astype(np.float32)
    weight = rng.standard_normal((8, 32)).astype(np.float32)
    outs = [backend.empty((3, 8), DType.F32) for _ in range(2)]
    normed = backend.empty((3, 32), DType.F32)
    backend.rmsnorm_linear(backend.upload(x), backend.upload(norm), 1e-6, backend.upload(weight), outs[0], normed)
    backend.rmsnorm_linear(backend.upload(x), None, 1e-6, backend.upload(weight * norm), outs[1], normed)
    np.testing.assert_allclose(backend.download(outs[1]), backend.download(outs[0]), rtol=1e-5, atol=1e-5)
    assert not backend.fold_rmsnorm(backend.upload(norm), backend.upload(weight))


class AddingMock(MockGpuBackend):
    """Never defers an output projection's add (as CUDA's GEMV sizes), and counts the deferrals
    it was offered."""

    def __init__(self) -> None:
        super().__init__(activation_dtype=DType.BF16)
        self.offered = 0

    def linear_add(self, x, weight, residual, scratch, defer: bool = False) -> bool:
        self.offered += defer
        return super().linear_add(x, weight, residual, scratch)


@pytest.mark.parametrize("start", [0, 6])  # a prefill (sample rows gathered), a decode step (none)
def test_a_deferred_residual_add_gives_the_same_logits(start):
    """linear_add(defer=True) leaves the product for the next norm (`add_first`); the logits
    match the add done at once bit for bit, the last layer's included (deferred into the final
    norm on a decode step, not past a gather of the sample rows)."""
    prompt = [5, 17, 3, 88, 42, 9, 61][start:]
    sequence = ScheduledSequence("s", tuple(prompt), start, (0, 1), GREEDY)
    results = []
    for backend in (AddingMock(), MockGpuBackend(activation_dtype=DType.BF16)):
        config = ModelConfig.from_dict(TINY_LLAMA)
        model = load_model(config, DictWeights(random_llama_weights(TINY_LLAMA, seed=3)), backend, 256)
        spec = KvCacheSpec(config.num_layers, 16, 4, config.num_kv_heads, config.head_dim, DType.BF16)
        worker = Worker(backend, model, backend.allocate_kv_cache(spec), WorkerConfig(64, 4, 256))
        results.append(worker.compute_logits(ScheduledBatch(0, (sequence,), 4))[0])
        if isinstance(backend, AddingMock):
            layers = config.num_layers
            assert backend.offered == (2 * layers if start else 2 * layers - 1)
    np.testing.assert_array_equal(results[1], results[0])
