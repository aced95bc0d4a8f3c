"""`atlas bench serve` without a server: the workload generator, prefix reuse, /metrics parsing
and the summary's figures."""

from __future__ import annotations

import argparse
import asyncio
import itertools
import random
import sys

import pytest

from atlas.app.bench.prefix_reuse import PrefixCacheCounts, metric_samples, prefix_cache_counts, reusable_tokens
from atlas.app.bench.serve import add_bench_serve_arguments, workload_spec
from atlas.app.bench.serve_client import StreamResult
from atlas.app.bench.serve_report import RequestRecord, Slo, check_plotting, percentile, summarize
from atlas.app.bench.workload import (
    WORDS,
    LengthRange,
    WordTokenizer,
    WorkloadSpec,
    arrival_times,
    build_workload,
)


class PieceTokenizer:
    """A stand-in for a BPE: a word is one token per 3 letters (so 'sentence' costs 3), and the
    text's first word costs one more (as a word without its leading space often does)."""

    exact = True

    def __init__(self) -> None:
        self.calls = 0

    async def encode(self, text: str) -> list[int]:
        self.calls += 1
        words = text.split()
        ids = [hash(word[i : i + 3]) % 1000 for word in words for i in range(0, len(word), 3)]
        return ([7] if words else []) + ids

    async def encode_prompt(self, prompt, messages):
        return await self.encode(prompt)


def build(spec: WorkloadSpec, tokenizer=None):
    return asyncio.run(build_workload(spec, tokenizer or PieceTokenizer()))


def test_length_ranges_parse_fixed_and_ranged_values_and_name_the_flag():
    assert LengthRange.parse("512", "--input-len") == LengthRange(512, 512)
    assert LengthRange.parse("16:900", "--input-len") == LengthRange(16, 900)
    assert str(LengthRange(16, 900)) == "16:900" and str(LengthRange(5, 5)) == "5"
    for bad in ("0", "900:16", "a:b", "3:", "-4:8"):
        with pytest.raises(ValueError, match="--output-len"):
            LengthRange.parse(bad, "--output-len")
    rng = random.Random(0)
    draws = {LengthRange(3, 6).draw(rng) for _ in range(200)}
    assert draws == {3, 4, 5, 6}


def test_every_text_has_exactly_its_drawn_number_of_tokens_with_multi_token_words():
    tokenizer = PieceTokenizer()
    spec = WorkloadSpec(num_conversations=30, num_turns=1, input_len=LengthRange(2, 60), output_len=LengthRange(4, 9))
    workload = build(spec, tokenizer)
    turns = workload.turns
    # calibration (a call per word) and a call or two per text: the single-token words settle fast
    assert tokenizer.calls <= len(WORDS) + 1 + 2 * len(turns)
    assert len(turns) == 30 and len({t.input_len for t in turns}) > 10
    for turn in turns:
        assert turn.exact and len(asyncio.run(tokenizer.encode(turn.text))) == turn.input_len
        assert 4 <= turn.output_len <= 9


def test_a_length_the_words_cannot_reach_keeps_the_closest_text_and_says_so():
    """PieceTokenizer's first word costs two tokens: no text of one token exists."""
    workload = build(WorkloadSpec(num_conversations=3, num_turns=1, input_len=LengthRange(1, 1),
                                  output_len=LengthRange(1, 1)))
    assert all(not t.exact and t.num_tokens == 2 and len(t.text.split()) == 1 for t in workload.turns)


def test_the_same_seed_gives_the_same_requests_and_another_seed_others():
    spec = WorkloadSpec(num_conversations=6, num_turns=2, input_len=LengthRange(5, 40), output_len=LengthRange(1, 50),
                        shared_prefix_len=12, num_prefixes=2, request_rate=3.0, seed=11)
    first, again = build(spec), build(spec)
    assert first == again
    other = build(WorkloadSpec(**{**{f: getattr(spec, f) for f in spec.__slots__}, "seed": 12}))
    assert [t.text for t in other.turns] != [t.text for t in first.turns]


