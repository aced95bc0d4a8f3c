"""Token constraints in the engine on a small random model: masks bind every draw, steps still
overlap, graphs read the mask buffer, n > 1 forks one constraint, a forbidden token fails the
request, and a thinking budget forces the end of the block.

The fake grammar allows, at output position i, the ids below 90 congruent to i modulo 3, and
after `length` tokens only end-of-sequence: a random model follows it only through the mask.
"""

from __future__ import annotations

import numpy as np
import pytest
from helpers.tiny_engine import EOS, build_core, prompts, run

from atlas.domain.constraints import ForkedConstraints, TokenConstraint
from atlas.domain.reasoning_budget import ReasoningMarkers
from atlas.domain.requests import FinishReason, Request, SamplingParams

EOS_ID = next(iter(EOS))
THINK, END_THINK, NEWLINE, BLANK_LINE = 60, 61, 10, 11


class ResidueGrammar:
    """A GrammarMatcher: position i allows the ids below 90 that are i mod 3; then only eos."""

    def __init__(self, length: int, position: int = 0, lying_token: int | None = None) -> None:
        self.length = length
        self.position = position
        self.lying_token = lying_token  # allowed by the mask, refused by accept (a broken grammar)
        self.broken = False

    def allowed(self) -> list[int]:
        if self.position >= self.length:
            return [EOS_ID]
        ids = [t for t in range(90) if t % 3 == self.position % 3]
        return ids + [self.lying_token] if self.lying_token is not None else ids

    def fill_bitmask(self, bitmask_row: np.ndarray) -> None:
        bitmask_row[:] = 0
        words = bitmask_row.view(np.uint32)
        for token_id in self.allowed():
            words[token_id >> 5] |= np.uint32(1 << (token_id & 31))

    def accept_token(self, token_id: int) -> bool:
        if token_id == self.lying_token or token_id not in self.allowed():
            self.broken = True
            return False
        self.position += 1
        return True

    def rollback(self, num_tokens: int) -> None:
        self.position -= num_tokens

    def fork(self) -> ResidueGrammar:
        return ResidueGrammar(self.length, self.position, self.lying_token)

    @property
    def is_accepting(self) -> bool:
        return self.position >= self.length

    @property
    def is_finished(self) -> bool:
        return self.position > self.length or self.broken


def residue_source(length: int, constrained_ids=None, builds=None, **grammar) -> ForkedConstraints:
    def key_of(request):
        return "residues" if constrained_ids is None or request.request_id in constrained_ids else None

    def build(key):
        if builds is not None:
            builds.append(key)
        return TokenConstraint(ResidueGrammar(length, **grammar))

    return ForkedConstraints(key_of, build)


def follows_residues(tokens: list[int], length: int) -> bool:
    body, rest = tokens[:length], tokens[length:]
    return all(t < 90 and t % 3 == i % 3 for i, t in enumerate(body)) and rest in ([], [EOS_ID])


SAMPLED = SamplingParams(temperature=1.0, max_tokens=20)


def test_masks_bind_every_draw_and_keep_the_steps_overlapping(rng):
    """Constrained and free requests share batches; each constrained one gives the tokens it
    gives alone (seeded draws ignore neighbours), every draw obeys its grammar, the grammar's
    end is followed by eos, and the steps still overlap (placeholders gathered on the device)."""
    length = 9
    requests = [Request(f"r{i}", p, SAMPLED, seed=40 + i) for i, p in enumerate(prompts(8, rng))]
    constrained = {f"r{i}" for i in range(0, 8, 2)}
    core = build_core(constraints=residue_source(length, constrained))
    awaiting_with_placeholders = []
    original_submit = core.executor.submit

    def spying_submit(batch):
        if batch.awaits_masks:
            awaiting_with_placeholders.append(any(s.placeholder_row is not None for s in batch.sequences))
        return original_submit(batch)

    core.executor.submit = spying_submit
    together = run(core, requests)
    assert any(awaiting_with_placeholders)
    for request in requests:
        tokens = together[request.request_id]
        if request.request_id in constrained:
            assert follows_residues(tokens, length) and tokens[-1] == EOS_ID, tokens
            alone = build_core(constraints=residue_source(length))
            assert run(alone, [request])[request.request_id] == tokens
        else:
            assert not follows_residues(tokens, length)  # the random model does not obey by itself
    assert core.stats().num_blocks_free == 400


@pytest.mark.parametrize("params", [SAMPLED, SamplingParams(temperature=0.0, max_tokens=20, logprobs=2)],
                         ids=["sampled", "greedy-logprobs"])
def test_decode_graphs_sample_through_the_mask_buffer(rng, params):
    length = 7
    requests = [Request(f"r{i}", p, params, seed=i) for i, p in enumerate(prompts(6, rng))]
    eager = run(build_core(constraints=residue_source(length)), requests)
    graphed = build_core(graph_sizes=(1, 2, 4, 8), constraints=residue_source(length))
    assert run(graphed, requests) == eager
    assert all(follows_residues(tokens, length) for tokens in eager.values())
    masked_samplers = [key for key in graphed.executor._sampler_graphs if key[1]]
    assert bool(masked_samplers) == (params.logprobs is None)  # logprobs sample eagerly


def test_the_n_sequences_of_a_request_fork_one_constraint(rng):
    builds = []
    source = residue_source(6, builds=builds)
    prompt = prompts(1, rng)[0]
    requests = [Request(f"req-{i}", prompt, SAMPLED, seed=100 + i) for i in range(4)]
    tokens = run(build_core(constraints=source), requests)
    assert builds == ["residues"]
    assert all(follows_residues(t, 6) for t in tokens.values())
    assert len({tuple(t) for t in tokens.values()}) > 1  # each fork goes its own way


def test_a_token_the_constraint_forbids_fails_the_request_and_frees_its_blocks(rng):
    """A grammar whose mask allows a token it then refuses (as a sampler ignoring the mask would
    make happen): the request ends with an error; its neighbour runs on."""
    bias = {17: 100.0}  # the lying token wins every draw
    liar = Request("liar", prompts(1, rng)[0], SamplingParams(temperature=0.0, max_tokens=10, logit_bias=bias), seed=1)
    honest = Request("honest", prompts(1, rng)[0], SamplingParams(temperature=0.0, max_tokens=10), seed=2)
    core = build_core(constraints=residue_source(20, {"liar"}, lying_token=17))
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

    def build(key):
        return TokenConstraint(ResidueGrammar(length), markers, starts_in_reasoning=True, thinking_budget=budget)

    source = ForkedConstraints(lambda request: "think", build)
    params = SamplingParams(temperature=1.0, max_tokens=30, logit_bias={END_THINK: -100.0})  # never ends by itself
    requests = [Request(f"t{i}", p, params, seed=i) for i, p in enumerate(prompts(3, rng))]
    for tokens in run(build_core(constraints=source), requests).values():
        assert END_THINK not in tokens[:budget]
        assert tokens[budget : budget + 3] == [NEWLINE, END_THINK, BLANK_LINE]
        assert follows_residues(tokens[budget + 3 :], length)
