"""Token constraints in the engine on a small random model: masks bind every draw, steps still
overlap, graphs read the mask buffer, n > 1 compile one grammar, a forbidden token fails the
request, and a thinking budget forces the end of the block.

Requests carry their constraints as `OutputConstraint`s; the fake grammar (`helpers.residue_grammar`)
allows, at output position i, the ids below 90 congruent to i modulo 3, and after `length`
tokens only end-of-sequence: a random model follows it only through the mask.
"""

from __future__ import annotations

import functools

import msgspec
import pytest
from helpers.residue_grammar import EOS_ID, follows_residues, residue_grammars, residues
from helpers.tiny_engine import VOCAB_SIZE, build_core, prompts, run

from atlas.domain.requests import (
    FinishReason,
    OutputConstraint,
    ParameterError,
    ReasoningMarkers,
    Request,
    SamplingParams,
)
from atlas.ports.grammar import Regex

THINK, END_THINK, NEWLINE, BLANK_LINE = 60, 61, 10, 11


def constrained(request: Request, constraint) -> Request:
    return msgspec.structs.replace(request, constraint=constraint)


def grammar_core(**options):
    return build_core(grammars=residue_grammars(VOCAB_SIZE), **options)


SAMPLED = SamplingParams(temperature=1.0, max_tokens=20)


def test_masks_bind_every_draw_and_keep_the_steps_overlapping(rng):
    """Constrained and free requests share batches; each constrained one gives the tokens it
    gives alone (seeded draws ignore neighbours), every draw obeys its grammar, the grammar's
    end is followed by eos, and the steps still overlap (placeholders gathered on the device)."""
    length = 9
    requests = [Request(f"r{i}", p, SAMPLED, seed=40 + i) for i, p in enumerate(prompts(8, rng))]
    requests = [constrained(r, residues(length)) if i % 2 == 0 else r for i, r in enumerate(requests)]
    core = grammar_core()
    awaiting_with_placeholders = []
    original_submit = core.executor.submit

    def spying_submit(batch, before_launch=None):
        if batch.awaits_masks:
            awaiting_with_placeholders.append(any(s.placeholder_row is not None for s in batch.sequences))
        return original_submit(batch, before_launch)

    core.executor.submit = spying_submit
    together = run(core, requests)
    assert any(awaiting_with_placeholders)
    for request in requests:
        tokens = together[request.request_id]
        if request.constraint is not None:
            assert follows_residues(tokens, length) and tokens[-1] == EOS_ID, tokens
            alone = grammar_core()
            assert run(alone, [request])[request.request_id] == tokens
        else:
            assert not follows_residues(tokens, length)  # the random model does not obey by itself
    assert core.stats().num_blocks_free == 400


@pytest.mark.parametrize("params", [SAMPLED, SamplingParams(temperature=0.0, max_tokens=20, logprobs=2)],
                         ids=["sampled", "greedy-logprobs"])
def test_decode_graphs_sample_through_the_mask_buffer(rng, params):
    length = 7
    requests = [Request(f"r{i}", p, params, seed=i, constraint=residues(length)) for i, p in enumerate(prompts(6, rng))]
    eager = run(grammar_core(), requests)
    graphed = grammar_core(graph_sizes=(1, 2, 4, 8))
    assert run(graphed, requests) == eager
    assert all(follows_residues(tokens, length) for tokens in eager.values())
    masked_samplers = [key for key in graphed.executor._sampler_graphs if key[1]]
    assert bool(masked_samplers) == (params.logprobs is None)  # logprobs sample eagerly


def test_the_n_sequences_of_a_request_compile_one_grammar(rng):
    prompt = prompts(1, rng)[0]
    requests = [Request(f"req-{i}", prompt, SAMPLED, seed=100 + i, constraint=residues(6)) for i in range(4)]
    core = grammar_core()
    tokens = run(core, requests)
    assert core.grammars.compiler.compiled == ["residues 6"]
    assert all(follows_residues(t, 6) for t in tokens.values())
    assert len({tuple(t) for t in tokens.values()}) > 1  # each sequence goes its own way


