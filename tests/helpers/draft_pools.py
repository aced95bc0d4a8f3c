"""What the draft-model and MTP speculation tests share about the proposer's own pool of KV
blocks (a draft model's cache, the MTP heads' cache): its invariants checked after every step,
every block back when the requests end, finished or aborted mid-stream."""

from __future__ import annotations


def proposer_of(core):
    return core.scheduler.speculation.proposer


def checking_pool(core):
    """`core`, its `step` now also checking the proposer pool's invariants after every step."""
    original_step = core.step

    def step():
        result = original_step()
        proposer_of(core).check_invariants()
        return result

    core.step = step
    return core


def assert_all_blocks_back(core):
    stats = core.stats()
    assert stats.num_blocks_free == stats.num_blocks_total
    proposer = proposer_of(core)
    assert proposer.num_free_blocks == proposer.num_blocks and proposer.num_sequences == 0


def assert_aborting_mid_stream_frees_the_pool(core, requests, expected, aborted, at_step):
    """Run `requests` on `core`, aborting `aborted` at step `at_step` (the pool in use by then):
    the others produce `expected` exactly, the aborted ones a prefix of theirs, every block
    returns, and both pools' invariants hold after every step."""
    for request in requests:
        core.add_request(request)
    tokens = {r.request_id: [] for r in requests}
    for step in range(200):
        if not core.has_unfinished:
            break
        if step == at_step:
            assert proposer_of(core).num_free_blocks < proposer_of(core).num_blocks
            for seq_id in aborted:
                core.abort(seq_id)
        for output in core.step():
            tokens[output.seq_id].extend(output.new_token_ids)
        core.scheduler.check_invariants()
        proposer_of(core).check_invariants()
    for request in requests:
        got, wanted = tokens[request.request_id], expected[request.request_id]
        if request.request_id in aborted:
            assert got == wanted[: len(got)] and len(got) < request.sampling.max_tokens
        else:
            assert got == wanted
    assert_all_blocks_back(core)
