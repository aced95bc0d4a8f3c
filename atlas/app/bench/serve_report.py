"""The figures of `atlas bench serve`: the summary, its table, the JSON file and the PNG.

Per request, in milliseconds:
    TTFT  request sent -> first chunk carrying text
    TPOT  (latency - TTFT) / (output tokens - 1): the mean time per token after the first
    ITL   gaps between successive chunks carrying text (a chunk may carry several tokens)
summarised as mean, p50, p90 and p99 (linear interpolation between ranks). Throughput is
tokens over the wall time from the first request sent to the last answer read. Goodput counts
the completed requests that met every SLO given (TTFT <= --slo-ttft, TPOT <= --slo-tpot).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

from atlas.app.bench.prefix_reuse import PrefixCacheCounts
from atlas.app.bench.serve_client import StreamResult

PERCENTILES = (50, 90, 99)
PLOT_EXTRA = "pip install 'atlas[bench]' (or pip install matplotlib)"


@dataclass
class RequestRecord:
    conversation: int
    turn: int
    input_len: int  # tokens drawn for the request's own text (shared prefix included)
    text_tokens: int  # what the tokenizer counted for that text
    output_len: int  # max_tokens asked
    sent_s: float  # from the start of the run
    result: StreamResult
    prompt: str | None = None  # what was sent: the prompt (completions) ...
    messages: list[dict] | None = None  # ... or the messages (chat)
    reusable_tokens: int | None = None  # prompt prefix shared with an earlier request (completed ones)

    @property
    def tpot_s(self) -> float | None:
        r = self.result
        return (r.latency_s - r.ttft_s) / (r.output_tokens - 1) if r.ok and r.output_tokens > 1 else None

    def row(self) -> dict:
        r = self.result
        return {
            "conversation": self.conversation, "turn": self.turn, "ok": r.ok, "error": r.error or None,
            "input_len": self.input_len, "text_tokens": self.text_tokens, "output_len": self.output_len,
            "sent_s": self.sent_s, "ttft_ms": 1e3 * r.ttft_s if r.ok else None,
            "latency_ms": 1e3 * r.latency_s if r.ok else None,
            "tpot_ms": 1e3 * self.tpot_s if self.tpot_s is not None else None,
            "prompt_tokens": r.prompt_tokens, "output_tokens": r.output_tokens,
            "num_chunks": len(r.chunk_times_s),  # SSE events that carried text
            "cached_tokens": r.cached_tokens, "reusable_tokens": self.reusable_tokens,
        }


@dataclass(frozen=True, slots=True)
class Slo:
    ttft_ms: float | None = None
    tpot_ms: float | None = None

    def met_by(self, record: RequestRecord) -> bool:
        if not record.result.ok:
            return False
        if self.ttft_ms is not None and 1e3 * record.result.ttft_s > self.ttft_ms:
            return False
        tpot_s = record.tpot_s
        return self.tpot_ms is None or tpot_s is None or 1e3 * tpot_s <= self.tpot_ms


def percentile(values: list[float], q: float) -> float:
    """The q-th percentile (0..100) by linear interpolation between closest ranks; 0 when empty."""
    if not values:
        return 0.0
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100
    low = int(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def summarize(records: list[RequestRecord], duration_s: float, run: dict, slo: Slo,
              prefix_cache: PrefixCacheCounts | None) -> dict:
    """The summary printed and saved; `run` holds the run's settings, copied in first."""
    done = [r for r in records if r.result.ok]
    ttft = [r.result.ttft_s for r in done]
    tpot = [t for r in done if (t := r.tpot_s) is not None]
    itl = [b - a for r in done for a, b in zip(r.result.chunk_times_s, r.result.chunk_times_s[1:])]
    prompt_tokens = sum(r.result.prompt_tokens for r in done)
    output_tokens = sum(r.result.output_tokens for r in done)
    reusable = sum(r.reusable_tokens or 0 for r in done) if any(r.reusable_tokens is not None for r in done) else None
    cached = [r.result.cached_tokens for r in done if r.result.cached_tokens is not None]
    output_of = {(r.conversation, r.turn): r.result.output_tokens for r in done}
    resent_replies = sum(output_of.get((r.conversation, r.turn - 1), 0) for r in done if r.turn)
    has_slo = slo.ttft_ms is not None or slo.tpot_ms is not None
    good = sum(slo.met_by(r) for r in done)
    summary = {
        **run,
        "num_prompts": len(records), "completed": len(done), "failed": len(records) - len(done),
        "duration_s": duration_s,
        "prompt_tokens": prompt_tokens, "output_tokens": output_tokens,
        "mean_prompt_tokens": prompt_tokens / max(len(done), 1),
        "output_tokens_per_s": output_tokens / duration_s if duration_s else 0.0,
        "total_tokens_per_s": (prompt_tokens + output_tokens) / duration_s if duration_s else 0.0,
        "requests_per_s": len(done) / duration_s if duration_s else 0.0,
        "slo_ttft_ms": slo.ttft_ms, "slo_tpot_ms": slo.tpot_ms,
        "good_requests": good if has_slo else None,
        "goodput_requests_per_s": (good / duration_s if duration_s else 0.0) if has_slo else None,
        "reusable_tokens": reusable,
        "resent_reply_tokens": resent_replies if run["num_turns"] > 1 else None,
        "prefix_cache_source": prefix_cache.source if prefix_cache else "n/a",
        "prefix_cache_queries": prefix_cache.queries if prefix_cache else None,
        "prefix_cache_hits": prefix_cache.hits if prefix_cache else None,
        "prefix_cache_hit_rate": _ratio(prefix_cache.hits, prefix_cache.queries) if prefix_cache else None,
        "prefix_cache_hits_of_reusable": _ratio(prefix_cache.hits, reusable) if prefix_cache else None,
        "usage_cached_tokens": sum(cached) if cached else None,
        "usage_cached_of_reusable": _ratio(sum(cached), reusable) if cached else None,
        "first_error": next((r.result.error for r in records if not r.result.ok), None),
    }
    for name, values in (("ttft", ttft), ("tpot", tpot), ("itl", itl)):
        summary[f"{name}_mean_ms"] = 1e3 * sum(values) / len(values) if values else 0.0
        for q in PERCENTILES:
            summary[f"{name}_p{q}_ms"] = 1e3 * percentile(values, q)
    return summary


