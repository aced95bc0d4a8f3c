"""The mock-backed model against transformers, family by family, on random weights."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

from fakes import DictWeights  # noqa: E402
from helpers.engines import make_worker as worker_over  # noqa: E402
from tiny_models import build_reference, reference_logits, tiny_config  # noqa: E402

from atlas.adapters.mock.backend import MockGpuBackend  # noqa: E402
from atlas.domain.batch import BlockTable, SamplingRow, ScheduledBatch, ScheduledSequence  # noqa: E402
from atlas.domain.models.cache_groups import kv_group_indices  # noqa: E402
from atlas.domain.models.config import ModelConfig  # noqa: E402
from atlas.domain.models.families import kv_cache_scales, load_model  # noqa: E402
from atlas.domain.worker import WorkerConfig  # noqa: E402
from atlas.ports.gpu import DType  # noqa: E402

pytestmark = pytest.mark.oracle

BLOCK_SIZE = 4
NUM_BLOCKS = 200
GREEDY = SamplingRow(temperature=0.0, top_k=0, top_p=1.0, min_p=0.0, seed=0, counter=0)


def make_worker(config_dict, tensors, pieces: bool = False):
    """`pieces`: steps with prompt tokens replay the layers' pieces (padded to a bucket,
    attention between them; `Worker.piece_buckets`) where the family's layers allow it."""
    config = ModelConfig.from_dict(config_dict)
    backend = MockGpuBackend(emulate_pieces=pieces)
    model = load_model(config, DictWeights(tensors), backend, max_positions=config.max_position_embeddings)
    worker_config = WorkerConfig(512, 16, config.max_position_embeddings, piece_max_tokens=512 if pieces else 0)
    return worker_over(model, NUM_BLOCKS, BLOCK_SIZE, worker_config)


class BlockAllocator:
    """Hands out deliberately scattered block ids so paging bugs cannot hide."""

    def __init__(self, rng):
        self.free = list(rng.permutation(NUM_BLOCKS))

    def take(self, count):
        taken, self.free = self.free[:count], self.free[count:]
        return [int(b) for b in taken]


def scheduled(worker, seq_id, token_ids, start, block_ids, sampling):
    """A sequence's share of a step holding the same page ids in every KV group of the model
    (each group has its own cache of NUM_BLOCKS pages; no page leaves a window here)."""
    tables = tuple(BlockTable(tuple(block_ids)) for _ in kv_group_indices(worker.model.cache_groups))
    return ScheduledSequence(seq_id, tuple(token_ids), start, tuple(block_ids), sampling,
                             kv_block_tables=tables if len(tables) > 1 else ())


def relative_error(ours, reference):
    return float(np.linalg.norm(ours - reference) / np.linalg.norm(reference))


