"""How much of a run's prompts a prefix cache could reuse, and how much the server says it did.

Reusable tokens: for each prompt in the order the requests were sent, the length of the
longest token prefix it shares with any prompt sent before it. That is what a cache that keeps
every earlier prompt (and nothing generated) could serve at best; block granularity, eviction
and prompts still in flight only lower what a real cache gets.

The server's side comes from its Prometheus counters of prompt tokens looked up in the prefix
cache and of those found, read before and after the run.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

# (queries, hits) counters in tokens, by server
PREFIX_CACHE_COUNTERS = {
    "atlas": ("atlas_prefix_cache_queries_total", "atlas_prefix_cache_hits_total"),
    "vllm": ("vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total"),
}


def reusable_tokens(prompts: Iterable[Sequence[int]]) -> list[int]:
    """Per prompt, in order: its longest common prefix with any earlier prompt, in tokens.

    In lexicographic order the earlier prompt sharing the longest prefix with a new one is
    one of its two neighbours, so a sorted list answers each prompt with two comparisons.
    """
    seen: list[tuple[int, ...]] = []
    shared = []
    for ids in prompts:
        key = tuple(ids)
        at = bisect.bisect_left(seen, key)
        shared.append(max((_common_prefix_len(key, seen[i]) for i in (at - 1, at) if 0 <= i < len(seen)), default=0))
        seen.insert(at, key)
    return shared


def _common_prefix_len(a: tuple[int, ...], b: tuple[int, ...]) -> int:
    # Binary search on slice equality: each comparison runs in C, so long prompts stay cheap.
    low, high = 0, min(len(a), len(b))
    while low < high:
        middle = (low + high + 1) // 2
        if a[:middle] == b[:middle]:
            low = middle
        else:
            high = middle - 1
    return low


@dataclass(frozen=True, slots=True)
class PrefixCacheCounts:
    source: str  # a key of PREFIX_CACHE_COUNTERS
    queries: float  # prompt tokens looked up
    hits: float  # of those, tokens found in the cache

    def minus(self, earlier: PrefixCacheCounts | None) -> PrefixCacheCounts:
        if earlier is None or earlier.source != self.source:
            return self
        return PrefixCacheCounts(self.source, self.queries - earlier.queries, self.hits - earlier.hits)


def prefix_cache_counts(metrics_text: str) -> PrefixCacheCounts | None:
    """The prefix-cache counters in a /metrics page (summed over label sets), or None when it
    has neither Atlas's nor vLLM's."""
    samples = metric_samples(metrics_text)
    for source, (queries, hits) in PREFIX_CACHE_COUNTERS.items():
        if queries in samples and hits in samples:
            return PrefixCacheCounts(source, samples[queries], samples[hits])
    return None


def metric_samples(text: str) -> dict[str, float]:
    """Prometheus text exposition -> sample name: value summed over its label sets.

        name{label="value",...} 12.0 [timestamp]      or      name 12.0
    """
    samples: dict[str, float] = {}
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        if "{" in line:
            name, _, rest = line.partition("{")
            fields = rest.rpartition("}")[2].split()
        else:
            name, *fields = line.split()
        try:
            value = float(fields[0])
        except (IndexError, ValueError):
            continue
        samples[name.strip()] = samples.get(name.strip(), 0.0) + value
    return samples
