"""Steps with prompt tokens replayed as the layers' pieces: token rows padded to a bucket, the
projections and feed-forwards captured per bucket, attention run between them for the step's
own sequences. On the mock (`emulate_pieces`) a replay re-runs the capture-time code with each
cut's attention taking the replayed step, so what is checked here is the worker's plumbing:
padding, buckets, deferral, and outputs equal to eager steps'."""

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
from atlas.domain.step_inputs import CacheLayout, HostStepInputs, pad_prefill_inputs, piece_buckets, warm_up_inputs
from atlas.domain.worker import WorkerConfig

NUM_BLOCKS, BLOCK_SIZE, MAX_LEN = 96, 4, 64


def build(pieces: bool, piece_max_tokens: int = 64, up_to: int | None = None, whole_prompt_keys: int = 1023,
          graph_batch_sizes: tuple[int, ...] = (1, 2, 4, 8)):
    config = ModelConfig.from_dict(TINY_LLAMA)
    backend = MockGpuBackend(emulate_graphs=True, emulate_pieces=pieces, whole_prompt_keys=whole_prompt_keys)
    model = load_model(config, DictWeights(random_llama_weights(TINY_LLAMA, 0)), backend, MAX_LEN)
    worker_config = WorkerConfig(64, 8, MAX_LEN, graph_batch_sizes=graph_batch_sizes, piece_max_tokens=piece_max_tokens)
    worker = make_worker(model, NUM_BLOCKS, BLOCK_SIZE, worker_config)
    worker.capture_graphs(up_to)
    scheduler = Scheduler(SchedulerConfig(MAX_LEN, 8, 64, BLOCK_SIZE), make_cache(model, NUM_BLOCKS, BLOCK_SIZE, 8))
    return worker, EngineCore(scheduler, worker, MAX_LEN, config.vocab_size, frozenset())


def record_pieces(worker, kinds: list[str] | None = None) -> list[int | None]:
    """The token rows of each step that replays pieces (None: a step that did not); `kinds`
    collects each such step's "whole" or "pieces" (the layers captured whole or cut at attention)."""
    replays: list[int | None] = []
    forward = worker.model.forward
    capture = worker.model.capture_layers
    whole_graphs: set[int] = set()

    def capturing(step, caches, workspace, whole=False):
        graph = capture(step, caches, workspace, whole)
        if whole:
            whole_graphs.add(id(graph))
        return graph

    def recording(step, caches, workspace, num_sample_rows, observer=None, layers=None):
        replays.append(step.num_tokens if layers is not None else None)
        if kinds is not None and layers is not None:
            kinds.append("whole" if id(layers) in whole_graphs else "pieces")
        return forward(step, caches, workspace, num_sample_rows, observer, layers)

    worker.model.forward = recording
    worker.model.capture_layers = capturing
    return replays


def run(core: EngineCore, staggered: bool = True, first: int = 3) -> dict[str, list[int]]:
    """Greedy tokens of six requests of different prompt lengths (ids from `first`: a second
    run with other ids misses the prefix cache); `staggered` adds two after the first steps,
    so their prompts share steps with the others' decodes."""
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    prompts = [tuple(range(first + index, first + index + 5 + 4 * index)) for index in range(6)]
    for index, prompt in enumerate(prompts[:4] if staggered else prompts):
        core.add_request(Request(f"r{index}", prompt, params, seed=index))
    tokens: dict[str, list[int]] = {}
    steps = 0
    while core.has_unfinished:
        for output in core.step():
            tokens.setdefault(output.seq_id, []).extend(output.new_token_ids)
        steps += 1
        if staggered and steps == 3:
            for index in (4, 5):
                core.add_request(Request(f"r{index}", prompts[index], params, seed=index))
    return tokens


def test_piece_buckets_pad_by_16_then_by_64():
    assert piece_buckets(512) == (16, 32, 48, 64, 80, 96, 112, 128, 192, 256, 320, 384, 448, 512)
    assert piece_buckets(100) == (16, 32, 48, 64, 80, 96)
    assert piece_buckets(8) == ()


