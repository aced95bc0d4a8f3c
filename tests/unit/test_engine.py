"""The engine core on a small random model: batching, preemption and aborts change no tokens."""

from __future__ import annotations

import numpy as np
import pytest
from helpers.tiny_engine import BLOCK_SIZE, build_core, greedy, prompts, run, run_strictly_synchronous

from atlas.domain.requests import ParameterError, Request, SamplingParams


def test_sixteen_prompts_batched_give_the_tokens_each_gives_alone(rng):
    batch = [Request(f"r{i}", p, greedy(), seed=i) for i, p in enumerate(prompts(16, rng))]
    together = run(build_core(), batch)
    for request in batch:
        alone = run(build_core(), [request])
        assert alone[request.request_id] == together[request.request_id]
    assert all(len(t) >= 1 for t in together.values())


def test_preemption_under_block_pressure_gives_the_unconstrained_tokens(rng):
    batch = [Request(f"r{i}", p, greedy(24), seed=i) for i, p in enumerate(prompts(8, rng, 10, 30))]
    roomy = build_core(num_blocks=400)
    expected = run(roomy, batch)
    tight = build_core(num_blocks=40, budget=64)
    got = run(tight, batch)
    assert got == expected
    assert tight.stats().num_preemptions > 0 and roomy.stats().num_preemptions == 0
    assert tight.stats().num_blocks_free == 40
    assert sum(len(t) for t in got.values()) > 8


def test_seeded_sampling_reproduces_and_ignores_batch_neighbours(rng):
    params = SamplingParams(temperature=1.3, top_p=0.9, max_tokens=10)
    target = Request("target", tuple(range(5, 20)), params, seed=42)
    alone = run(build_core(), [target])["target"]
    crowd = [Request(f"n{i}", p, params, seed=i) for i, p in enumerate(prompts(6, rng))]
    together = run(build_core(), [*crowd, target])["target"]
    assert alone == together
    other_seed = run(build_core(), [Request("target", target.prompt_token_ids, params, seed=43)])["target"]
    assert other_seed != alone


def test_abort_frees_blocks_at_every_stage(rng):
    core = build_core(num_blocks=100, budget=16)
    long_prompt = tuple(int(t) for t in rng.integers(0, 96, size=60))
    core.add_request(Request("prefilling", long_prompt, greedy(50), seed=0))
    core.add_request(Request("decoding", (1, 2, 3), greedy(50), seed=0))
    core.add_request(Request("waiting", (4, 5, 6), greedy(50), seed=0))
    core.step()
    assert core.abort("prefilling") is not None
    for _ in range(3):
        core.step()
    assert core.abort("decoding") is not None and core.abort("waiting") is not None
    assert core.abort("decoding") is None
    assert core.step() == []  # drains the step still in flight; its tokens are void
    assert not core.has_unfinished
    assert core.stats().num_blocks_free == 100


def test_requests_the_engine_cannot_run_are_refused_with_the_field():
    core = build_core()
    with pytest.raises(ParameterError, match="context is 128"):
        core.add_request(Request("long", tuple([1] * 200), greedy(), seed=0))
    with pytest.raises(ParameterError, match="outside the vocabulary") as caught:
        core.add_request(Request("oov", (1, 500), greedy(), seed=0))
    assert caught.value.field == "prompt"
    with pytest.raises(ParameterError) as caught:
        core.add_request(Request("bias", (1, 2), SamplingParams(logit_bias={1000: 5.0}), seed=0))
    assert caught.value.field == "logit_bias"
    with pytest.raises(ParameterError, match="--scheduling-policy priority") as caught:
        core.add_request(Request("urgent", (1, 2), greedy(), seed=0, priority=-3))
    assert caught.value.field == "priority"
    assert not core.has_unfinished


def test_max_tokens_and_eos_finish_requests(rng):
    core = build_core()
    result = run(core, [Request("a", (7, 8, 9), greedy(5), seed=0)])
    assert len(result["a"]) == 5
    # ban everything but the eos id: the first token must be eos and finish the request
    bias = {t: -100.0 for t in range(96)}
    result = run(
        core, [Request("b", (7, 8, 9), SamplingParams(temperature=0.0, max_tokens=5, logit_bias=bias), seed=0)]
    )
    assert result["b"] == [96]
    np.testing.assert_equal(core.stats().num_blocks_free, 400)


