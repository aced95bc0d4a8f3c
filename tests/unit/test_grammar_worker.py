"""Token constraints held by a grammar worker (`atlas.domain.served_constraints`): in this process
(`InlineGrammarWorker`) and in a helper process (`atlas.adapters.grammar.process`), each must
give the very tokens the in-process engine gives (its mask thread, `ConstrainedSampling`), on
the fake residue grammar (`helpers.residue_grammar`) over a small random model. Then what only
the process has: its death ends the constrained requests with an error and the engine serves
on; closing it leaves no shared-memory segment.
"""

from __future__ import annotations

import functools
import gc
import os
import signal
import subprocess
import sys
from pathlib import Path

import msgspec
import pytest
from helpers.residue_grammar import EOS_ID, follows_residues, residue_grammars, residues
from helpers.tiny_engine import EOS, VOCAB_SIZE, build_core, prompts, run

from atlas.adapters.grammar.process import GrammarProcess
from atlas.app.builder import uses_grammar_process
from atlas.app.settings import EngineSettings, SettingsError
from atlas.domain.grammar_service import GrammarService, InlineGrammarWorker
from atlas.domain.requests import (
    FinishReason,
    OutputConstraint,
    ParameterError,
    ReasoningMarkers,
    Request,
    SamplingParams,
)
from atlas.domain.speculative.config import SpeculativeConfig
from atlas.ports.grammar import Regex

NUM_WORDS = (VOCAB_SIZE + 31) // 32
MAX_ROWS = 256
SAMPLED = SamplingParams(temperature=1.0, max_tokens=20)
THINK, END_THINK, NEWLINE, BLANK_LINE = 60, 61, 10, 11


def inline_worker() -> InlineGrammarWorker:
    return InlineGrammarWorker(GrammarService(residue_grammars(VOCAB_SIZE), EOS, NUM_WORDS), NUM_WORDS)


def process_worker() -> GrammarProcess:
    return GrammarProcess(functools.partial(residue_grammars, VOCAB_SIZE), EOS, MAX_ROWS, NUM_WORDS)


WORKERS = {"inline": inline_worker, "process": process_worker}


def served_core(mode: str, **options):
    return build_core(grammars=residue_grammars(VOCAB_SIZE), grammar_worker=WORKERS[mode], **options)


def threaded_core(**options):
    return build_core(grammars=residue_grammars(VOCAB_SIZE), **options)


def constrained(request: Request, constraint) -> Request:
    return msgspec.structs.replace(request, constraint=constraint)


def run_closed(core, requests) -> dict[str, list[int]]:
    try:
        return run(core, requests)
    finally:
        core.close()


def run_outputs(core, requests) -> list:
    """Every output of `requests` run together, the invariants checked each step; closed after."""
    outputs = []
    for request in requests:
        core.add_request(request)
    try:
        while core.has_unfinished:
            outputs += core.step()
            core.scheduler.check_invariants()
    finally:
        core.close()
    return outputs


@pytest.fixture(params=list(WORKERS))
def mode(request) -> str:
    return request.param


@pytest.mark.parametrize("graph_sizes", [(), (1, 2, 4, 8)], ids=["eager", "graphs"])
def test_constrained_and_free_requests_give_the_in_process_engine_s_tokens(rng, mode, graph_sizes):
    length = 9
    requests = [Request(f"r{i}", p, SAMPLED, seed=40 + i) for i, p in enumerate(prompts(8, rng))]
    requests = [constrained(r, residues(length)) if i % 2 == 0 else r for i, r in enumerate(requests)]
    served = served_core(mode, graph_sizes=graph_sizes)
    tokens = run_closed(served, requests)
    assert tokens == run_closed(threaded_core(graph_sizes=graph_sizes), requests)
    for request in requests[::2]:
        assert follows_residues(tokens[request.request_id], length) and tokens[request.request_id][-1] == EOS_ID
    assert served.stats().num_blocks_free == 400


def test_the_n_sequences_of_a_request_each_go_their_own_way(rng, mode):
    prompt = prompts(1, rng)[0]
    requests = [Request(f"req-{i}", prompt, SAMPLED, seed=100 + i, constraint=residues(6)) for i in range(4)]
    tokens = run_closed(served_core(mode), requests)
    assert all(follows_residues(t, 6) for t in tokens.values()) and len({tuple(t) for t in tokens.values()}) > 1


