"""Token masks and speculative decoding on CUDA: the masked sampler graphs, JSON-schema output
of SmolLM2 at temperature 1, verify steps replaying decode graphs, and greedy SmolLM2 with and
without the n-gram proposer and with itself as its draft model.

Run on a GPU machine: `python -m pytest tests/gpu/test_cuda_masks_and_speculation.py -m gpu`.
The SmolLM2 cases need it pulled (ATLAS_SMOLLM2_DIR, or `atlas pull smollm2`).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "unit"))  # the unit tests' fakes

from cuda_harness import gap_where_paths_part  # noqa: E402
from fakes import DictWeights, random_llama_weights  # noqa: E402
from helpers.engines import make_cache, make_worker  # noqa: E402
from helpers.json_schema_check import schema_errors  # noqa: E402
from helpers.residue_grammar import follows_residues, residue_grammars, residues  # noqa: E402

from atlas.domain.engine import EngineCore  # noqa: E402
from atlas.domain.models.config import ModelConfig  # noqa: E402
from atlas.domain.models.families import load_model  # noqa: E402
from atlas.domain.requests import OutputConstraint, Request, SamplingParams  # noqa: E402
from atlas.domain.scheduler import Scheduler, SchedulerConfig  # noqa: E402
from atlas.domain.worker import WorkerConfig, decode_rows  # noqa: E402
from atlas.ports.gpu import DType  # noqa: E402

pytestmark = pytest.mark.gpu

BLOCK_SIZE = 16
SMALL_LLAMA = dict(
    architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=512, hidden_size=256,
    intermediate_size=512, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
    max_position_embeddings=512, rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=False,
)
PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 16},
                   "age": {"type": "integer", "minimum": 0, "maximum": 120},
                   "role": {"enum": ["admin", "user", "guest"]}},
    "required": ["name", "age", "role"],
    "additionalProperties": False,
}
NGRAM = {"method": "ngram", "num_speculative_tokens": 4}
_NEAR_TIE = 0.005  # relative logit gap under which greedy paths may part (see test_models.py)


def _smollm2_dir() -> Path:
    folder = Path(os.environ.get("ATLAS_SMOLLM2_DIR", Path.home() / ".cache/atlas/models/smollm2"))
    if not (folder / "config.json").exists():
        pytest.skip("SmolLM2 is not here (set ATLAS_SMOLLM2_DIR)")
    return folder


def _constrained_engine(backend, graph_sizes):
    config = ModelConfig.from_dict(SMALL_LLAMA)
    model = load_model(config, DictWeights(random_llama_weights(SMALL_LLAMA, seed=5, scale=0.1)), backend, 512)
    worker = make_worker(model, 200, BLOCK_SIZE, WorkerConfig(256, 16, 512, graph_sizes), kv_dtype=DType.BF16)
    worker.capture_graphs()
    scheduler = Scheduler(SchedulerConfig(512, 16, 256, BLOCK_SIZE), make_cache(model, 200, BLOCK_SIZE, 16))
    return EngineCore(scheduler, worker, 512, 512, frozenset({96}), residue_grammars(512))


# Several LLMs live in one process (the garbage collector frees a device allocation only with
# its last reference): a fixed small KV cache each, not 90% of the device.
KV_GB = 2.0

def _residue_requests(rng, loose: bool = False) -> list[Request]:
    return [Request(f"r{i}", tuple(int(t) for t in rng.integers(0, 96, size=int(rng.integers(2, 40)))),
                    SamplingParams(temperature=t, max_tokens=20), 7 + i, constraint=residues(12, loose=loose))
            for i, t in enumerate([0.0, 1.0, 0.7] * 4)]


def _run_all(core, requests) -> dict[str, list[int]]:
    """Every request to the end: {request id: its tokens}; no error, every block back."""
    tokens = {r.request_id: [] for r in requests}
    for request in requests:
        core.add_request(request)
    while core.has_unfinished:
        for output in core.step():
            assert output.error is None, output.error
            tokens[output.seq_id].extend(output.new_token_ids)
    assert core.stats().num_blocks_free == 200
    return tokens


def test_masked_sampler_graphs_keep_every_draw_inside_the_grammar(cuda_backend, rng):
    """Overlapped, graphed steps whose masks arrive after the forward: every token follows the
    grammar, eos follows its end, a masked sampler graph ran, and a second engine reproduces."""
    requests = _residue_requests(rng)
    core = _constrained_engine(cuda_backend, (1, 2, 4, 8, 16))
    first = _run_all(core, requests)
    assert any(masked for _, masked in core.executor._sampler_graphs)
    assert all(follows_residues(tokens, 12) and tokens[-1] == 96 for tokens in first.values()), first
    assert _run_all(_constrained_engine(cuda_backend, (1, 2, 4, 8, 16)), requests) == first


def test_loose_masks_resample_refused_tokens_through_the_graphs(cuda_backend, rng):
    """Rows sampled under the grammar's superset whose tokens the grammar refuses are sampled
    again (their last token computed again in a graphed step): every output follows the
    grammar, every block comes back, and a second engine gives the same tokens."""
    requests = _residue_requests(rng, loose=True)
    core = _constrained_engine(cuda_backend, (1, 2, 4, 8, 16))
    first = _run_all(core, requests)
    assert core.num_resampled_tokens > 0
    assert all(follows_residues(tokens, 12) and tokens[-1] == 96 for tokens in first.values()), first
    assert _run_all(_constrained_engine(cuda_backend, (1, 2, 4, 8, 16)), requests) == first


def test_smollm2_json_schema_answers_at_temperature_one_parse_and_validate(kernel_cache_dir):
    from atlas.app.llm import LLM
    from atlas.ports.grammar import JsonSchema

    llm = LLM(str(_smollm2_dir()), device="cuda", show_progress=False, max_seq_len=1024, kv_cache_gb=KV_GB)
    ask = [{"role": "user", "content": "Describe a fictional person as JSON with a name, an age and a role."}]
    [result] = llm.chat(ask, SamplingParams(temperature=1.0, max_tokens=80, n=8, seed=5),
                        constraint=OutputConstraint(JsonSchema(PERSON), "response_format"))
    for choice in result.outputs:
        assert choice.finish_reason == "stop" and schema_errors(json.loads(choice.text), PERSON) == [], choice.text


def test_smollm2_verify_steps_replay_decode_graphs_and_greedy_matches_plain_decoding(kernel_cache_dir):
    """Verify steps (B x (k + 1) single-token rows) replay the decode graphs. CUDA's kernels are
    not batch-invariant by default (a 5-row GEMV sums in another order than a 1-row one), so
    greedy paths with and without drafts may part, but only at a near-tie; the parting logits are
    printed. (`--batch-invariant` makes them identical: the test after this one.)"""
    from atlas.app.bench.speculative import load_prompts
    from atlas.app.llm import LLM

    folder = _smollm2_dir()
    prompts = load_prompts(None)
    conversations = [[{"role": "user", "content": prompts[i]}] for i in range(0, 24, 3)]
    params = SamplingParams(temperature=0.0, max_tokens=96)
    speculative = LLM(str(folder), device="cuda", show_progress=False, max_seq_len=1024, kv_cache_gb=KV_GB,
                      speculative_config=NGRAM)
    worker = speculative.engine.core.executor
    while worker.capture_next_graph():  # the buckets past the startup ones are captured when idle
        pass
    verify_buckets = []
    original_submit = worker.submit

    def spying_submit(batch, before_launch=None):
        rows = decode_rows(batch)
        # (a step that also prefills another sequence's chunk runs eagerly, as every mixed step)
        if any(s.num_draft_tokens for s in batch.sequences) and all(s.num_tokens == 1 for s in rows.sequences):
            verify_buckets.append(worker._graph_bucket(rows))
        return original_submit(batch, before_launch)

    worker.submit = spying_submit
    with_drafts = [r.outputs[0].token_ids for r in speculative.chat(conversations, params)]
    del worker.submit
    assert verify_buckets and all(bucket is not None for bucket in verify_buckets)
    stats = speculative.engine.core.stats()
    length = (stats.num_spec_accepted_tokens + stats.num_spec_verify_steps) / stats.num_spec_verify_steps
    print(f"acceptance length {length:.2f}")
    plain = LLM(str(folder), device="cuda", show_progress=False, max_seq_len=1024, kv_cache_gb=KV_GB)
    without = [r.outputs[0].token_ids for r in plain.chat(conversations, params)]
    parted = []
    for conversation, got, expected in zip(conversations, with_drafts, without):
        if got != expected:
            gap = gap_where_paths_part(plain, _prompt_ids(plain, conversation), got, expected, BLOCK_SIZE)
            parted.append(gap)
            print(f"paths part: the plain engine's best logit {gap:.2%} above the speculative choice")
    assert all(gap < _NEAR_TIE for gap in parted) and len(parted) <= 1, parted


@pytest.mark.parametrize("num_drafts", [4, 7])
def test_smollm2_greedy_with_ngram_drafts_is_bit_identical_under_batch_invariant(kernel_cache_dir, num_drafts):
    """With `--batch-invariant` a verify row is computed as the one-row step would compute it, so
    the 24 edit-and-repeat prompts (the speculative bench's), greedy to 256 tokens one at a time
    (steps of at most 8 rows: the guarantee's bound), give exactly the tokens of an engine without
    a proposer."""
    from atlas.app.bench.speculative import load_prompts
    from atlas.app.llm import LLM

    folder = _smollm2_dir()
    conversations = [[{"role": "user", "content": prompt}] for prompt in load_prompts(None)]
    params = SamplingParams(temperature=0.0, max_tokens=256)
    ngram = {"method": "ngram", "num_speculative_tokens": num_drafts}
    outputs = []
    for config in (ngram, None):
        llm = LLM(str(folder), device="cuda", show_progress=False, max_seq_len=1024, kv_cache_gb=KV_GB,
                  speculative_config=config, batch_invariant=True)
        outputs.append([llm.chat(conversation, params)[0].outputs[0].token_ids for conversation in conversations])
        if config is not None:
            stats = llm.engine.core.stats()
            assert 0 < stats.num_spec_accepted_tokens < stats.num_spec_draft_tokens
        llm.close()
    with_drafts, without = outputs
    assert sum(map(len, without)) > 24 * 32
    assert with_drafts == without


def test_smollm2_as_its_own_draft_model_replays_graphs_and_matches_plain_decoding(kernel_cache_dir):
    """The draft_model proposer on CUDA: SmolLM2 drafts for itself (its own worker, KV cache and
    decode graphs on the target's backend). Draft steps 1..k-1 and the verify steps replay decode
    graphs; nearly every draft is accepted (the draft's chunked catch-up and the verify rows sum
    in other orders, so a near-tie may go the other way); greedy paths match plain decoding but
    at a near-tie; every draft block comes back."""
    from atlas.app.bench.speculative import load_prompts
    from atlas.app.llm import LLM

    folder = _smollm2_dir()
    prompts = load_prompts(None)
    conversations = [[{"role": "user", "content": prompts[i]}] for i in range(0, 24, 3)]
    params = SamplingParams(temperature=0.0, max_tokens=96)
    draft = {"method": "draft_model", "num_speculative_tokens": 4, "model": str(folder)}
    speculative = LLM(str(folder), device="cuda", show_progress=False, max_seq_len=1024, kv_cache_gb=KV_GB,
                      speculative_config=draft)
    proposer = speculative.engine.core.scheduler.speculation.proposer
    draft_worker = proposer.runner
    draft_buckets = []
    original_execute = draft_worker.execute

    def spying_execute(batch):
        if all(s.num_tokens == 1 for s in batch.sequences):
            draft_buckets.append(draft_worker._graph_bucket(batch))
        return original_execute(batch)

    draft_worker.execute = spying_execute
    with_drafts = [r.outputs[0].token_ids for r in speculative.chat(conversations, params)]
    del draft_worker.execute
    assert draft_buckets and all(bucket is not None for bucket in draft_buckets)
    stats = speculative.engine.core.stats()
    length = (stats.num_spec_accepted_tokens + stats.num_spec_verify_steps) / stats.num_spec_verify_steps
    print(f"acceptance length {length:.2f} of {1 + draft['num_speculative_tokens']}")
    assert stats.num_spec_accepted_tokens >= 0.9 * stats.num_spec_draft_tokens
    # One sequence alone: its verify rows are the whole step (at batch 1 the attention kernel read
    # the K/V of the step's earlier rows before they were written, and kept 37% of the drafts).
    [alone] = speculative.chat(conversations[0], params)
    single = speculative.engine.core.stats()
    accepted = single.num_spec_accepted_tokens - stats.num_spec_accepted_tokens
    drafted = single.num_spec_draft_tokens - stats.num_spec_draft_tokens
    print(f"one sequence: {accepted} of {drafted} drafts accepted")
    assert accepted >= 0.9 * drafted and alone.outputs[0].finish_reason is not None
    stats = single
    assert proposer.num_free_blocks == proposer.num_blocks and stats.num_blocks_free == stats.num_blocks_total
    plain = LLM(str(folder), device="cuda", show_progress=False, max_seq_len=1024, kv_cache_gb=KV_GB)
    without = [r.outputs[0].token_ids for r in plain.chat(conversations, params)]
    parted = []
    for conversation, got, expected in zip(conversations, with_drafts, without):
        if got != expected:
            gap = gap_where_paths_part(plain, _prompt_ids(plain, conversation), got, expected, BLOCK_SIZE)
            parted.append(gap)
            print(f"paths part: the plain engine's best logit {gap:.2%} above the speculative choice")
    assert all(gap < _NEAR_TIE for gap in parted) and len(parted) <= 1, parted


def _prompt_ids(llm, conversation) -> list[int]:
    return llm.tokenizer.encode(llm.render_chat(conversation), add_special_tokens=False)