def _ratio(part: float | None, whole: float | None) -> float | None:
    return part / whole if part is not None and whole else None


def print_summary(summary: dict) -> None:
    s = summary
    rate = "inf" if s["request_rate"] is None else f"{s['request_rate']:g}/s"
    print(f"model {s['model']} ({s['endpoint']}), concurrency {s['concurrency']}, request rate {rate}, "
          f"seed {s['seed']}")
    print(f"workload      input {s['input_len']} tokens, output {s['output_len']}, temperature {s['temperature']:g}"
          + (f", shared prefix {s['shared_prefix_len']} x {s['num_prefixes']}" if s["shared_prefix_len"] else "")
          + (f", {s['num_turns']} turns a conversation" if s["num_turns"] > 1 else ""))
    print(f"prompt length {s['prompt_lengths']}")
    print(f"requests      {s['completed']} ok, {s['failed']} failed in {s['duration_s']:.2f} s "
          f"({s['requests_per_s']:.2f} req/s); mean prompt {s['mean_prompt_tokens']:.1f} tokens (server's count)")
    print(f"throughput    {s['output_tokens_per_s']:.1f} output tokens/s, {s['total_tokens_per_s']:.1f} total tokens/s "
          f"({s['output_tokens']} output, {s['prompt_tokens']} prompt tokens)")
    print(f"{'':14}{'mean':>10}" + "".join(f"{f'p{q}':>10}" for q in PERCENTILES) + "  (ms)")
    for name in ("ttft", "tpot", "itl"):
        print(f"{name.upper():14}{s[f'{name}_mean_ms']:>10.2f}"
              + "".join(f"{s[f'{name}_p{q}_ms']:>10.2f}" for q in PERCENTILES))
    if s["good_requests"] is not None:
        slo = ", ".join(part for part in (
            f"TTFT <= {s['slo_ttft_ms']:g} ms" if s["slo_ttft_ms"] is not None else "",
            f"TPOT <= {s['slo_tpot_ms']:g} ms" if s["slo_tpot_ms"] is not None else "") if part)
        print(f"goodput       {s['goodput_requests_per_s']:.2f} req/s ({s['good_requests']} of {s['completed']} "
              f"met {slo})")
    if s["reusable_tokens"] is not None:
        print(f"prefix reuse  {s['reusable_tokens']} reusable prompt tokens (shared with an earlier prompt)"
              + (f"; the history re-sent {s['resent_reply_tokens']} reply tokens besides"
                 if s["resent_reply_tokens"] is not None else ""))
    if s["prefix_cache_source"] == "n/a":
        print("prefix cache  n/a (no atlas_ or vllm: prefix_cache_queries/hits counters at /metrics)")
    else:
        print(f"prefix cache  {s['prefix_cache_hits']:.0f} hit of {s['prefix_cache_queries']:.0f} queried tokens "
              f"({_percent(s['prefix_cache_hit_rate'])}), {_percent(s['prefix_cache_hits_of_reusable'])} of the "
              f"reusable (/metrics, {s['prefix_cache_source']})")
    cached = s["usage_cached_tokens"]
    print("cached tokens " + ("n/a (no usage.prompt_tokens_details.cached_tokens)" if cached is None else
                              f"{cached} ({_percent(s['usage_cached_of_reusable'])} of the reusable; from usage)"))
    if s["first_error"]:
        print(f"first error: {s['first_error']}", file=sys.stderr)