PLAIN = [SamplingParams(temperature=0.0, max_tokens=14), SamplingParams(temperature=0.9, top_k=20, max_tokens=14)]
PENALISED = [
    SamplingParams(temperature=0.8, repetition_penalty=1.3, frequency_penalty=0.5, max_tokens=14),
    SamplingParams(temperature=0.0, presence_penalty=1.5, max_tokens=14, min_tokens=6),
]


@pytest.mark.parametrize("mixes, overlaps", [(PLAIN, True), (PLAIN + PENALISED, False)], ids=["plain", "penalties"])
def test_the_pipelined_engine_matches_a_strictly_synchronous_loop(rng, mixes, overlaps):
    """Penalties need the host to know the last token, so with them the steps do not overlap."""
    requests = [Request(f"r{i}", p, mixes[i % len(mixes)], seed=100 + i) for i, p in enumerate(prompts(12, rng))]
    expected = run_strictly_synchronous(build_core(), requests)
    core = build_core()
    placeholders_used = []
    original_submit = core.executor.submit

    def spying_submit(batch, before_launch=None):
        placeholders_used.append(any(s.placeholder_row is not None for s in batch.sequences))
        return original_submit(batch, before_launch)

    core.executor.submit = spying_submit
    assert run(core, requests) == expected
    assert any(placeholders_used) == overlaps
    assert core.stats().num_blocks_free == 400


WITH_LOGPROBS = [SamplingParams(temperature=0.7, top_p=0.9, max_tokens=14, logprobs=2)]


@pytest.mark.parametrize(
    "mixes, sampled_again",
    [(PLAIN, False), (PLAIN + PENALISED, True), (PLAIN + WITH_LOGPROBS, True)],
    ids=["plain", "penalties", "logprobs"],
)
def test_decode_graphs_padded_to_buckets_give_the_eager_tokens(rng, mixes, sampled_again):
    """The graph path (bucket padding, token gather, forward and sampler graphs, replay over
    persistent buffers) on the CPU. Plain rows are sampled by the sampler graph, and overlapped
    steps gather its ids; penalties, bias or logprobs make a step sample eagerly instead."""
    requests = [Request(f"r{i}", p, mixes[i % len(mixes)], seed=7 + i) for i, p in enumerate(prompts(11, rng))]
    eager = run(build_core(), requests)
    graphed_core = build_core(graph_sizes=(1, 2, 4, 8, 16))
    worker = graphed_core.executor
    captures, sampler_replays, graph_steps = [], [], []
    original_capture, original_capture_sampler, original_submit = (
        worker._capture, worker._capture_sampler, worker.submit
    )

    def counting_capture(bucket, shared_prefix=False):
        captures.append(bucket)
        return original_capture(bucket, shared_prefix)

    class CountingGraph:
        def __init__(self, graph):
            self.graph = graph

        def replay(self):
            sampler_replays.append(1)
            self.graph.replay()

    def counting_capture_sampler(bucket, masked):
        graph = CountingGraph(original_capture_sampler(bucket, masked))
        worker._sampler_graphs[(bucket, masked)] = graph
        return graph

    def spying_submit(batch, before_launch=None):
        replays_before = len(sampler_replays)
        pending = original_submit(batch, before_launch)
        if worker._graph_bucket(batch) is not None:
            placeholders = any(s.placeholder_row is not None for s in batch.sequences)
            graph_steps.append((placeholders, len(sampler_replays) == replays_before))
        return pending

    worker._capture, worker._capture_sampler, worker.submit = counting_capture, counting_capture_sampler, spying_submit
    assert run(graphed_core, requests) == eager
    assert captures and set(captures) <= {1, 2, 4, 8, 16}
    assert graph_steps and any(again for _, again in graph_steps) == sampled_again
    if not sampled_again:  # steps overlapped: graph steps gathered ids still on the device
        assert any(placeholders for placeholders, _ in graph_steps)
    assert graphed_core.stats().num_blocks_free == 400


def shared_prefix_prompts(rng, count, stem_len=21, tail_high=12):
    """Prompts from three 21-token stems (five blocks and one token) plus random tails."""
    stems = [tuple(int(t) for t in rng.integers(0, 96, size=stem_len)) for _ in range(3)]
    return [
        stems[i % 3] + tuple(int(t) for t in rng.integers(0, 96, size=int(rng.integers(0, tail_high))))
        for i in range(count)
    ]