def test_a_grammar_the_engine_cannot_compile_is_refused_naming_the_field(rng):
    request = Request("bad", prompts(1, rng)[0], SAMPLED, seed=1)
    unknown = OutputConstraint(Regex("[a-z]+"), "structured_outputs.regex")
    with pytest.raises(ParameterError, match="structured_outputs.regex"):
        grammar_core().add_request(constrained(request, unknown))
    with pytest.raises(ParameterError, match="no grammar compiler"):
        build_core().add_request(constrained(request, residues(4)))


def test_a_token_the_constraint_forbids_fails_the_request_and_frees_its_blocks(rng):
    """A grammar whose mask allows a token it then refuses (as a sampler ignoring the mask would
    make happen): the request ends with an error; its neighbour runs on."""
    bias = {17: 100.0}  # the lying token wins every draw
    liar = Request("liar", prompts(1, rng)[0], SamplingParams(temperature=0.0, max_tokens=10, logit_bias=bias), seed=1,
                   constraint=residues(20, lying_token=17))
    honest = Request("honest", prompts(1, rng)[0], SamplingParams(temperature=0.0, max_tokens=10), seed=2)
    core = grammar_core()
    for request in (liar, honest):
        core.add_request(request)
    outputs = []
    while core.has_unfinished:
        outputs += core.step()
        core.scheduler.check_invariants()
    failed = [o for o in outputs if o.seq_id == "liar"]
    assert len(failed) == 1 and failed[0].error and "forbids" in failed[0].error
    assert failed[0].finish_reason is FinishReason.ABORT and failed[0].new_token_ids == ()
    assert sum(len(o.new_token_ids) for o in outputs if o.seq_id == "honest") == 10
    assert core.stats().num_blocks_free == 400


def test_a_thinking_budget_forces_the_end_of_the_block_then_the_grammar(rng):
    markers = ReasoningMarkers(THINK, END_THINK, (NEWLINE, END_THINK, BLANK_LINE))
    budget, length = 5, 4
    constraint = residues(length, reasoning=markers, thinking_budget=budget)
    params = SamplingParams(temperature=1.0, max_tokens=30, logit_bias={END_THINK: -100.0})  # never ends by itself
    requests = [Request(f"t{i}", p, params, seed=i, constraint=constraint) for i, p in enumerate(prompts(3, rng))]
    for tokens in run(grammar_core(), requests).values():
        assert END_THINK not in tokens[:budget]
        assert tokens[budget : budget + 3] == [NEWLINE, END_THINK, BLANK_LINE]
        assert follows_residues(tokens[budget + 3 :], length)


def test_the_output_cannot_end_inside_the_reasoning_block(rng):
    """A model that would end at once (eos biased up) reasons up to its budget instead, then the
    forced end, the grammar and only then eos."""
    markers = ReasoningMarkers(THINK, END_THINK, (NEWLINE, END_THINK, BLANK_LINE))
    constraint = residues(4, reasoning=markers, thinking_budget=5)
    params = SamplingParams(temperature=1.0, max_tokens=30, logit_bias={EOS_ID: 100.0, END_THINK: -100.0})
    requests = [Request(f"e{i}", p, params, seed=i, constraint=constraint) for i, p in enumerate(prompts(2, rng))]
    for tokens in run(grammar_core(), requests).values():
        assert EOS_ID not in tokens[:5] and tokens[5:8] == [NEWLINE, END_THINK, BLANK_LINE]
        assert follows_residues(tokens[8:], 4) and tokens[-1] == EOS_ID


