"""`atlas bench`'s decode measurement on the mock: the timed window sits on the asked context."""

from __future__ import annotations

import numpy as np
import pytest
from helpers.checkpoints import tiny_llama_gguf

from atlas.adapters.weights.gguf_import import import_gguf
from atlas.app.bench.measure import kv_bytes_per_token, measure_decode, weight_bytes_per_step
from atlas.app.builder import build_engine
from atlas.app.settings import EngineSettings


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny")
    tiny_llama_gguf(root / "tiny.gguf", np.random.default_rng(0))
    folder = import_gguf(root / "tiny.gguf", root / "model", progress=False)
    return build_engine(EngineSettings(model=str(folder), device="mock", max_num_seqs=4, max_seq_len=256))


@pytest.mark.parametrize("batch, context, steps", [(1, 40, 6), (1, 33, 7), (3, 64, 8)])
def test_the_timed_steps_centre_on_the_context(engine, batch, context, steps):
    """The prompts are shortened so the timed steps' mean context is the asked one (to half a
    token, and a little over where sequences that finish prefill first decode ahead), and the
    roofline counts the KV those steps read; every KV block is free again afterwards."""
    free = engine.core.stats().num_blocks_free  # free or cached: the aborted prompts stay cached
    result = measure_decode(engine, batch, context, steps, bandwidth=1e9)
    assert context <= result.mean_context <= context + (0.5 if batch == 1 else 2.0)
    assert result.steps == steps and result.context_len == context
    expected_bytes = weight_bytes_per_step(engine) + batch * result.mean_context * kv_bytes_per_token(engine)
    assert result.roofline_step_s == pytest.approx(expected_bytes / 1e9)
    assert engine.core.stats().num_blocks_free == free