def test_shared_prefixes_open_the_first_turn_of_each_conversation_round_robin():
    tokenizer = PieceTokenizer()
    spec = WorkloadSpec(num_conversations=7, num_turns=2, input_len=LengthRange(3, 9), output_len=LengthRange(2, 2),
                        shared_prefix_len=25, num_prefixes=3)
    workload = build(spec, tokenizer)
    assert workload.prefix_lens == [25, 25, 25]
    openings = {}
    for conversation in workload.conversations:
        first, second = conversation.turns
        assert first.prefix_idx == conversation.idx % 3 and second.prefix_idx is None
        assert first.exact and first.input_len == 25 + len(asyncio.run(tokenizer.encode(first.text))) - 25
        ids = asyncio.run(tokenizer.encode(first.text))
        openings.setdefault(first.prefix_idx, set()).add(tuple(ids[:25]))
        assert 3 <= second.input_len <= 9 and second.exact
    assert all(len(heads) == 1 for heads in openings.values()) and len(openings) == 3
    assert len({next(iter(heads)) for heads in openings.values()}) == 3  # three different prefixes


def test_without_a_server_tokenizer_words_count_as_tokens():
    workload = build(WorkloadSpec(num_conversations=5, num_turns=1, input_len=LengthRange(10, 20),
                                  output_len=LengthRange(1, 1)), WordTokenizer())
    assert all(len(t.text.split()) == t.input_len and t.exact for t in workload.turns)


def test_arrivals_are_a_seeded_poisson_process():
    times = arrival_times(20000, 50.0, random.Random(3))
    gaps = [b - a for a, b in itertools.pairwise(times)]
    assert times[0] == 0 and all(gap >= 0 for gap in gaps)
    assert sum(gaps) / len(gaps) == pytest.approx(1 / 50, rel=0.03)
    # exponential gaps: about e^-1 of them exceed the mean
    assert sum(gap > 1 / 50 for gap in gaps) / len(gaps) == pytest.approx(0.368, abs=0.02)
    assert arrival_times(4, float("inf"), random.Random(3)) == [0.0] * 4


def test_reusable_tokens_match_a_brute_force_longest_common_prefix():
    rng = random.Random(5)
    stems = [[rng.randrange(50) for _ in range(rng.randrange(0, 30))] for _ in range(6)]
    prompts = [rng.choice(stems) + [rng.randrange(3) for _ in range(rng.randrange(0, 12))] for _ in range(120)]
    prompts.append(list(prompts[40]))  # a repeat is reusable whole

    def common(a, b):
        return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))

    expected = [max((common(p, q) for q in prompts[:i]), default=0) for i, p in enumerate(prompts)]
    assert reusable_tokens(prompts) == expected
    assert expected[-1] == len(prompts[40]) and sum(expected) > 0


VLLM_METRICS = """# HELP vllm:prefix_cache_queries_total Prefix cache queries, in terms of number of queried tokens.
# TYPE vllm:prefix_cache_queries_total counter
vllm:prefix_cache_queries_total{engine="0",model_name="m"} 1200.0
vllm:prefix_cache_queries_total{engine="1",model_name="m"} 800.0
vllm:prefix_cache_hits_total{engine="0",model_name="m"} 640.0 1712345678000
vllm:prefix_cache_hits_total{engine="1",model_name="m"} 0.0
vllm:num_requests_running{engine="0",model_name="m"} 3.0
"""


def test_prefix_cache_counters_are_read_for_atlas_and_vllm_and_absent_otherwise():
    counts = prefix_cache_counts(VLLM_METRICS)
    assert counts == PrefixCacheCounts("vllm", 2000.0, 640.0)
    atlas = prefix_cache_counts("atlas_prefix_cache_queries_total 90\natlas_prefix_cache_hits_total 30\n")
    assert atlas == PrefixCacheCounts("atlas", 90.0, 30.0)
    assert atlas.minus(PrefixCacheCounts("atlas", 40.0, 10.0)) == PrefixCacheCounts("atlas", 50.0, 20.0)
    assert prefix_cache_counts("atlas_requests_total 4\n# TYPE x counter\n") is None
    assert metric_samples('odd{path="/a b}"} 2\nodd{path="c"} 3\n')["odd"] == 5.0