def test_masks_fill_off_the_engine_thread_while_the_next_step_is_scheduled(rng, monkeypatch):
    """The masks of a step fill on the mask thread, started once the step before's sampled ids
    are read and before the scheduler commits them (the fill runs beside the commit); the next
    `step` schedules and stages the next step's inputs before waiting for them, and samples the
    step before sending the next one behind it."""
    import threading

    from atlas.domain.constraints import GrammarRows
    from atlas.domain.scheduler import Scheduler

    length = 9
    requests = [Request(f"r{i}", p, SAMPLED, seed=40 + i, constraint=residues(length))
                for i, p in enumerate(prompts(4, rng))]
    alone = {r.request_id: run(grammar_core(), [r])[r.request_id] for r in requests}
    core = grammar_core()
    events: list[str] = []
    fill_threads: set[str] = set()
    real_fill, real_schedule, real_commit = GrammarRows.fill, Scheduler.schedule, Scheduler.commit
    real_submit = core.executor.submit

    def fill(*args):  # the grammar rows' fill (the rules are planned on the engine's thread)
        fill_threads.add(threading.current_thread().name)
        mask = real_fill(*args)
        events.append("filled")
        return mask

    def submit(batch, before_launch=None):
        pending = real_submit(batch, before_launch)
        real_sample = pending.sample

        def sample(bitmask):
            events.append("sample")
            real_sample(bitmask)

        pending.sample = sample
        events.append("submit")
        return pending

    def schedule(scheduler):
        events.append("schedule")
        return real_schedule(scheduler)

    def commit(scheduler, batch, result):
        events.append("commit-with-fill-started" if core._constrained.filling else "commit")
        return real_commit(scheduler, batch, result)

    monkeypatch.setattr(GrammarRows, "fill", fill)
    monkeypatch.setattr(Scheduler, "schedule", schedule)
    monkeypatch.setattr(Scheduler, "commit", commit)
    core.executor.submit = submit
    buffers = core.executor.buffers
    for name in ("stage_inputs", "send"):
        monkeypatch.setattr(buffers, name, functools.partial(
            lambda real, name, *args: (events.append(name), real(*args))[1], getattr(buffers, name), name))
    try:
        assert run(core, requests) == alone
    finally:
        core.close()
    assert fill_threads and all(name.startswith("atlas-masks") for name in fill_threads)
    order = [e for e in events if e in ("schedule", "stage_inputs", "sample", "send", "submit")]
    samples = [i for i, e in enumerate(order) if e == "sample"]
    assert samples
    for index in samples:  # the next step scheduled and staged first, then this one sampled, then that one sent
        if index + 1 < len(order) and order[index + 1] == "send":
            assert order[index - 2 : index] == ["schedule", "stage_inputs"], order[index - 3 : index + 2]
        else:  # the last step: nothing was scheduled behind it
            assert order[index - 1] == "schedule" and index + 1 == len(order) or order[index + 1] == "schedule"
    assert "commit-with-fill-started" in events
    assert core.stats().num_blocks_free == 400


def test_a_sequence_preempted_after_its_token_was_accepted_early_stays_on_its_grammar(rng):
    """Few blocks: constrained sequences are preempted after being scheduled, so the id the
    engine accepted early (before the scheduler's commit) is not the one committed; the
    constraint is rolled back and the sequence samples that position again, giving the tokens
    it gives alone, and every block returns."""
    length = 12
    params = SamplingParams(temperature=1.0, max_tokens=24)
    requests = [Request(f"r{i}", p, params, seed=60 + i, constraint=residues(length))
                for i, p in enumerate(prompts(6, rng))]
    alone = {r.request_id: run(grammar_core(), [r])[r.request_id] for r in requests}
    core = grammar_core(num_blocks=24)
    undone = []
    real_undo = core._constrained._undo_early

    def undo(seq_id):
        undone.append(seq_id)
        return real_undo(seq_id)

    core._constrained._undo_early = undo
    try:
        assert run(core, requests) == alone
    finally:
        core.close()
    assert core.stats().num_preemptions and undone
    assert core.stats().num_blocks_free == 24


LOOSE_PARAMS = [SAMPLED, SamplingParams(temperature=0.0, max_tokens=20),
                SamplingParams(temperature=0.8, max_tokens=20, n=2)]