def test_a_grammar_that_does_not_compile_is_a_parameter_error_naming_the_field(rng, mode):
    core = served_core(mode)
    request = Request("bad", prompts(1, rng)[0], SAMPLED, seed=1,
                      constraint=OutputConstraint(Regex("[a-z]+"), "structured_outputs.regex"))
    try:
        with pytest.raises(ParameterError, match="structured_outputs.regex") as caught:
            core.add_request(request)
        assert caught.value.field == "structured_outputs.regex" and "not a residue grammar" in str(caught.value)
        assert not core.has_unfinished
        good = Request("good", prompts(1, rng)[0], SAMPLED, seed=2, constraint=residues(5))
        assert follows_residues(run(core, [good])["good"], 5)
    finally:
        core.close()


def test_a_forbidden_token_fails_its_request_and_spares_the_others(rng, mode):
    bias = {17: 100.0}  # the lying token wins every draw
    liar = Request("liar", prompts(1, rng)[0], SamplingParams(temperature=0.0, max_tokens=10, logit_bias=bias), seed=1,
                   constraint=residues(20, lying_token=17))
    honest = [Request(f"honest{i}", p, SAMPLED, seed=2 + i, constraint=residues(9))
              for i, p in enumerate(prompts(3, rng))]
    alone = {r.request_id: run_closed(threaded_core(), [r])[r.request_id] for r in honest}
    core = served_core(mode)
    outputs = run_outputs(core, (*honest, liar))
    failed = [o for o in outputs if o.seq_id == "liar"]
    assert len(failed) == 1 and "forbids" in failed[0].error and failed[0].finish_reason is FinishReason.ABORT
    for request in honest:
        assert [t for o in outputs if o.seq_id == request.request_id for t in o.new_token_ids] == alone[
            request.request_id]
    assert core.stats().num_blocks_free == 400


def test_a_thinking_budget_forces_the_end_of_the_block_then_the_grammar(rng, mode):
    markers = ReasoningMarkers(THINK, END_THINK, (NEWLINE, END_THINK, BLANK_LINE))
    constraint = residues(4, reasoning=markers, thinking_budget=5)
    params = SamplingParams(temperature=1.0, max_tokens=30, logit_bias={END_THINK: -100.0})
    requests = [Request(f"t{i}", p, params, seed=i, constraint=constraint) for i, p in enumerate(prompts(3, rng))]
    for tokens in run_closed(served_core(mode), requests).values():
        assert tokens[5:8] == [NEWLINE, END_THINK, BLANK_LINE] and follows_residues(tokens[8:], 4)


def test_sequences_preempted_after_an_early_accept_stay_on_their_grammar(rng, mode):
    params = SamplingParams(temperature=1.0, max_tokens=24)
    requests = [Request(f"r{i}", p, params, seed=60 + i, constraint=residues(12))
                for i, p in enumerate(prompts(6, rng))]
    alone = {r.request_id: run_closed(threaded_core(), [r])[r.request_id] for r in requests}
    core = served_core(mode, num_blocks=24)
    assert run_closed(core, requests) == alone
    assert core.stats().num_preemptions and core.stats().num_blocks_free == 24


@pytest.mark.parametrize("params", [SAMPLED, SamplingParams(temperature=0.0, max_tokens=20),
                                    SamplingParams(temperature=0.8, max_tokens=20, n=2)],
                         ids=["sampled", "greedy", "n2"])
def test_loose_masks_give_the_exact_masks_tokens(rng, mode, params):
    length = 12
    requests = [Request(f"r{i}", p, params, seed=70 + i) for i, p in enumerate(prompts(6, rng, 3, 30))]
    exact = run_closed(threaded_core(), [constrained(r, residues(length)) for r in requests])
    core = served_core(mode)
    assert run_closed(core, [constrained(r, residues(length, loose=True)) for r in requests]) == exact
    assert core.num_resampled_tokens > 0 and core.stats().num_blocks_free == 400


