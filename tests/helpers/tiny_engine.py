"""An engine core over a small random Llama on the mock backend, and a loop that runs requests
through it: the harness of the engine-level tests (batching, overlap, graphs, constraints,
speculation)."""

from __future__ import annotations

from fakes import TINY_LLAMA, DictWeights, random_llama_weights
from helpers.engines import make_cache, make_worker

from atlas.adapters.mock.backend import MockGpuBackend
from atlas.domain.engine import EngineCore
from atlas.domain.models.config import ModelConfig
from atlas.domain.models.families import load_model
from atlas.domain.requests import SamplingParams
from atlas.domain.scheduler import Scheduler, SchedulerConfig
from atlas.domain.speculative.draft_model import DraftModelProposer
from atlas.domain.speculative.policy import speculation_policy
from atlas.domain.worker import WorkerConfig

BLOCK_SIZE = 4
MAX_LEN = 128
EOS = frozenset({96})
VOCAB_SIZE = TINY_LLAMA["vocab_size"]


def build_core(num_blocks=400, max_num_seqs=32, budget=256, seed=0, graph_sizes=(), prefix_caching=True, policy=None,
               grammars=None, speculative=None, draft=None, draft_blocks=None, grammar_worker=None):
    """`grammars`: a GrammarCache for requests' constraints (None: none may have a grammar);
    `speculative`: a SpeculativeConfig or None. A draft_model config drafts with `draft`: a
    Llama config dict and its weights' seed, or "target" for the target model itself, on
    `draft_blocks` blocks (default: `num_blocks`). `grammar_worker`: start a GrammarWorker that
    holds the constraints instead (`EngineCore`)."""
    config = ModelConfig.from_dict(TINY_LLAMA)
    backend = MockGpuBackend(emulate_graphs=bool(graph_sizes))
    model = load_model(config, DictWeights(random_llama_weights(TINY_LLAMA, seed)), backend, MAX_LEN)
    rows = max_num_seqs * (1 + (speculative.num_speculative_tokens if speculative else 0))  # a verify row per draft
    worker_config = WorkerConfig(budget, min(rows, budget), MAX_LEN, graph_sizes)
    worker = make_worker(model, num_blocks, BLOCK_SIZE, worker_config)
    cache = make_cache(model, num_blocks, BLOCK_SIZE, max_num_seqs, prefix_caching)
    proposer = None
    if draft is not None:
        draft_model = model
        if draft != "target":
            draft_config, draft_seed = draft
            draft_model = load_model(ModelConfig.from_dict(draft_config),
                                     DictWeights(random_llama_weights(draft_config, draft_seed)), backend, MAX_LEN)
        draft_blocks = draft_blocks or num_blocks
        draft_worker = make_worker(draft_model, draft_blocks, BLOCK_SIZE,
                                   WorkerConfig(budget, max_num_seqs, MAX_LEN, graph_sizes))
        proposer = DraftModelProposer(draft_worker, draft_blocks, BLOCK_SIZE, budget, config.vocab_size)
    scheduler = Scheduler(SchedulerConfig(MAX_LEN, max_num_seqs, budget, BLOCK_SIZE), cache, policy,
                          speculation_policy(speculative, proposer))
    return EngineCore(scheduler, worker, MAX_LEN, config.vocab_size, EOS, grammars, grammar_worker)


def run(core, requests, check=True):
    """Every request to the end: {request id: its tokens}; invariants checked after each step."""
    tokens = {r.request_id: [] for r in requests}
    for request in requests:
        core.add_request(request)
    while core.has_unfinished:
        for output in core.step():
            tokens[output.seq_id].extend(output.new_token_ids)
        if check:
            core.scheduler.check_invariants()
    return tokens


def prompts(count, rng, low=3, high=40):
    return [tuple(int(t) for t in rng.integers(0, 96, size=rng.integers(low, high))) for _ in range(count)]


def greedy(max_tokens=12):
    return SamplingParams(temperature=0.0, max_tokens=max_tokens)


def run_strictly_synchronous(core, requests):
    """The reference: schedule, execute, commit, one step at a time, no overlap."""
    tokens = {r.request_id: [] for r in requests}
    for request in requests:
        core.add_request(request)
    scheduler, worker = core.scheduler, core.executor
    while scheduler.has_unfinished:
        batch = scheduler.schedule()
        assert not any(s.placeholder_row is not None for s in batch.sequences)
        for output in scheduler.commit(batch, worker.execute(batch)):
            tokens[output.seq_id].extend(output.new_token_ids)
    return tokens