@pytest.mark.parametrize(
    "family",
    [
        "llama3", "smollm2", "llama_bias", "mistral", "qwen2", "qwen3", "qwen3_window", "yarn", "linear", "qwen3_moe",
        "gemma3", "gpt_oss",
    ],
)
@pytest.mark.parametrize("pieces", [False, True], ids=["eager", "pieces"])
def test_mixed_batch_matches_transformers(family, pieces, rng):
    config = tiny_config(family)
    reference, tensors = build_reference(config)
    worker = make_worker(config, tensors, pieces)
    blocks = BlockAllocator(rng)
    prompts = [list(rng.integers(0, config["vocab_size"], size=n)) for n in (1, 7, 100)]
    sequences = []
    for index, prompt in enumerate(prompts):
        block_ids = blocks.take(-(-len(prompt) // BLOCK_SIZE))
        sequences.append(scheduled(worker, f"s{index}", [int(t) for t in prompt], 0, block_ids, GREEDY))
    logits = worker.compute_logits(ScheduledBatch(0, tuple(sequences), BLOCK_SIZE))
    assert worker.num_piece_graphs == (1 if pieces and worker.model.has_pieces else 0)
    for row, prompt in enumerate(prompts):
        expected = reference_logits(reference, [int(t) for t in prompt])[-1]
        assert relative_error(logits[row], expected) < 1e-4, (family, len(prompt))


@pytest.mark.parametrize("family", ["llama3", "mistral", "qwen3", "qwen3_window", "qwen3_moe", "gemma3", "gpt_oss"])
@pytest.mark.parametrize("pieces", [False, True], ids=["eager", "pieces"])
def test_chunked_prefill_then_decode_matches_transformers(family, pieces, rng):
    """A prompt computed in three chunks, then decodes, each step in a batch with a stranger."""
    config = tiny_config(family)
    reference, tensors = build_reference(config, seed=1)
    worker = make_worker(config, tensors, pieces)
    blocks = BlockAllocator(rng)
    tokens = [int(t) for t in rng.integers(0, config["vocab_size"], size=103)]
    expected = reference_logits(reference, tokens)
    stranger = [int(t) for t in rng.integers(0, config["vocab_size"], size=9)]
    stranger_blocks = blocks.take(8)
    table: list[int] = []
    chunks = [(0, 37), (37, 77), (77, 100), (100, 101), (101, 102), (102, 103)]
    for step, (start, stop) in enumerate(chunks):
        needed = -(-stop // BLOCK_SIZE)
        table += blocks.take(needed - len(table))
        samples = stop == 100 or stop > 100
        target = scheduled(worker, "target", tokens[start:stop], start, table, GREEDY if samples else None)
        other = scheduled(worker, "other", stranger, 0, stranger_blocks, GREEDY)
        batch = ScheduledBatch(step, (other, target), BLOCK_SIZE)
        logits = worker.compute_logits(batch)
        if samples:
            assert relative_error(logits[1], expected[stop - 1]) < 1e-4, (family, start, stop)
    assert bool(worker.num_piece_graphs) == (pieces and worker.model.has_pieces)


@pytest.mark.parametrize("family", ["llama3", "qwen3"])
def test_fp8_kv_cache_stays_within_e4m3_precision_of_transformers(family, rng):
    """The same batch over an FP8 cache (per-layer scales from the checkpoint's k_scale and
    v_scale): logits within E4M3's rounding of transformers', and the top token kept."""
    config = tiny_config(family)
    reference, tensors = build_reference(config)
    num_layers = config["num_hidden_layers"]
    scales = {}
    for layer in range(num_layers):
        scales[f"model.layers.{layer}.self_attn.k_scale"] = np.array(0.02 * (layer + 1), np.float32)
        scales[f"model.layers.{layer}.self_attn.v_scale"] = np.array([0.01], np.float32)
    weights = DictWeights({**tensors, **scales})
    model_config = ModelConfig.from_dict(config)
    kv_scales = kv_cache_scales(model_config, weights)
    assert kv_scales[1] == (pytest.approx(0.04), pytest.approx(0.01))
    backend = MockGpuBackend()
    model = load_model(model_config, weights, backend, max_positions=model_config.max_position_embeddings)
    worker = worker_over(model, NUM_BLOCKS, BLOCK_SIZE, WorkerConfig(512, 16, 512), DType.FP8_E4M3, kv_scales)
    blocks = BlockAllocator(rng)
    prompts = [list(rng.integers(0, config["vocab_size"], size=n)) for n in (1, 7, 60)]
    sequences = [
        scheduled(worker, f"s{i}", [int(t) for t in p], 0, blocks.take(-(-len(p) // BLOCK_SIZE)), GREEDY)
        for i, p in enumerate(prompts)
    ]
    logits = worker.compute_logits(ScheduledBatch(0, tuple(sequences), BLOCK_SIZE))
    for row, prompt in enumerate(prompts):
        expected = reference_logits(reference, [int(t) for t in prompt])[-1]
        error = relative_error(logits[row], expected)
        assert 1e-4 < error < 0.1, (family, len(prompt), error)  # 3-7% at these tiny head dims
        assert int(np.argmax(logits[row])) == int(np.argmax(expected))


def test_kv_cache_scales_default_to_one_and_reject_bad_tensors():
    config = ModelConfig.from_dict(tiny_config("llama3"))
    assert kv_cache_scales(config, DictWeights({})) == ((1.0, 1.0),) * config.num_layers
    both = DictWeights({"model.layers.0.self_attn.kv_scale": np.array(2.0, np.float32)})
    assert kv_cache_scales(config, both)[0] == (2.0, 2.0)
    bad = DictWeights({"model.layers.1.self_attn.v_scale": np.array([0.0], np.float32)})
    with pytest.raises(ValueError, match="self_attn.v_scale"):
        kv_cache_scales(config, bad)


def test_a_sliding_window_model_serves_from_released_blocks_and_graphs_as_transformers_does(rng):
    """Mistral's window of 24 is a sliding-window cache group: each sequence holds only the
    blocks its window reads (released ones are scratch entries of its table), decodes replay a
    padded graph, and the logprobs of 40 greedy tokens stay within 1e-3 of transformers'."""
    from helpers.engines import make_cache

    from atlas.domain.engine import EngineCore
    from atlas.domain.requests import Request, SamplingParams
    from atlas.domain.scheduler import Scheduler, SchedulerConfig
    from tiny_models import teacher_forced_gap

    config = tiny_config("mistral")
    reference, tensors = build_reference(config, seed=2)
    model = load_model(ModelConfig.from_dict(config), DictWeights(tensors), MockGpuBackend(emulate_graphs=True), 256)
    worker = worker_over(model, NUM_BLOCKS, BLOCK_SIZE, WorkerConfig(64, 4, 256, graph_batch_sizes=(4,)))
    cache = make_cache(model, NUM_BLOCKS, BLOCK_SIZE, 4, prefix_caching=False)
    core = EngineCore(Scheduler(SchedulerConfig(256, 4, 64, BLOCK_SIZE), cache), worker, 256, config["vocab_size"], frozenset())
    prompts = [[int(t) for t in rng.integers(0, config["vocab_size"], size=n)] for n in (50, 30, 70)]
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True, logprobs=0)
    for index, prompt in enumerate(prompts):
        core.add_request(Request(f"r{index}", tuple(prompt), params, seed=index))
    tokens, logprobs, peak = {}, {}, 0
    while core.has_unfinished:
        for output in core.step():
            tokens.setdefault(output.seq_id, []).extend(output.new_token_ids)
            logprobs.setdefault(output.seq_id, []).extend(output.logprobs)
        core.scheduler.check_invariants()
        peak = max(peak, cache.groups[0].pool.num_used_blocks)
    # full attention would hold (90 + 70 + 110) / 4 = 68 blocks at the end; the windows hold at
    # most what the memory plan gives a window: 7 blocks of 4 a sequence (ceil(23 / 4) + 1) and
    # one step's 64 new tokens
    assert peak <= 3 * 7 + 64 // 4, peak
    for index, prompt in enumerate(prompts):
        assert teacher_forced_gap(reference, prompt, tokens[f"r{index}"], logprobs[f"r{index}"]) < 1e-3


@pytest.mark.parametrize("family", ["llama3", "qwen3"])
def test_atlas_doctor_finds_every_layer_within_the_noise(family, tmp_path):
    """The family's checkpoint as transformers writes it, through `atlas doctor` on the mock:
    every layer's hidden state within float32 summation error of transformers'."""
    from atlas.app.doctor import run_doctor
    from tiny_models import write_model_folder

    write_model_folder(tmp_path, family, num_hidden_layers=2)
    report = run_doctor(str(tmp_path), device="mock", write=lambda line: None)
    assert report.passed and report.reference is not None and len(report.layers) == 2
    assert max(check.error for check in report.layers) < 1e-5 and report.logits_error < 1e-5
