"""The startup phase lines: one format, written by every component, read back by the bench."""

from __future__ import annotations

import logging

import pytest

from atlas.app.bench.startup import parse_starts, phase_table
from atlas.ports.startup import (
    EPOCH_ENVIRONMENT,
    PhaseTimer,
    StartupPhase,
    parse_phase,
    report_phase,
    startup_epoch,
)


def test_a_phase_line_reads_back_as_the_phase_it_reports(caplog):
    with caplog.at_level(logging.INFO, logger="atlas.startup"):
        reported = report_phase("weights", 3.25, "14.96 GiB, 4.60 GB/s; a detail: with colons")
    line = f"2026-11-26 18:00:00,000 INFO atlas.startup: {caplog.records[0].getMessage()}"
    assert parse_phase(line) == StartupPhase("weights", 3.25, round(reported.at_s, 2), reported.detail)
    assert parse_phase("INFO atlas: loading the model") is None


def test_a_phase_counts_from_the_epoch_the_environment_gives(monkeypatch):
    import time

    monkeypatch.setenv(EPOCH_ENVIRONMENT, repr(time.time() - 100.0))
    assert 99.0 < report_phase("graphs", 1.0).at_s < 200.0
    monkeypatch.delenv(EPOCH_ENVIRONMENT)
    own_start = startup_epoch()  # this process's: when it first imported the module
    monkeypatch.setenv(EPOCH_ENVIRONMENT, "not a number")
    assert startup_epoch() == own_start


def test_a_phase_name_may_not_hold_the_separator():
    with pytest.raises(ValueError, match="colon"):
        report_phase("weights: bf16", 1.0)


def test_a_lap_detail_may_be_a_rate_of_its_seconds():
    timer = PhaseTimer()
    phase = timer.lap("weights", lambda seconds: f"{2.0 / seconds:.1f} per second")
    assert phase.seconds > 0 and phase.detail.endswith("per second")
    assert timer.lap("graphs").seconds < 60


def test_the_table_orders_phases_by_when_they_ended_and_ends_with_the_first_token():
    log = "\n".join([
        "x INFO atlas.startup: startup: weights: 3.00 s (at 6.50 s); 15 GiB",
        "noise",
        "x INFO atlas.startup: startup: api process: 1.00 s (at 1.00 s)",
        "x INFO atlas.startup: startup: kernels: 0.20 s (at 3.20 s); sm_90a, 10 modules",
    ])
    rows = phase_table(log, 9.75).splitlines()
    assert [row.split()[0] for row in rows[1:]] == ["api", "kernels", "weights", "first"]
    assert rows[-1].split()[2] == "9.75"


def test_starts_are_checked_before_any_server_runs():
    assert parse_starts("cold, nvrtc,warm") == ["cold", "nvrtc", "warm"]
    for bad in ("warm", "cold,hot", ""):
        with pytest.raises(ValueError, match="--starts"):
            parse_starts(bad)
