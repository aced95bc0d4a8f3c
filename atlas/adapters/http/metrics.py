"""Prometheus metrics in the text exposition format (version 0.0.4), without a client library.

Counters and histograms are updated on the event loop (no locks needed); gauges are read from
callbacks at scrape time, so engine figures (running, waiting, KV blocks) are never stale.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Mapping, Sequence

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

# seconds; latency buckets from 1 ms to 80 s
TTFT_BUCKETS_S = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                  20.0, 40.0, 80.0)
ITL_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3,
                 0.4, 0.5, 0.75, 1.0, 2.5)
DURATION_BUCKETS_S = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0)


def _labels(names: Sequence[str], values: Sequence[str], extra: str = "") -> str:
    parts = [f'{name}="{_escape(value)}"' for name, value in zip(names, values, strict=True)]
    if extra:
        parts.append(extra)
    return "{" + ",".join(parts) + "}" if parts else ""


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _number(value: float) -> str:
    return repr(float(value)) if value != int(value) else str(int(value))


class Counter:
    """A monotonically increasing count per label combination."""

    def __init__(self, name: str, help_text: str, label_names: Sequence[str] = ()) -> None:
        self.name, self.help_text, self.label_names = name, help_text, tuple(label_names)
        self._values: dict[tuple[str, ...], float] = {}

    def inc(self, labels: tuple[str, ...] = (), amount: float = 1.0) -> None:
        self._values[labels] = self._values.get(labels, 0.0) + amount

    def value(self, labels: tuple[str, ...] = ()) -> float:
        return self._values.get(labels, 0.0)

    def render(self) -> list[str]:
        lines = [f"# HELP {self.name} {self.help_text}", f"# TYPE {self.name} counter"]
        values = self._values or ({(): 0.0} if not self.label_names else {})
        for labels, value in sorted(values.items()):
            lines.append(f"{self.name}{_labels(self.label_names, labels)} {_number(value)}")
        return lines


class Gauge:
    """A value read from `read()` at scrape time; `kind` "counter" for a total kept elsewhere."""

    def __init__(self, name: str, help_text: str, read: Callable[[], float], kind: str = "gauge") -> None:
        self.name, self.help_text, self._read, self.kind = name, help_text, read, kind

    def render(self) -> list[str]:
        return [f"# HELP {self.name} {self.help_text}", f"# TYPE {self.name} {self.kind}",
                f"{self.name} {_number(self._read())}"]


class LabeledGauge:
    """Values by one label read from `read()` at scrape time ({label value: value})."""

    def __init__(self, name: str, help_text: str, label_name: str, read: Callable[[], Mapping[str, float]],
                 kind: str = "gauge") -> None:
        self.name, self.help_text, self.label_name, self._read, self.kind = name, help_text, label_name, read, kind

    def render(self) -> list[str]:
        lines = [f"# HELP {self.name} {self.help_text}", f"# TYPE {self.name} {self.kind}"]
        for label, value in self._read().items():
            lines.append(f"{self.name}{_labels((self.label_name,), (label,))} {_number(value)}")
        return lines


class Histogram:
    """Counts of observations at or below each bucket's upper bound, plus their sum."""

    def __init__(self, name: str, help_text: str, buckets_s: Sequence[float]) -> None:
        self.name, self.help_text = name, help_text
        self.bounds = tuple(sorted(buckets_s))
        self._counts = [0] * (len(self.bounds) + 1)  # the last slot is +Inf only
        self._sum = 0.0
        self._count = 0

    def observe(self, value: float, count: int = 1) -> None:
        """Record `value` `count` times (the gaps of a delta carrying several tokens)."""
        self._counts[bisect.bisect_left(self.bounds, value)] += count
        self._sum += value * count
        self._count += count

    @property
    def count(self) -> int:
        return self._count

    def render(self) -> list[str]:
        lines = [f"# HELP {self.name} {self.help_text}", f"# TYPE {self.name} histogram"]
        cumulative = 0
        for bound, count in zip(self.bounds, self._counts[:-1], strict=True):
            cumulative += count
            lines.append(f'{self.name}_bucket{{le="{_number(bound)}"}} {cumulative}')
        lines.append(f'{self.name}_bucket{{le="+Inf"}} {self._count}')
        lines.append(f"{self.name}_sum {repr(self._sum)}")
        lines.append(f"{self.name}_count {self._count}")
        return lines


class MetricsRegistry:
    """Every metric the server exposes at /metrics, in registration order."""

    def __init__(self) -> None:
        self._metrics: list[Counter | Gauge | LabeledGauge | Histogram] = []

    def counter(self, name: str, help_text: str, label_names: Sequence[str] = ()) -> Counter:
        return self._add(Counter(name, help_text, label_names))

    def gauge(self, name: str, help_text: str, read: Callable[[], float], kind: str = "gauge") -> Gauge:
        return self._add(Gauge(name, help_text, read, kind))

    def labeled_gauge(self, name: str, help_text: str, label_name: str, read: Callable[[], Mapping[str, float]],
                      kind: str = "gauge") -> LabeledGauge:
        return self._add(LabeledGauge(name, help_text, label_name, read, kind))

    def histogram(self, name: str, help_text: str, buckets_s: Sequence[float]) -> Histogram:
        return self._add(Histogram(name, help_text, buckets_s))

    def _add(self, metric):
        if any(m.name == metric.name for m in self._metrics):
            raise ValueError(f"metric {metric.name} is registered twice")
        self._metrics.append(metric)
        return metric

    def render(self) -> str:
        lines: list[str] = []
        for metric in self._metrics:
            lines.extend(metric.render())
        return "\n".join(lines) + "\n"
