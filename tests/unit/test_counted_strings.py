"""Superset masks that count down a bounded string (`atlas.adapters.grammar.counted_strings`),
on llguidance with the real SmolLM2 tokenizer.

The counted mask must never drop a token the schema allows (it stays a superset: the engine's
check decides), must drop the tokens too long for a string's room, and must follow the
matchers through rollback and fork.
"""

from __future__ import annotations

import numpy as np
import pytest
from helpers.checkpoints import smollm2_folder

from atlas.adapters.grammar.counted_strings import counts_strings
from atlas.domain.token_mask import allowed_bits
from atlas.ports.grammar import JsonSchema

FOLDER = smollm2_folder()
pytestmark = pytest.mark.skipif(FOLDER is None, reason="SmolLM2 is not pulled (atlas pull smollm2)")

RECORDS = {"type": "array", "items": {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 12}, "age": {"type": "integer", "minimum": 0, "maximum": 99}},
    "required": ["name", "age"], "additionalProperties": False}}
SCHEMAS = {
    "records": RECORDS,
    "person": {"type": "object", "properties": {
        "name": {"type": "string", "maxLength": 12}, "role": {"enum": ["admin", "user"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 3},
        "zip": {"type": "string", "pattern": "^[0-9]{5}$"}, "note": {"type": "string"}},
        "required": ["name", "role", "tags", "zip", "note"], "additionalProperties": False},
    "min-and-max": {"type": "array", "items": {"type": "string", "minLength": 3, "maxLength": 5}},
    "keys-and-values": {"type": "object", "additionalProperties": {"type": "string", "maxLength": 4},
                        "propertyNames": {"maxLength": 3}},
    "zero-and-wide": {"type": "object", "properties": {
        "a": {"type": "string", "maxLength": 0}, "b": {"type": "string", "maxLength": 100}},
        "required": ["a", "b"]},
    "ref-and-pattern": {"$defs": {"n": {"type": "string", "maxLength": 6, "pattern": "^[a-z ]*$"}},
                        "type": "array", "items": {"$ref": "#/$defs/n"}},
    "all-of": {"type": "object", "properties": {"x": {"allOf": [
        {"type": "string", "maxLength": 5}, {"type": "string", "maxLength": 7}]}}, "required": ["x"]},
}


def masks(matcher, vocab_size: int) -> tuple[np.ndarray, np.ndarray]:
    """(exact, superset) allowed flags [V] at the matcher's position."""
    width = (vocab_size + 31) // 32
    exact, loose = np.zeros(width, np.int32), np.zeros(width, np.int32)
    matcher.fill_bitmask(exact)
    matcher.superset.fill_bitmask(loose)
    return allowed_bits(exact[None], vocab_size)[0], allowed_bits(loose[None], vocab_size)[0]


def test_which_schemas_count_their_strings() -> None:
    assert counts_strings(RECORDS) == 12
    assert counts_strings({"type": "string"}) is None  # no bound
    assert counts_strings({"anyOf": [{"type": "string", "maxLength": 3}, {"type": "integer"}]}) is None
    assert counts_strings(SCHEMAS["zero-and-wide"]) == 100


@pytest.mark.parametrize("name", sorted(SCHEMAS))
def test_the_counted_mask_never_drops_a_token_the_schema_allows(smollm2_compiler, smollm2_tokenizer, name) -> None:
    """Walks drawn from the counted superset's mask, refused draws replaced from the exact mask
    (as the engine's redraw does), with heavy weight on long, non-ASCII and escaping tokens:
    at every position the exact mask is inside the counted one, and the batched fill agrees."""
    grammar = smollm2_compiler.compile(JsonSchema(SCHEMAS[name]), "response_format")
    vocab = smollm2_compiler.vocab_size
    texts = [smollm2_tokenizer.decode([t], skip_special_tokens=False) for t in range(vocab)]
    weights = np.array([1.0 + len(text) + 20 * ("\\" in text or '"' in text or not text.isascii()) for text in texts])
    rng = np.random.default_rng(0)
    width = (vocab + 31) // 32
    batch = np.zeros((2, width), np.int32)
    steps = dropped = 0
    for _ in range(8):
        matcher = grammar.new_matcher()
        assert matcher.superset is not None and matcher.superset.counted is not None
        for _ in range(120):
            exact, loose = masks(matcher, vocab)
            assert not (exact & ~loose).any(), f"{name}: the counted mask dropped an allowed token"
            smollm2_compiler.fill_bitmasks([(matcher.superset, 1)], batch)
            assert np.array_equal(allowed_bits(batch[1:], vocab)[0], loose)
            steps += 1
            choices = np.flatnonzero(loose)
            token = int(rng.choice(choices, p=weights[choices] / weights[choices].sum()))
            if not exact[token]:
                dropped += 1
                choices = np.flatnonzero(exact)
                token = int(rng.choice(choices, p=weights[choices] / weights[choices].sum()))
            if token in smollm2_tokenizer.eos_token_ids or not matcher.accept_token(token):
                break
    assert steps >= 40


def test_a_name_at_its_bound_keeps_only_what_fits(smollm2_compiler, smollm2_tokenizer) -> None:
    """Inside a name with 2 characters left, no plain ASCII token longer than 2 remains in the
    superset's mask, though the twin alone allows them; the count follows rollback and fork."""
    grammar = smollm2_compiler.compile(JsonSchema(RECORDS), "response_format")
    vocab = smollm2_compiler.vocab_size
    matcher = grammar.new_matcher()
    for token_id in smollm2_tokenizer.encode('[{"name": "Annie Smi', add_special_tokens=False):  # 9 characters
        assert matcher.accept_token(token_id)
    [long_tail] = smollm2_tokenizer.encode(" Johnson", add_special_tokens=False)  # 8 characters
    exact, loose = masks(matcher, vocab)
    texts = {t: smollm2_tokenizer.decode([t], skip_special_tokens=False) for t in np.flatnonzero(loose).tolist()}
    plain = [t for t, text in texts.items() if text.isascii() and text.isprintable() and not {'"', "\\"} & set(text)]
    assert plain and all(len(texts[t]) <= 3 for t in plain)
    assert not loose[long_tail] and matcher.superset.allows(long_tail)  # the twin alone allows it
    assert all(exact[t] for t in plain)  # what is left of the plain ones, the schema allows
    fork = matcher.fork()
    for token_id in smollm2_tokenizer.encode('th", "age": 3}, {"name": "', add_special_tokens=False):
        assert matcher.accept_token(token_id)
    after = masks(matcher, vocab)[1]
    assert after.sum() > loose.sum()  # a new name: room for long tokens again
    for twin in (fork, matcher.fork()):
        if twin is not fork:
            twin.rollback(len(smollm2_tokenizer.encode('th", "age": 3}, {"name": "', add_special_tokens=False)))
        assert np.array_equal(masks(twin, vocab)[1], loose)


def test_a_rollback_past_the_kept_history_stops_counting(smollm2_compiler, smollm2_tokenizer) -> None:
    grammar = smollm2_compiler.compile(JsonSchema(RECORDS), "response_format")
    matcher = grammar.new_matcher()
    counted = matcher.superset.counted
    for token_id in smollm2_tokenizer.encode('[{"name": "Annie Smi', add_special_tokens=False):
        assert matcher.accept_token(token_id)
    assert counted.keep is not None
    counted.rollback(10_000)  # as a history cut short would
    assert counted.keep is None