def test_padding_rows_write_only_scratch_slots_and_join_no_sequence():
    layout = CacheLayout(block_size=4, table_width=16, kv_scratch_blocks=(90, 91), state_scratch_slots=(),
                         snapshot_width=0, kv_token_bytes=(8, 8))
    inputs = warm_up_inputs(13, layout, num_sample_slots=8, max_seq_len=64)
    padded = pad_prefill_inputs(inputs, 32, layout, num_sample_slots=8)
    assert padded.num_tokens == 32 and padded.num_seqs == inputs.num_seqs
    np.testing.assert_array_equal(padded.token_ids[13:], 0)
    np.testing.assert_array_equal(padded.positions[13:], 0)
    np.testing.assert_array_equal(padded.slot_mapping[:, 13:], [[90 * 4] * 19, [91 * 4] * 19])
    np.testing.assert_array_equal(padded.token_gather, np.arange(8, 8 + 32))
    for name in ("query_start_loc", "seq_lens", "block_tables", "sample_indices"):
        np.testing.assert_array_equal(getattr(padded, name), getattr(inputs, name))
    assert pad_prefill_inputs(inputs, 13, layout, 8) is inputs
    with pytest.raises(ValueError):
        pad_prefill_inputs(inputs, 12, layout, 8)
    recurrent = CacheLayout(block_size=4, table_width=16, kv_scratch_blocks=(90,), state_scratch_slots=(5,),
                            snapshot_width=0, kv_token_bytes=(8,))
    with pytest.raises(ValueError):
        pad_prefill_inputs(HostStepInputs.empty(recurrent), 16, recurrent, 8)


def test_prompt_steps_replay_pieces_and_give_the_eager_steps_tokens():
    worker, core = build(pieces=True)
    replays = record_pieces(worker)
    piecewise = run(core)
    _, eager = build(pieces=False)
    assert piecewise == run(eager)
    replayed = [rows for rows in replays if rows is not None]
    assert replayed and set(replayed) <= set(worker.piece_buckets)
    # the staggered prompts shared steps with decodes: some replays padded a mixed step
    assert worker.num_piece_graphs == len(set(replayed))


def test_a_server_defers_the_pieces_to_idle_time_and_runs_eagerly_until_then():
    worker, core = build(pieces=True, up_to=2)
    replays = record_pieces(worker)
    before = run(core, staggered=False)
    assert worker.num_piece_graphs == 0 and set(replays) == {None}
    while worker.capture_next_graph():
        pass
    assert worker.num_piece_graphs == len(worker.piece_buckets)
    replays.clear()
    after = run(core, staggered=False, first=40)
    assert any(rows is not None for rows in replays)
    _, eager = build(pieces=False)
    assert run(eager, staggered=False) == before and run(eager, staggered=False, first=40) == after


def test_no_bucket_holds_more_tokens_than_a_step_can():
    """8 sequences of at most 20 tokens: a server's idle capture of every bucket stops at 160."""
    config = ModelConfig.from_dict(TINY_LLAMA)
    backend = MockGpuBackend(emulate_graphs=True, emulate_pieces=True)
    model = load_model(config, DictWeights(random_llama_weights(TINY_LLAMA, 0)), backend, 20)
    worker = make_worker(model, NUM_BLOCKS, BLOCK_SIZE, WorkerConfig(512, 8, 20, graph_batch_sizes=(1, 2),
                                                                      piece_max_tokens=512))
    assert worker.piece_buckets[-1] == 128  # 160 tokens at most: buckets of 16 to 128
    worker.capture_graphs(up_to=1)
    while worker.capture_next_graph():
        pass
    assert worker.num_piece_graphs == len(worker.piece_buckets)