def run_in_waves(core, waves):
    """Each wave is added once the previous one finished, so later waves hit earlier ones'
    blocks; the leak check runs after every wave."""
    tokens = {}
    for wave in waves:
        tokens.update(run(core, wave))
        stats = core.stats()
        assert stats.num_blocks_free == stats.num_blocks_total and stats.num_running == 0
    return tokens


def test_greedy_tokens_are_the_same_with_and_without_the_prefix_cache(rng):
    """f32 on the mock: a hit reads K/V another request wrote, the uncached run computes them."""
    first = [Request(f"a{i}", p, greedy(10), seed=i) for i, p in enumerate(shared_prefix_prompts(rng, 12))]
    second = [Request(f"b{i}", p, greedy(10), seed=i) for i, p in enumerate(shared_prefix_prompts(rng, 8))]
    cached_core, uncached_core = build_core(), build_core(prefix_caching=False)
    cached = run_in_waves(cached_core, [first, second])
    # the next turn of each conversation: prompt, answer and a new message
    follow_ups = [
        Request(f"c{i}", r.prompt_token_ids + tuple(cached[r.request_id]) + (7, 8, 9), greedy(6), seed=i)
        for i, r in enumerate(first)
    ]
    cached.update(run_in_waves(cached_core, [follow_ups]))
    uncached = run_in_waves(uncached_core, [first, second, follow_ups])
    assert cached == uncached
    stats, baseline = cached_core.stats(), uncached_core.stats()
    assert stats.num_prefix_cache_hits > 0 and baseline.num_prefix_cache_hits == 0
    assert stats.num_prefix_cache_queries == baseline.num_prefix_cache_queries == baseline.num_prompt_tokens
    # every follow-up finds at least the full blocks of its first turn's prompt
    assert stats.num_prefix_cache_hits >= sum(len(r.prompt_token_ids) // BLOCK_SIZE * BLOCK_SIZE for r in first)
    cache = cached_core.scheduler.cache
    assert cached_core.reset_prefix_cache() == stats.num_blocks_cached > 0
    assert cache.groups[0].pool.num_free_blocks == 400


def test_preemption_in_a_tiny_pool_resumes_through_the_cache_with_unchanged_tokens(rng):
    batch = [Request(f"r{i}", p, greedy(24), seed=i) for i, p in enumerate(shared_prefix_prompts(rng, 8))]
    expected = run(build_core(prefix_caching=False), batch)
    tight = build_core(num_blocks=40, budget=64)
    assert run(tight, batch) == expected
    stats = tight.stats()
    assert stats.num_preemptions > 0 and stats.num_prefix_cache_hits > 0
    assert stats.num_blocks_free == 40


def test_the_n_choices_of_a_request_compute_its_prompt_once(rng):
    from atlas.domain.fan_out import SeedSource, fan_out

    prompt = tuple(int(t) for t in rng.integers(0, 96, size=30))  # seven full blocks and two tokens
    params = SamplingParams(n=4, temperature=0.9, max_tokens=8, seed=5)
    choices = fan_out("req", prompt, params, SeedSource(None, lambda: 0))
    cached_core = build_core()
    steps = []
    original_submit = cached_core.executor.submit

    def recording_submit(batch, before_launch=None):
        steps.append({s.seq_id: s.start_position for s in batch.sequences if s.start_position == 0 or s.num_tokens > 1})
        return original_submit(batch, before_launch)

    cached_core.executor.submit = recording_submit
    cached = run(cached_core, choices)
    assert cached == run(build_core(prefix_caching=False), choices)
    # choice 0 computes the prompt; the others wait a step and start after its full blocks
    assert steps[:2] == [{"req-0": 0}, {"req-1": 28, "req-2": 28, "req-3": 28}]
    assert cached_core.stats().num_prefix_cache_hits == 3 * 28


def test_aborting_every_request_at_every_stage_leaves_every_block_free_or_cached(rng):
    core = build_core(num_blocks=60, budget=16)
    prompts = shared_prefix_prompts(rng, 6)
    for index, prompt in enumerate(prompts):
        core.add_request(Request(f"r{index}", prompt, greedy(40), seed=index))
    for index in range(len(prompts)):
        for _ in range(index):
            core.step()
            core.scheduler.check_invariants()
        core.abort(f"r{index}")
        core.scheduler.check_invariants()
    while core.has_unfinished:
        core.step()
    stats = core.stats()
    assert stats.num_blocks_free == 60 and stats.num_blocks_cached > 0
    assert core.reset_prefix_cache() == stats.num_blocks_cached
    assert core.scheduler.cache.groups[0].pool.num_free_blocks == 60