@pytest.mark.parametrize("params", LOOSE_PARAMS, ids=["sampled", "greedy", "n2"])
@pytest.mark.parametrize("graph_sizes", [(), (1, 2, 4, 8)], ids=["eager", "graphs"])
def test_loose_masks_give_the_exact_masks_tokens(rng, params, graph_sizes):
    """A grammar whose matchers carry a superset is sampled under the superset's masks; each
    token the grammar refuses is sampled again under the exact mask after the sequence's last
    token is computed again. The Gumbel race's scores are fixed by (seed, position, token), so
    every request gives the very tokens exact masks give, the cache's invariants hold after
    every step, and every block comes back."""
    length = 12
    requests = [Request(f"r{i}", p, params, seed=70 + i) for i, p in enumerate(prompts(6, rng, 3, 30))]
    exact = run(grammar_core(graph_sizes=graph_sizes), [constrained(r, residues(length)) for r in requests])
    core = grammar_core(graph_sizes=graph_sizes)
    loose = run(core, [constrained(r, residues(length, loose=True)) for r in requests])
    assert loose == exact
    assert all(follows_residues(tokens, length) for tokens in loose.values())
    assert core.num_resampled_tokens > 0  # a random model under the loose mask picks wrong residues
    compiled = core.grammars.compiled(residues(length, loose=True).grammar, "response_format")
    assert sum(m.superset.num_fills for m in compiled.matchers) > 0
    stats = core.stats()
    assert stats.num_blocks_free == 400 and stats.num_resampled_tokens == core.num_resampled_tokens
    if params is SAMPLED and not graph_sizes:
        from atlas.adapters.http.server_metrics import ServerMetrics

        text = ServerMetrics(lambda: stats, lambda: True, lambda: 0).render()
        assert f"atlas_structured_output_resampled_tokens_total {stats.num_resampled_tokens}" in text


def test_loose_masks_hold_at_block_boundaries_under_preemption(rng):
    """Resampling rewinds a sequence across page boundaries (4-token blocks fill every few
    tokens) while a small pool preempts: the invariants hold after every step (run checks
    them), and the tokens are those of exact masks."""
    length = 24
    params = SamplingParams(temperature=1.0, max_tokens=30)
    requests = [Request(f"r{i}", p, params, seed=5 + i) for i, p in enumerate(prompts(8, rng, 3, 12))]
    exact = run(grammar_core(num_blocks=40), [constrained(r, residues(length)) for r in requests])
    core = grammar_core(num_blocks=40)
    assert run(core, [constrained(r, residues(length, loose=True)) for r in requests]) == exact
    assert core.num_resampled_tokens > 0 and core.stats().num_preemptions > 0
    assert core.stats().num_blocks_free == 40


@pytest.mark.parametrize("params", [SamplingParams(temperature=1.0, top_p=0.9, max_tokens=12),
                                    SamplingParams(temperature=1.0, top_k=5, max_tokens=12),
                                    SamplingParams(temperature=1.0, min_p=0.1, max_tokens=12),
                                    SamplingParams(temperature=0.0, max_tokens=12, logprobs=1)],
                         ids=["top_p", "top_k", "min_p", "logprobs"])
def test_a_cut_before_the_race_or_logprobs_keep_the_exact_masks(rng, params):
    """A top-p, top-k or min-p cut depends on the mask, and logprobs would be the superset's:
    such rows never sample under the superset."""
    length = 8
    requests = [Request(f"r{i}", p, params, seed=i, constraint=residues(length, loose=True))
                for i, p in enumerate(prompts(3, rng))]
    core = grammar_core()
    tokens = run(core, requests)
    assert all(follows_residues(t, length) for t in tokens.values())
    compiled = core.grammars.compiled(residues(length, loose=True).grammar, "response_format")
    assert sum(m.superset.num_fills for m in compiled.matchers) == 0 and core.num_resampled_tokens == 0


def _spy_threads(monkeypatch, owner, name, log):
    """Record the thread that calls `owner.name` (and what it returned) in `log`."""
    import threading

    real = getattr(owner, name)

    def spy(*args, **kwargs):
        value = real(*args, **kwargs)
        log.append((threading.current_thread().name, value))
        return value

    monkeypatch.setattr(owner, name, spy)