def test_steps_past_the_limit_and_models_without_pieces_run_eagerly():
    worker, core = build(pieces=True, piece_max_tokens=16)
    replays = record_pieces(worker)
    core.add_request(Request("long", tuple(range(3, 43)), SamplingParams(temperature=0.0, max_tokens=2), seed=0))
    while core.has_unfinished:
        core.step()
    assert replays[0] is None  # 40 prompt tokens: past the 16 rows the worker captures
    worker, _ = build(pieces=False)
    assert worker.piece_buckets == ()


def run_alone(core: EngineCore, prompts: list[tuple[int, ...]], max_tokens: int = 6) -> list[list[int]]:
    """Greedy tokens of each prompt, one request at a time (its prompt steps are lone steps)."""
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    outputs = []
    for index, prompt in enumerate(prompts):
        core.add_request(Request(f"alone{index}", prompt, params, seed=index))
        tokens: list[int] = []
        while core.has_unfinished:
            for output in core.step():
                tokens.extend(output.new_token_ids)
        outputs.append(tokens)
    return outputs


def test_a_lone_sequence_prompt_over_a_short_context_replays_its_layers_whole():
    """One request at a time: prompt steps whose bucket and context fit `whole_prompt_keys` (40
    here) replay the layers captured whole, attention inside and launched for the capture's one
    sequence of the bucket's length; a longer prompt, or a short one after a long cached
    prefix, replays the pieces. Tokens equal eager steps' (a whole replay that served a step it
    does not fit, or read the capture's lengths, would attend over the wrong keys)."""
    shared, long_shared = tuple(range(50, 66)), tuple(range(40, 80))  # cached once computed
    prompts = [
        tuple(range(3, 8)), tuple(range(9, 26)),  # 5 and 17 tokens: buckets 16 and 32
        shared + (3, 4), shared + (5, 6, 7, 8, 9, 10),  # the second: 6 new tokens over 22 keys
        tuple(range(7, 42)),  # 35 tokens: bucket 48
        long_shared + (1,), long_shared + (2, 3, 4),  # 3 new tokens over 43 keys
    ]
    worker, core = build(pieces=True, whole_prompt_keys=40)
    kinds: list[str] = []
    record_pieces(worker, kinds)
    whole = run_alone(core, prompts)
    _, eager = build(pieces=False)
    assert whole == run_alone(eager, prompts)
    assert kinds == ["whole"] * 4 + ["pieces"] * 3
    assert worker.num_whole_graphs == 2 and worker.num_piece_graphs == 2  # whole 16, 32; pieces 16, 48


def test_a_server_captures_the_whole_layers_in_idle_time_after_the_pieces():
    worker, core = build(pieces=True, up_to=2, whole_prompt_keys=40)
    kinds: list[str] = []
    record_pieces(worker, kinds)
    prompts = [tuple(range(3, 10)), tuple(range(11, 30))]
    before = run_alone(core, prompts)
    assert kinds == []  # every bucket deferred: eager until idle time
    while worker.capture_next_graph():
        pass
    assert worker.num_piece_graphs == len(worker.piece_buckets)
    assert worker.num_whole_graphs == len([rows for rows in worker.piece_buckets if rows <= 40])
    after = run_alone(core, [tuple(range(60, 67)), tuple(range(70, 89))])
    assert kinds == ["whole", "whole"]
    _, eager = build(pieces=False)
    assert run_alone(eager, prompts) == before
    assert run_alone(eager, [tuple(range(60, 67)), tuple(range(70, 89))]) == after


def test_a_lone_one_token_step_never_replays_the_whole_layers():
    """Without decode graphs a lone decode step takes the pieces' path too; CUDA's prefill kernel
    leaves single-token queries to the decode kernel, which a whole capture (of a step of many
    tokens) does not hold, so such a step must replay the pieces, never the whole layers."""
    worker, core = build(pieces=True, graph_batch_sizes=())
    kinds: list[str] = []
    replays = record_pieces(worker, kinds)
    run_alone(core, [tuple(range(3, 12))], max_tokens=4)
    assert [rows for rows in replays if rows is not None] == [16] * 4  # (None: a capture's warm-up forward)
    assert kinds == ["whole", "pieces", "pieces", "pieces"]