def test_loose_masks_hold_at_block_boundaries_under_preemption(rng, mode):
    params = SamplingParams(temperature=1.0, max_tokens=30)
    requests = [Request(f"r{i}", p, params, seed=5 + i) for i, p in enumerate(prompts(8, rng, 3, 12))]
    exact = run_closed(threaded_core(num_blocks=40), [constrained(r, residues(24)) for r in requests])
    core = served_core(mode, num_blocks=40)
    assert run_closed(core, [constrained(r, residues(24, loose=True)) for r in requests]) == exact
    assert core.num_resampled_tokens > 0 and core.stats().num_preemptions > 0
    assert core.stats().num_blocks_free == 40


@pytest.mark.parametrize("loose", [False, True])
def test_a_grammar_the_engine_gives_up_on_is_the_request_s_error(rng, mode, loose):
    giving_up = Request("giving-up", prompts(1, rng)[0], SAMPLED, seed=1,
                        constraint=residues(20, gives_up_at=5, loose=loose))
    honest = [Request(f"honest{i}", p, SAMPLED, seed=2 + i, constraint=residues(9, loose=loose))
              for i, p in enumerate(prompts(3, rng))]
    alone = {r.request_id: run_closed(threaded_core(), [r])[r.request_id] for r in honest}
    core = served_core(mode)
    outputs = run_outputs(core, (*honest, giving_up))
    mine = [o for o in outputs if o.seq_id == "giving-up"]
    failed = [o for o in mine if o.error is not None]
    assert len(failed) == 1 and failed[0].error_field == "response_format" and "gave up" in failed[0].error
    assert sum(len(o.new_token_ids) for o in mine) == 5
    for request in honest:
        assert [t for o in outputs if o.seq_id == request.request_id for t in o.new_token_ids] == alone[
            request.request_id]
    assert core.stats().num_blocks_free == 400


def test_an_abort_while_its_next_mask_fills_spares_the_others(rng, mode):
    requests = [Request(f"r{i}", p, SAMPLED, seed=40 + i, constraint=residues(9))
                for i, p in enumerate(prompts(4, rng))]
    alone = {r.request_id: run_closed(threaded_core(), [r])[r.request_id] for r in requests[1:]}
    core = served_core(mode)
    tokens: dict[str, list[int]] = {r.request_id: [] for r in requests}
    for request in requests:
        core.add_request(request)
    aborted_while_filling = False
    try:
        while core.has_unfinished:
            for output in core.step():
                tokens[output.seq_id].extend(output.new_token_ids)
            if len(tokens["r0"]) == 3 and core._constrained.has("r0"):
                aborted_while_filling = core._constrained.filling
                core.abort("r0")
            core.scheduler.check_invariants()
    finally:
        core.close()
    assert aborted_while_filling and not core._constrained.has("r0")
    assert {k: v for k, v in tokens.items() if k != "r0"} == alone


def test_drafts_are_checked_against_each_sequence_grammar(rng, mode):
    ngram = SpeculativeConfig.from_json('{"method": "ngram", "num_speculative_tokens": 3}')
    bias = {6: 4.0, 9: 4.0, 12: 4.0}
    requests = [Request(f"r{i}", p, SamplingParams(temperature=t, max_tokens=30, logit_bias=bias), seed=i,
                        constraint=residues(24))
                for i, (p, t) in enumerate(zip(prompts(6, rng), (0.0, 0.8) * 3))]
    core = served_core(mode, speculative=ngram)
    tokens = run_closed(core, requests)
    assert tokens == run_closed(threaded_core(), requests)
    assert core.stats().num_spec_draft_tokens > 0


def _segments() -> set[str]:
    return set(os.listdir("/dev/shm")) if Path("/dev/shm").is_dir() else set()