def test_a_token_refused_on_the_mask_thread_is_resampled_on_the_engine_thread(rng, monkeypatch):
    """The mask thread waits for a step's ids and accepts them; a loosely sampled token the
    grammar refuses is handed back, and the engine's thread has the scheduler resample it and
    takes the rows after it: the tokens are those of exact masks, every block comes back."""
    from atlas.domain.constraints import TokenConstraint
    from atlas.domain.scheduler import Scheduler

    length = 12
    requests = [Request(f"r{i}", p, SAMPLED, seed=70 + i) for i, p in enumerate(prompts(6, rng, 3, 30))]
    exact = run(grammar_core(), [constrained(r, residues(length)) for r in requests])
    accepts, resamples = [], []
    _spy_threads(monkeypatch, TokenConstraint, "accept_sampled", accepts)
    _spy_threads(monkeypatch, Scheduler, "resample", resamples)
    core = grammar_core()
    try:
        assert run(core, [constrained(r, residues(length, loose=True)) for r in requests]) == exact
    finally:
        core.close()
    refused_on_mask_thread = [name for name, admitted in accepts if not admitted and name == "atlas-masks"]
    assert refused_on_mask_thread and core.num_resampled_tokens > 0
    assert resamples and {name for name, _ in resamples} == {"MainThread"}
    assert core.stats().num_blocks_free == 400


def test_a_constraint_broken_on_the_mask_thread_ends_its_request_and_spares_the_others(rng, monkeypatch):
    """A token its grammar forbids breaks the constraint while the mask thread accepts the
    step's ids: the others' accepts are rolled back there, the engine's thread ends that request
    with an error, and its constrained neighbours give the tokens they give alone."""
    from atlas.domain.constrained_steps import ConstrainedSampling

    bias = {17: 100.0}  # the lying token wins every draw
    liar = Request("liar", prompts(1, rng)[0], SamplingParams(temperature=0.0, max_tokens=10, logit_bias=bias), seed=1,
                   constraint=residues(20, lying_token=17))
    honest = [Request(f"honest{i}", p, SAMPLED, seed=2 + i, constraint=residues(9))
              for i, p in enumerate(prompts(3, rng))]
    alone = {r.request_id: run(grammar_core(), [r])[r.request_id] for r in honest}
    handed = []
    _spy_threads(monkeypatch, ConstrainedSampling, "accept_early", handed)
    core = grammar_core()
    outputs = _run_checked(core, (*honest, liar))
    assert any(early is not None and early.violation is not None for _, early in handed)
    failed = [o for o in outputs if o.seq_id == "liar"]
    assert len(failed) == 1 and "forbids" in failed[0].error and failed[0].finish_reason is FinishReason.ABORT
    for request in honest:
        got = [t for o in outputs if o.seq_id == request.request_id for t in o.new_token_ids]
        assert got == alone[request.request_id]
    assert core.stats().num_blocks_free == 400


def test_an_abort_while_its_next_mask_fills_spares_the_others(rng):
    """A request aborted between steps, once the mask thread has accepted its token early and
    started the next step's fill: the others give the tokens they give alone, nothing is left
    accepted or filling for it, and every block comes back."""
    length = 9
    requests = [Request(f"r{i}", p, SAMPLED, seed=40 + i, constraint=residues(length))
                for i, p in enumerate(prompts(4, rng))]
    alone = {r.request_id: run(grammar_core(), [r])[r.request_id] for r in requests[1:]}
    core = grammar_core()
    tokens = {r.request_id: [] for r in requests}
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
    assert core.stats().num_blocks_free == 400


def test_a_failed_wait_for_the_ids_on_the_mask_thread_is_raised_by_step(rng):
    """The mask thread waits for a step's sampled ids; when that wait fails (a device error),
    `step` raises it on the engine's thread, as a wait there would."""
    import threading

    requests = [Request(f"r{i}", p, SAMPLED, seed=i, constraint=residues(9)) for i, p in enumerate(prompts(2, rng))]
    core = grammar_core()
    real_submit = core.executor.submit
    waited_on: list[str] = []

    def submit(batch, before_launch=None):
        pending = real_submit(batch, before_launch)
        if core._num_steps == 4:
            def result():
                waited_on.append(threading.current_thread().name)
                raise RuntimeError("the device fell off the bus")

            pending.result = result
        return pending

    core.executor.submit = submit
    for request in requests:
        core.add_request(request)
    try:
        with pytest.raises(RuntimeError, match="fell off the bus"):
            for _ in range(20):
                core.step()
    finally:
        core.close()
    assert waited_on == ["atlas-masks"]


