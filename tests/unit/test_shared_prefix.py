"""The shared prefix a step's decode rows name for cascade attention (`shared_prefixes`), against a
brute-force reading of its rule, and how it reaches the step's inputs and buffers."""

from __future__ import annotations

import numpy as np
import pytest

from atlas.adapters.mock.backend import MockGpuBackend
from atlas.domain.batch import BlockTable, SamplingRow, ScheduledBatch, ScheduledSequence
from atlas.domain.step_inputs import (
    SHARED_PREFIX_MIN_ROWS,
    SHARED_PREFIX_MIN_TOKENS,
    CacheLayout,
    build_step_inputs,
    pad_decode_inputs,
    shared_prefixes,
)
from atlas.domain.step_buffers import StepBuffers

BLOCK_SIZE = 16
WIDTH = 200
SCRATCH = 9999
LAYOUT = CacheLayout(BLOCK_SIZE, WIDTH, (SCRATCH,))
ROW = SamplingRow(temperature=0.0, top_k=0, top_p=1.0, min_p=0.0, seed=0, counter=0)


def brute_force(tables: np.ndarray, query_lens: np.ndarray, seq_lens: np.ndarray, scratch: int):
    """(length in tokens, anchor, sharing rows) by trying every length: the anchor is, of the
    decode rows opening with the first block most decode rows open with (of those with a full
    block; the smallest id of a tie; not the scratch block), the first with the most full blocks
    before its newest token; a row shares L blocks if it is a decode row, L blocks lie before its
    newest token's and its first L entries are the anchor's (none the scratch block); the length
    kept saves the most reads, (sharers - 1) L."""
    decode = [s for s in range(len(seq_lens)) if query_lens[s] == 1]
    if len(decode) < SHARED_PREFIX_MIN_ROWS:
        return None
    caps = {s: (int(seq_lens[s]) - 1) // BLOCK_SIZE for s in decode}
    opened: dict[int, int] = {}
    for s in decode:
        if tables[s, 0] != scratch and caps[s] > 0:
            opened[int(tables[s, 0])] = opened.get(int(tables[s, 0]), 0) + 1
    if not opened:
        return None
    first = min(opened, key=lambda block: (-opened[block], block))
    anchor = max((s for s in decode if tables[s, 0] == first), key=lambda s: (caps[s], -s))
    best = (0, 0, [])
    for length in range(1, caps[anchor] + 1):
        if length * BLOCK_SIZE < SHARED_PREFIX_MIN_TOKENS:
            continue
        sharing = [
            s for s in decode
            if caps[s] >= length
            and all(tables[s, i] == tables[anchor, i] != scratch for i in range(length))
        ]
        if len(sharing) < SHARED_PREFIX_MIN_ROWS:
            continue
        saving = (len(sharing) - 1) * length
        if saving > best[0]:
            best = (saving, length, sharing)
    if not best[0]:
        return None
    return best[1] * BLOCK_SIZE, anchor, best[2]


def random_step(rng: np.random.Generator, num_seqs: int):
    """Tables over a few prompts of shared pages (sharing more or fewer of them), other rows,
    prefill chunks, scratch entries, contexts ending inside or past the shared pages."""
    prompts = [rng.permutation(5000)[:120] for _ in range(3)]
    tables = np.full((num_seqs, WIDTH), SCRATCH, np.int32)
    query_lens = np.ones(num_seqs, np.int32)
    seq_lens = np.zeros(num_seqs, np.int32)
    fresh = iter(range(6000, 6000 + num_seqs * WIDTH))
    for s in range(num_seqs):
        prompt = prompts[int(rng.integers(0, 3))]
        shared = int(rng.integers(0, 120))
        seq_lens[s] = int(rng.integers(1, 130 * BLOCK_SIZE))
        blocks = -(-int(seq_lens[s]) // BLOCK_SIZE)
        row = [int(prompt[i]) if i < shared else next(fresh) for i in range(blocks)]
        if rng.random() < 0.1:  # a released block (a sliding window's scratch entry)
            row[int(rng.integers(0, blocks))] = SCRATCH
        tables[s, :blocks] = row
        if rng.random() < 0.15:
            query_lens[s] = int(rng.integers(2, min(64, int(seq_lens[s])) + 2))
    return tables, query_lens, seq_lens


@pytest.mark.parametrize("seed", range(40))
def test_the_prefix_is_the_one_that_saves_the_most_reads(seed):
    rng = np.random.default_rng(seed)
    num_seqs = int(rng.integers(1, 48))
    tables, query_lens, seq_lens = random_step(rng, num_seqs)
    got = shared_prefixes(tables[:, None, :], query_lens, seq_lens, LAYOUT)
    expected = brute_force(tables, query_lens, seq_lens, SCRATCH)
    if expected is None:
        assert got is None
        return
    length, anchor, sharing = expected
    assert got is not None and got.shape == (1, num_seqs + 2)
    assert got[0, 0] == length
    assert got[0, 1] == anchor
    assert np.flatnonzero(got[0, 2:]).tolist() == sharing


def _sequence(index, block_ids, context_len, query_len=1):
    return ScheduledSequence(
        seq_id=f"s{index}",
        token_ids=tuple(range(query_len)),
        start_position=context_len - query_len,
        block_ids=tuple(block_ids),
        sampling=ROW,
    )


def _serving_step():
    """20 decode rows after a 2,048-token system prompt (128 shared pages), 3 decode rows of
    other prompts and a prefill chunk over the same system prompt."""
    system = list(range(1000, 1128))
    sequences, fresh = [], iter(range(2000, 9000))
    for i in range(20):
        context = 2048 + 32 + 7 * i
        pages = system + [next(fresh) for _ in range(-(-context // BLOCK_SIZE) - 128)]
        sequences.append(_sequence(len(sequences), pages, context))
    for _ in range(3):
        sequences.append(_sequence(len(sequences), [next(fresh) for _ in range(140)], 2200))
    sequences.append(_sequence(len(sequences), system + [next(fresh), next(fresh)], 2080, query_len=32))
    return ScheduledBatch(step_id=1, sequences=tuple(sequences), block_size=BLOCK_SIZE)


def test_a_serving_steps_decode_rows_name_their_system_prompt():
    inputs = build_step_inputs(_serving_step(), LAYOUT, 32)
    assert inputs.shared_prefix_len(0) == 2048
    flags = inputs.shared_prefix[0, 2:]
    assert flags.tolist() == [1] * 20 + [0] * 4  # not the other prompts, not the chunk
    assert flags[inputs.shared_prefix[0, 1]] == 1  # the anchor shares


def test_too_few_rows_or_too_short_a_prefix_names_none():
    batch = _serving_step()
    few = ScheduledBatch(step_id=1, sequences=batch.sequences[: SHARED_PREFIX_MIN_ROWS - 1], block_size=BLOCK_SIZE)
    assert build_step_inputs(few, LAYOUT, 32).shared_prefix is None
    short = [_sequence(i, [7, 8, 9, 100 + i, 200 + i], 60 + i) for i in range(12)]  # 48 shared tokens
    batch = ScheduledBatch(step_id=1, sequences=tuple(short), block_size=BLOCK_SIZE)
    inputs = build_step_inputs(batch, LAYOUT, 32)
    assert inputs.shared_prefix is None and inputs.shared_prefix_len(0) == 0


def test_the_page_of_a_rows_newest_token_is_never_shared():
    """Rows whose contexts end inside the shared pages share only the full pages before their
    newest token's: the one page they write this step is not in the prefix."""
    pages = list(range(100, 140))
    sequences = [_sequence(i, pages[: -(-(600 + i) // BLOCK_SIZE)], 600 + i) for i in range(10)]
    inputs = build_step_inputs(ScheduledBatch(1, tuple(sequences), BLOCK_SIZE), LAYOUT, 32)
    length = inputs.shared_prefix_len(0)
    assert length == (600 - 1) // BLOCK_SIZE * BLOCK_SIZE  # 37 pages: the 38th holds row 0's token 600
    assert all(length <= seq.start_position for seq in sequences)


def test_a_verify_steps_rows_share_only_pages_no_row_writes():
    """Speculation's verify rows (one sequence's k + 1 single-token rows over one table) write
    positions P..P+k; the prefix ends before the page of the first of them."""
    pages = list(range(300, 340))
    start = 31 * BLOCK_SIZE + 14  # the drafts cross into page 32
    rows = [_sequence(j, pages, start + j + 1) for j in range(9)]
    inputs = build_step_inputs(ScheduledBatch(1, tuple(rows), BLOCK_SIZE), LAYOUT, 32)
    assert inputs.shared_prefix_len(0) == 31 * BLOCK_SIZE
    assert inputs.shared_prefix_len(0) <= start


def test_padding_rows_of_a_graph_share_nothing():
    sequences = [_sequence(i, list(range(50, 70)) + [200 + i], 20 * BLOCK_SIZE + 3) for i in range(9)]
    inputs = build_step_inputs(ScheduledBatch(1, tuple(sequences), BLOCK_SIZE), LAYOUT, 16)
    padded = pad_decode_inputs(inputs, 16, LAYOUT, 16)
    assert padded.shared_prefix.shape == (1, 18)
    assert padded.shared_prefix[0, 2:].tolist() == [1] * 9 + [0] * 7
    assert padded.shared_prefix_len(0) == 20 * BLOCK_SIZE


def test_each_kv_group_names_its_own_prefix():
    """A second group (a sliding window's) released its early pages to the scratch block: they
    are shared by nobody there, while the full-attention group shares them."""
    layout = CacheLayout(BLOCK_SIZE, WIDTH, (SCRATCH, 8888))
    sequences = []
    for i in range(10):
        full = list(range(100, 130)) + [500 + i]
        window = BlockTable(tuple([600 + 2 * i, 601 + 2 * i]), 29)
        sequences.append(ScheduledSequence(
            seq_id=f"s{i}", token_ids=(1,), start_position=30 * BLOCK_SIZE + 2, block_ids=tuple(full),
            sampling=ROW, kv_block_tables=(BlockTable(tuple(full)), window),
        ))
    inputs = build_step_inputs(ScheduledBatch(1, tuple(sequences), BLOCK_SIZE), layout, 16)
    assert inputs.shared_prefix_len(0) == 30 * BLOCK_SIZE
    assert inputs.shared_prefix_len(1) == 0
    assert not inputs.shared_prefix[1, 2:].any()


def test_the_buffers_carry_the_prefix_and_clear_it():
    mock_backend = MockGpuBackend()
    buffers = StepBuffers(mock_backend, max_tokens=64, max_seqs=32, caches=LAYOUT)
    inputs = build_step_inputs(_serving_step(), LAYOUT, 32)
    buffers.stage_inputs(inputs)
    buffers.send()
    meta = buffers.metadata(0, inputs.num_tokens, inputs.num_seqs, inputs.max_query_len, inputs.max_seq_len,
                            inputs.shared_prefix_len(0))
    assert meta.shared_prefix_len == 2048
    np.testing.assert_array_equal(mock_backend.download(meta.shared_prefix), inputs.shared_prefix[0])
    plain = build_step_inputs(ScheduledBatch(2, _serving_step().sequences[:3], BLOCK_SIZE), LAYOUT, 32)
    buffers.stage_inputs(plain)
    buffers.send()
    assert buffers.metadata(0, 3, 3, 1, 2200).shared_prefix is None
    assert mock_backend.download(buffers.shared_prefixes[0])[0] == 0  # a graph replaying it reads no prefix


def test_a_prefix_too_small_to_pay_for_its_kernel_is_not_named():
    """Reading the prefix once must save SHARED_PREFIX_MIN_SAVED_BYTES a layer where the layout
    knows a token's bytes: a small model's verify rows (17 rows over 600 tokens, 768 bytes a
    token) do not; an 8B's (4 KB a token) do, as do 64 rows of the small model over 2,048."""
    from dataclasses import replace

    pages = list(range(300, 345))
    verify = [_sequence(j, pages, 600 + j + 1) for j in range(17)]
    batch = ScheduledBatch(1, tuple(verify), BLOCK_SIZE)
    assert build_step_inputs(batch, LAYOUT, 32).shared_prefix_len(0) == 592
    assert build_step_inputs(batch, replace(LAYOUT, kv_token_bytes=(768,)), 32).shared_prefix is None
    assert build_step_inputs(batch, replace(LAYOUT, kv_token_bytes=(4096,)), 32).shared_prefix_len(0) == 592
    system = list(range(1000, 1128))
    rows = [_sequence(i, system + [2000 + i], 2049 + i % 8) for i in range(64)]
    served = ScheduledBatch(1, tuple(rows), BLOCK_SIZE)
    assert build_step_inputs(served, replace(LAYOUT, kv_token_bytes=(768,)), 64).shared_prefix_len(0) == 2048


def _tiny_core(max_len: int = 512, num_blocks: int = 400):
    from fakes import TINY_LLAMA, DictWeights, random_llama_weights
    from helpers.engines import make_cache, make_worker

    from atlas.domain.engine import EngineCore
    from atlas.domain.models.config import ModelConfig
    from atlas.domain.models.families import load_model
    from atlas.domain.scheduler import Scheduler, SchedulerConfig
    from atlas.domain.worker import WorkerConfig

    config = ModelConfig.from_dict({**TINY_LLAMA, "max_position_embeddings": max_len})
    model = load_model(config, DictWeights(random_llama_weights(TINY_LLAMA, 1)), MockGpuBackend(), max_len)
    worker = make_worker(model, num_blocks, BLOCK_SIZE, WorkerConfig(1024, 16, max_len))
    scheduler = Scheduler(SchedulerConfig(max_len, 16, 1024, BLOCK_SIZE), make_cache(model, num_blocks, BLOCK_SIZE, 16))
    return EngineCore(scheduler, worker, max_len, config.vocab_size, frozenset())


def test_the_mock_reads_a_named_prefix_through_the_anchors_pages():
    """The mock honours the name as CUDA does (the anchor's pages for the prefix), so a row named
    wrongly reads another prompt's pages and its output moves: the engine tests below then check
    the names the scheduler's steps carry, on the CPU."""
    from atlas.adapters.mock.attention import _tables_through_shared_prefix
    from atlas.ports.kernels.attention import AttentionMetadata

    backend = MockGpuBackend()
    tables = np.array([[1, 2, 3], [1, 2, 4], [5, 6, 7]], np.int32)
    meta = AttentionMetadata(
        positions=backend.upload(np.zeros(3, np.int32)), slot_mapping=backend.upload(np.zeros(3, np.int32)),
        query_start_loc=backend.upload(np.arange(4, dtype=np.int32)),
        seq_lens=backend.upload(np.full(3, 40, np.int32)), block_tables=backend.upload(tables),
        num_tokens=3, num_seqs=3, max_query_len=1, max_seq_len=40,
        shared_prefix=backend.upload(np.array([32, 0, 1, 1, 1], np.int32)), shared_prefix_len=32,
    )
    read = _tables_through_shared_prefix(meta, BLOCK_SIZE)
    assert read.tolist() == [[1, 2, 3], [1, 2, 4], [1, 2, 7]]  # the last row was named wrongly


@pytest.mark.parametrize("n", [1, 3])
def test_greedy_output_is_the_same_with_the_prefix_named(monkeypatch, n):
    """Ten requests (and n > 1 forks) over one 300-token prompt beside three of other prompts,
    prefix caching on: their decode steps name the prompt's pages (the tiny model's bytes lifted past the rule's bar), the mock
    reads them through the anchor's table, and every token is what the steps without names give."""
    from atlas.domain import step_inputs, worker
    from atlas.domain.requests import Request, SamplingParams

    rng = np.random.default_rng(n)
    system = tuple(int(t) for t in rng.integers(0, 97, 300))
    prompts = [system + tuple(int(t) for t in rng.integers(0, 97, int(rng.integers(1, 30)))) for _ in range(10)]
    prompts[3:3] = [tuple(int(t) for t in rng.integers(0, 97, 320)) for _ in range(3)]  # other prompts
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, n=n)

    def run() -> tuple[dict[str, list[int]], int]:
        core = _tiny_core()
        named = []
        build = worker.build_step_inputs

        def spying(*args):  # the steps whose inputs name a prefix (a continued decode reuses the last one's)
            inputs = build(*args)
            named.append(inputs.shared_prefix is not None)
            return inputs

        monkeypatch.setattr(worker, "build_step_inputs", spying)
        for index, prompt in enumerate(prompts):
            core.add_request(Request(f"r{index}", prompt, params, seed=index))
        tokens: dict[str, list[int]] = {}
        while core.has_unfinished:
            for output in core.step():
                tokens.setdefault(output.seq_id, []).extend(output.new_token_ids)
        return tokens, sum(named)

    monkeypatch.setattr(step_inputs, "SHARED_PREFIX_MIN_SAVED_BYTES", 0)
    named_tokens, named_steps = run()
    monkeypatch.setattr(step_inputs, "SHARED_PREFIX_MIN_ROWS", 10**6)
    plain_tokens, plain_steps = run()
    assert named_steps >= 8 and plain_steps == 0
    assert named_tokens == plain_tokens
