"""`--speculative-config`: what parses, the defaults, and one-line errors naming the key."""

from __future__ import annotations

import pytest

from atlas.domain.requests import ParameterError
from atlas.domain.speculative import SpeculativeConfig, SpeculativeConfigError, SpeculativeMethod
from atlas.domain.speculative.config import DEFAULT_DISABLE_BY_BATCH_SIZE


def test_ngram_with_defaults() -> None:
    config = SpeculativeConfig.from_json('{"method": "ngram", "num_speculative_tokens": 4}')
    assert config == SpeculativeConfig(SpeculativeMethod.NGRAM, 4, None, 2, 4, DEFAULT_DISABLE_BY_BATCH_SIZE)


@pytest.mark.parametrize(
    ("given", "expected"),
    [({"prompt_lookup_max": 1}, (1, 1)), ({"prompt_lookup_min": 6}, (6, 6)), ({"prompt_lookup_max": 8}, (2, 8))],
)
def test_a_lone_lookup_bound_keeps_the_pair_ordered(given: dict, expected: tuple[int, int]) -> None:
    config = SpeculativeConfig.from_mapping({"method": "ngram", "num_speculative_tokens": 3, **given})
    assert (config.prompt_lookup_min, config.prompt_lookup_max) == expected


def test_model_methods_and_the_batch_size_cut_off() -> None:
    draft = SpeculativeConfig.from_mapping(
        {"method": "draft_model", "num_speculative_tokens": 5, "model": "m/small", "disable_by_batch_size": 8}
    )
    assert (draft.method, draft.model, draft.prompt_lookup_min) == (SpeculativeMethod.DRAFT_MODEL, "m/small", None)
    assert draft.speculates_at(8) and not draft.speculates_at(9)
    always = SpeculativeConfig.from_mapping({"method": "mtp", "num_speculative_tokens": 1, "disable_by_batch_size": None})
    assert always.speculates_at(10_000)
    assert SpeculativeConfig.from_mapping({"method": "eagle3", "num_speculative_tokens": 3, "model": "/h"}).model == "/h"


@pytest.mark.parametrize(
    ("text", "field", "fragment"),
    [
        ("{not json", "speculative_config", "not valid JSON"),
        ("[1, 2]", "speculative_config", "JSON object"),
        ('{"num_speculative_tokens": 4}', "speculative_config.method", "required"),
        ('{"method": "medusa", "num_speculative_tokens": 4}', "speculative_config.method", "'medusa' is not one of"),
        ('{"method": "ngram"}', "speculative_config.num_speculative_tokens", "required"),
        ('{"method": "ngram", "num_speculative_tokens": 0}', "speculative_config.num_speculative_tokens", "from 1 to 64"),
        ('{"method": "ngram", "num_speculative_tokens": 4.0}', "speculative_config.num_speculative_tokens", "4.0"),
        ('{"method": "ngram", "num_speculative_tokens": true}', "speculative_config.num_speculative_tokens", "True"),
        ('{"method": "ngram", "num_speculative_tokens": 99}', "speculative_config.num_speculative_tokens", "99"),
        ('{"method": "ngram", "num_speculative_tokens": 2, "k": 3}', "speculative_config.k", "accepted: method"),
        ('{"method": "ngram", "num_speculative_tokens": 2, "model": "x"}', "speculative_config.model", "unknown"),
        ('{"method": "mtp", "num_speculative_tokens": 2, "model": "x"}', "speculative_config.model", "unknown"),
        ('{"method": "draft_model", "num_speculative_tokens": 2}', "speculative_config.model", "draft checkpoint"),
        ('{"method": "eagle3", "num_speculative_tokens": 2, "model": " "}', "speculative_config.model", "draft"),
        (
            '{"method": "draft_model", "num_speculative_tokens": 2, "model": "m", "prompt_lookup_min": 2}',
            "speculative_config.prompt_lookup_min",
            "unknown for method draft_model",
        ),
        (
            '{"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 5, "prompt_lookup_max": 3}',
            "speculative_config.prompt_lookup_min",
            "exceeds prompt_lookup_max 3",
        ),
        ('{"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 0}', "speculative_config.prompt_lookup_max", "from 1 to 16, got 0"),
        ('{"method": "ngram", "num_speculative_tokens": 2, "disable_by_batch_size": 0}', "speculative_config.disable_by_batch_size", ">= 1"),
    ],
)  # fmt: skip
def test_mistakes_name_the_key_in_one_line(text: str, field: str, fragment: str) -> None:
    with pytest.raises(SpeculativeConfigError) as caught:
        SpeculativeConfig.from_json(text)
    error = caught.value
    assert isinstance(error, ParameterError)  # HTTP-facing callers answer these with a 400
    assert error.field == field
    assert fragment in str(error)
    assert "\n" not in str(error)


def test_direct_construction_is_validated_too() -> None:
    with pytest.raises(SpeculativeConfigError, match="prompt_lookup_min"):
        SpeculativeConfig(SpeculativeMethod.MTP, 2, prompt_lookup_min=2)
    with pytest.raises(SpeculativeConfigError, match="remove model"):
        SpeculativeConfig(SpeculativeMethod.NGRAM, 2, model="x", prompt_lookup_min=1, prompt_lookup_max=2)