@pytest.mark.parametrize("graph_sizes", [(), (1, 2, 4, 8)], ids=["eager", "graphs"])
def test_masks_fill_in_place_where_the_upload_reads_them(rng, monkeypatch, graph_sizes):
    """The worker offers its masks' host rows (`Worker.mask_rows`), so a step's masks are filled
    there and `stage_mask` copies nothing; the tokens are those of masks filled in a buffer of
    the engine's own and copied."""
    from atlas.domain.step_buffers import StepBuffers
    from atlas.domain.worker import Worker

    length = 8
    requests = [Request(f"r{i}", p, SAMPLED, seed=70 + i, constraint=residues(length))
                for i, p in enumerate(prompts(6, rng))]
    staged: list[bool] = []
    real_stage = StepBuffers.stage_mask

    def stage_mask(buffers, bitmask, num_rows):
        staged.append(bitmask.ctypes.data == buffers.mask_rows().ctypes.data)
        return real_stage(buffers, bitmask, num_rows)

    monkeypatch.setattr(StepBuffers, "stage_mask", stage_mask)
    in_place = grammar_core(graph_sizes=graph_sizes)
    try:
        filled_in_place = run(in_place, requests)
    finally:
        in_place.close()
    assert staged and all(staged)
    staged.clear()
    monkeypatch.setattr(Worker, "mask_rows", lambda worker: None)
    copied = grammar_core(graph_sizes=graph_sizes)
    try:
        assert run(copied, requests) == filled_in_place
    finally:
        copied.close()
    assert staged and not any(staged)
    for request in requests:
        assert follows_residues(filled_in_place[request.request_id], length)
    assert in_place.stats().num_blocks_free == 400


@pytest.mark.parametrize("loose", [False, True])
def test_a_grammar_the_engine_gives_up_on_fails_its_request_as_the_request_s_error(rng, loose):
    """The grammar engine gives up on a matcher mid-answer (llguidance's lexer out of
    expressions on a grammar that compiled): that request ends with an error naming its
    grammar's field (a 400 upstream, not the engine's failure) and no token past the one before;
    its constrained neighbours give the tokens they give alone; every block comes back. With
    loose masks the accept that gives up runs on the mask thread, and the refusal path must not
    resample a matcher that can no longer move."""
    giving_up = Request("giving-up", prompts(1, rng)[0], SAMPLED, seed=1,
                        constraint=residues(20, gives_up_at=5, loose=loose))
    honest = [Request(f"honest{i}", p, SAMPLED, seed=2 + i, constraint=residues(9, loose=loose))
              for i, p in enumerate(prompts(3, rng))]
    alone = {r.request_id: run(grammar_core(), [r])[r.request_id] for r in honest}
    core = grammar_core()
    outputs = _run_checked(core, (*honest, giving_up))
    mine = [o for o in outputs if o.seq_id == "giving-up"]
    failed = [o for o in mine if o.error is not None]
    assert len(failed) == 1 and failed[0].finish_reason is FinishReason.ABORT
    assert failed[0].error_field == "response_format" and "gave up" in failed[0].error
    assert "too many expressions" in failed[0].error and "forbids" not in failed[0].error
    assert sum(len(o.new_token_ids) for o in mine) == 5  # the tokens before the one it gave up on
    for request in honest:
        got = [t for o in outputs if o.seq_id == request.request_id for t in o.new_token_ids]
        assert got == alone[request.request_id]
    assert core.stats().num_blocks_free == 400


def _run_checked(core, requests) -> list:
    """Every output of `requests` run together, the scheduler's invariants checked each step;
    the core's threads closed after."""
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