def _percent(fraction: float | None) -> str:
    return "n/a" if fraction is None else f"{100 * fraction:.1f}%"


def check_plotting() -> None:
    """Raise ValueError naming the extra to install when matplotlib is missing."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise ValueError(f"--plot needs matplotlib: {PLOT_EXTRA}") from None


def plot(summary: dict, records: list[RequestRecord], path: str) -> None:
    """TTFT, TPOT and ITL distributions and output tokens/s over the run, in one PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    done = [r for r in records if r.result.ok]
    figure, axes = plt.subplots(2, 2, figsize=(11, 7.5))
    series = (
        ("TTFT", [1e3 * r.result.ttft_s for r in done]),
        ("TPOT", [1e3 * t for r in done if (t := r.tpot_s) is not None]),
        ("ITL", [1e3 * (b - a) for r in done for a, b in zip(r.result.chunk_times_s, r.result.chunk_times_s[1:])]),
    )
    for ax, (name, values) in zip(axes.flat, series):
        if values:
            ax.hist(values, bins=50)
            for q, style in zip(PERCENTILES, (":", "--", "-")):
                ax.axvline(percentile(values, q), color="k", linestyle=style, label=f"p{q}")
            ax.legend()
        ax.set_xlabel(f"{name} (ms)")
        ax.set_ylabel("count")
    times, tokens = _output_timeline(done)
    ax = axes.flat[3]
    width_s = max(summary["duration_s"] / 60, 0.05)
    if times:
        bins = int(summary["duration_s"] / width_s) + 1
        ax.hist(times, bins=bins, range=(0, bins * width_s), weights=[t / width_s for t in tokens])
    ax.set_xlabel("seconds into the run")
    ax.set_ylabel("output tokens/s")
    rate = "inf" if summary["request_rate"] is None else f"{summary['request_rate']:g}/s"
    figure.suptitle(f"{summary['model']}: input {summary['input_len']}, output {summary['output_len']}, "
                    f"concurrency {summary['concurrency']}, rate {rate}")
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


def _output_timeline(done: list[RequestRecord]) -> tuple[list[float], list[float]]:
    """(time, tokens) per chunk with text: a request's output tokens spread evenly over its
    chunks, since a chunk does not say how many tokens it carries."""
    times, tokens = [], []
    for record in done:
        chunks = record.result.chunk_times_s
        share = record.result.output_tokens / len(chunks)
        times.extend(record.sent_s + t for t in chunks)
        tokens.extend([share] * len(chunks))
    return times, tokens