def test_a_killed_grammar_process_ends_the_constrained_requests_and_the_engine_serves_on(rng):
    """The helper dies mid-run: each constrained request ends once with an error (no hang, no
    exception out of `step`), the free ones give their tokens, every block comes back, and the
    next constrained request starts a fresh helper."""
    before = _segments()
    free = [Request(f"free{i}", p, SAMPLED, seed=10 + i) for i, p in enumerate(prompts(3, rng))]
    bound = [Request(f"bound{i}", p, SamplingParams(temperature=1.0, max_tokens=60), seed=20 + i,
                     constraint=residues(50)) for i, p in enumerate(prompts(3, rng))]
    alone = run_closed(threaded_core(), free)
    core = served_core("process")
    outputs = []
    for request in (*free, *bound):
        core.add_request(request)
    try:
        for _ in range(6):
            outputs += core.step()
        os.kill(core._constrained._worker.pid, signal.SIGKILL)
        while core.has_unfinished:
            outputs += core.step()
            core.scheduler.check_invariants()
        for request in bound:
            mine = [o for o in outputs if o.seq_id == request.request_id]
            ended = [o for o in mine if o.finish_reason is not None]
            assert len(ended) == 1 and ended[0].finish_reason is FinishReason.ABORT
            assert "grammar process stopped" in ended[0].error and ended[0].error_field is None
        for request in free:
            assert [t for o in outputs if o.seq_id == request.request_id for t in o.new_token_ids] == alone[
                request.request_id]
        assert core.stats().num_blocks_free == 400
        again = Request("again", prompts(1, rng)[0], SAMPLED, seed=3, constraint=residues(5))
        assert follows_residues(run(core, [again])["again"], 5)
    finally:
        core.close()
    assert _segments() <= before


def test_closing_the_engine_stops_the_helper_and_unlinks_its_segment(rng):
    """The segment goes at `close`; the wake-up semaphore's name (multiprocessing's) once the
    worker object is collected."""
    before = _segments()
    core = served_core("process")
    request = Request("r", prompts(1, rng)[0], SAMPLED, seed=1, constraint=residues(5))
    run(core, [request])
    worker = core._constrained._worker
    assert any(name.startswith("psm_") for name in _segments() - before)
    core.close()
    assert not any(name.startswith("psm_") for name in _segments() - before)
    assert not worker._process.is_alive()
    del worker, core
    gc.collect()
    assert _segments() <= before


@pytest.mark.parametrize("choice, backend, cores, machine, expected", [
    ("auto", "cuda", 16, "x86_64", True),
    ("auto", "cuda", 4, "x86_64", False),  # the engine, the helper and llguidance's fill want a core each
    ("auto", "mock", 16, "x86_64", False),
    ("auto", "cuda", 64, "aarch64", False),
    ("off", "cuda", 16, "x86_64", False),
    ("on", "mock", 2, "x86_64", True),
])
def test_auto_puts_the_grammar_in_a_process_only_for_cuda_on_a_large_x86_host(choice, backend, cores, machine,
                                                                                  expected):
    settings = EngineSettings(model="m", grammar_process=choice)
    assert uses_grammar_process(settings, backend, cores=cores, machine=machine) is expected


def test_the_grammar_process_is_refused_where_its_store_order_does_not_hold():
    with pytest.raises(SettingsError, match="x86-64.*aarch64: use off"):
        uses_grammar_process(EngineSettings(model="m", grammar_process="on"), "cuda", cores=64, machine="aarch64")


def test_a_script_without_a_main_guard_is_not_run_again_in_the_helper(tmp_path):
    """`spawn` would import the parent's `__main__` in the helper: a script that starts an engine
    at top level would run twice (and load its model twice)."""
    tests = Path(__file__).resolve().parents[1]
    script = tmp_path / "unguarded.py"
    script.write_text(
        "import functools, sys\n"
        f"sys.path[:0] = [{str(tests)!r}, {str(tests.parent)!r}]\n"
        "print('script body ran', flush=True)\n"
        "from helpers.residue_grammar import residue_grammars\n"
        "from helpers.tiny_engine import EOS, VOCAB_SIZE\n"
        "from atlas.adapters.grammar.process import GrammarProcess\n"
        "worker = GrammarProcess(functools.partial(residue_grammars, VOCAB_SIZE), EOS, 4, (VOCAB_SIZE + 31) // 32)\n"
        "assert worker.admits([], []) == ()\n"
        "worker.close()\n"
        "print('done', flush=True)\n")
    ran = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert ran.returncode == 0, ran.stderr[-2000:]
    assert ran.stdout.split("\n").count("script body ran") == 1 and "done" in ran.stdout, ran.stdout