def record(ttft_s, latency_s, output_tokens, ok=True, conversation=0, turn=0, reusable=None, cached=None):
    result = StreamResult(ok, "" if ok else "HTTP 500: x", ttft_s, latency_s, 10, output_tokens, cached)
    return RequestRecord(conversation, turn, 10, 10, output_tokens, 0.0, result, reusable_tokens=reusable)


RUN = {"num_turns": 1}


def test_summary_percentiles_goodput_and_prefix_figures():
    records = [record(0.010 * (i + 1), 0.010 * (i + 1) + 0.5, 11, reusable=4, cached=2) for i in range(100)]
    records.append(record(0, 0, 0, ok=False))
    counts = PrefixCacheCounts("atlas", 1000.0, 300.0)
    summary = summarize(records, 10.0, RUN, Slo(ttft_ms=500, tpot_ms=50), counts)
    assert summary["completed"] == 100 and summary["failed"] == 1 and summary["first_error"] == "HTTP 500: x"
    assert summary["ttft_p50_ms"] == pytest.approx(505) and summary["ttft_p90_ms"] == pytest.approx(901)
    assert summary["ttft_p99_ms"] == pytest.approx(990.1) and summary["tpot_p99_ms"] == pytest.approx(50)
    assert summary["good_requests"] == 50 and summary["goodput_requests_per_s"] == pytest.approx(5.0)
    assert summary["output_tokens_per_s"] == pytest.approx(110.0)
    assert summary["reusable_tokens"] == 400 and summary["prefix_cache_hit_rate"] == pytest.approx(0.3)
    assert summary["prefix_cache_hits_of_reusable"] == pytest.approx(0.75)
    assert summary["usage_cached_tokens"] == 200 and summary["usage_cached_of_reusable"] == pytest.approx(0.5)
    bare = summarize([record(0.1, 0.2, 3) for _ in range(3)], 1.0, RUN, Slo(), None)
    assert bare["prefix_cache_source"] == "n/a" and bare["prefix_cache_hit_rate"] is None
    assert bare["goodput_requests_per_s"] is None and bare["usage_cached_tokens"] is None
    assert percentile([4.0], 99) == 4.0 and percentile([], 50) == 0.0


def test_multi_turn_summary_counts_the_replies_the_history_re_sends():
    records = [record(0.1, 1.0, 7, conversation=0, turn=0), record(0.1, 1.0, 5, conversation=0, turn=1),
               record(0.1, 1.0, 9, conversation=0, turn=2), record(0.1, 1.0, 3, conversation=1, turn=0)]
    assert summarize(records, 1.0, {"num_turns": 3}, Slo(), None)["resent_reply_tokens"] == 7 + 5


def parse(*argv):
    parser = argparse.ArgumentParser()
    add_bench_serve_arguments(parser)
    return parser.parse_args(argv)


@pytest.mark.parametrize(("argv", "message"), [
    (("--num-turns", "3", "--num-prompts", "9"), "--endpoint chat"),
    (("--endpoint", "chat", "--num-turns", "4", "--num-prompts", "10"), "multiple of --num-turns"),
    (("--num-prefixes", "4",), "--shared-prefix-len"),
    (("--request-rate", "0",), "--request-rate"),
    (("--slo-tpot", "-1",), "--slo-tpot"),
    (("--concurrency", "0",), "--concurrency"),
    (("--input-len", "9:3",), "--input-len"),
])
def test_flags_out_of_range_are_named(argv, message):
    with pytest.raises(ValueError, match=message):
        workload_spec(parse(*argv))


def test_chat_conversations_divide_the_prompts_among_turns():
    spec = workload_spec(parse("--endpoint", "chat", "--num-turns", "10", "--num-prompts", "40", "--input-len", "16:900"))
    assert spec.num_conversations == 4 and spec.num_turns == 10 and spec.input_len == LengthRange(16, 900)


def test_plot_without_matplotlib_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    with pytest.raises(ValueError, match=r"atlas\[bench\]"):
        check_plotting()
