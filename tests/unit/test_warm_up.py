"""Startup warm-up forwards (`Worker.warm_up`): the sizes a backend would tune run before traffic,
touch only the scratch pages, and change no token."""

from __future__ import annotations

import numpy as np
import pytest
from fakes import TINY_LLAMA, DictWeights, random_llama_weights
from helpers.engines import make_cache, make_worker

from atlas.adapters.mock.backend import MockGpuBackend
from atlas.domain.engine import EngineCore
from atlas.domain.models.config import ModelConfig
from atlas.domain.models.families import load_model
from atlas.domain.requests import Request, SamplingParams
from atlas.domain.scheduler import Scheduler, SchedulerConfig
from atlas.domain.step_inputs import CacheLayout, warm_up_inputs
from atlas.domain.worker import WorkerConfig

NUM_BLOCKS, BLOCK_SIZE, MAX_LEN, MAX_TOKENS = 48, 4, 40, 100


class TuningBackend(MockGpuBackend):
    """The mock, answering like a backend with a store of warm-ups: a size is unprepared
    until `record_prepared` named it under the same key (a restart keeps `recorded`)."""

    def __init__(self, recorded: set[tuple[str, int]] = frozenset()) -> None:
        super().__init__()
        self.queries: list[tuple[str, tuple[int, ...]]] = []
        self.recorded = set(recorded)

    def unprepared_token_counts(self, key, token_counts):
        self.queries.append((key, tuple(token_counts)))
        return tuple(n for n in token_counts if (key, n) not in self.recorded)

    def record_prepared(self, key, token_counts):
        self.recorded |= {(key, n) for n in token_counts}


def build(backend: MockGpuBackend, max_seqs: int = 8):
    config = ModelConfig.from_dict(TINY_LLAMA)
    model = load_model(config, DictWeights(random_llama_weights(TINY_LLAMA, 0)), backend, MAX_LEN)
    worker = make_worker(model, NUM_BLOCKS, BLOCK_SIZE, WorkerConfig(MAX_TOKENS, max_seqs, MAX_LEN))
    forwards: list[int] = []
    forward = worker._warm_up_forward

    def recording(num_tokens: int) -> None:
        forwards.append(num_tokens)
        forward(num_tokens)

    worker._warm_up_forward = recording
    scheduler = Scheduler(SchedulerConfig(MAX_LEN, 8, MAX_TOKENS, BLOCK_SIZE), make_cache(model, NUM_BLOCKS, BLOCK_SIZE, 8))
    return worker, EngineCore(scheduler, worker, MAX_LEN, config.vocab_size, frozenset()), forwards


def greedy(core: EngineCore) -> dict[str, list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    for index in range(5):
        core.add_request(Request(f"r{index}", tuple(range(3 + index, 3 + index + 7 * (index + 1))), params, seed=index))
    tokens: dict[str, list[int]] = {}
    while core.has_unfinished:
        for output in core.step():
            tokens.setdefault(output.seq_id, []).extend(output.new_token_ids)
    return tokens


def test_warm_up_runs_the_sizes_the_backend_has_no_record_of():
    backend = TuningBackend()
    worker, _, forwards = build(backend)
    assert worker.warm_up("llama") == (16, 32, 64, 100)  # the buckets of up to 100 tokens, the last 100 itself
    assert forwards == [16, 32, 64, 100]
    assert backend.queries == [("llama/8", (16, 32, 64, 100))]  # the key names the sampled rows too
    assert backend.recorded == {("llama/8", n) for n in (16, 32, 64, 100)}

    restarted = TuningBackend(recorded={("llama/8", n) for n in (16, 32, 100)})  # a store lacking 64
    worker, _, forwards = build(restarted)
    assert worker.warm_up("llama") == (64,)
    assert forwards == [64]
    assert worker.warm_up("llama") == () and forwards == [64]  # all recorded: nothing runs
    assert worker.warm_up("qwen") == (16, 32, 64, 100)  # another model's products


@pytest.mark.parametrize("max_seqs, sizes", [(1, (16, 32, 40)), (2, (16, 32, 64, 80))])
def test_warm_up_sizes_stop_at_what_the_step_buffers_hold(max_seqs, sizes):
    # max_seqs sequences of MAX_LEN (40) tokens hold fewer than MAX_TOKENS (100): a step can
    # never be larger, and a larger warm-up would need more sequences than the buffers have
    backend = TuningBackend()
    worker, _, forwards = build(backend, max_seqs)
    assert worker.warm_up("llama") == sizes
    assert forwards == list(sizes)


def test_a_backend_that_tunes_nothing_gets_no_forward():
    worker, _, forwards = build(MockGpuBackend())
    assert worker.warm_up("llama") == ()
    assert forwards == []


def test_warm_up_writes_only_scratch_pages_and_changes_no_token():
    backend = TuningBackend()
    worker, core, _ = build(backend)
    _, reference, _ = build(MockGpuBackend())
    before = [(cache.keys.copy(), cache.values.copy()) for cache in worker.caches]
    worker.warm_up("llama")
    scratch = worker.cache_layout.kv_scratch_blocks[0]
    for cache, (keys, values) in zip(worker.caches, before):
        for new, old in ((cache.keys, keys), (cache.values, values)):
            changed_slots = np.flatnonzero((new != old).any(axis=(0, 2, 3)))
            assert changed_slots.size and set((changed_slots // BLOCK_SIZE).tolist()) == {scratch}
    assert greedy(core) == greedy(reference)


def test_warm_up_inputs_split_long_sizes_into_sequences_on_the_scratch_page():
    layout = CacheLayout(block_size=4, table_width=10, kv_scratch_blocks=(7, 9), state_scratch_slots=(3,))
    inputs = warm_up_inputs(90, layout, num_sample_slots=8, max_seq_len=40)
    assert inputs.seq_lens.tolist() == [40, 40, 10]
    assert inputs.query_start_loc.tolist() == [0, 40, 80, 90]
    assert inputs.positions[:3].tolist() == [0, 1, 2] and inputs.positions[40] == 0 and inputs.positions[-1] == 9
    assert inputs.slot_mapping.shape == (2, 90)
    assert set(inputs.slot_mapping[0].tolist()) == set(range(28, 32))  # block 7's four slots, all written
    assert set(inputs.slot_mapping[1].tolist()) == set(range(36, 40))
    assert (inputs.block_tables[:, 0] == 7).all() and (inputs.block_tables[:, 1] == 9).all()
    assert inputs.state_slots.tolist() == [[3, 3, 3]]
    assert inputs.sample_indices.tolist() == list(range(8))
    assert inputs.token_gather.tolist() == list(range(8, 98))  # host tokens, past the sampled ids
    assert inputs.max_query_len == inputs.max_seq_len == 40
    with pytest.raises(ValueError):
        warm_up_inputs(0, layout, 8, 40)
