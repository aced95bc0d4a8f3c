"""From one client request to engine requests: `n` choices, each with its own seed."""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence

import msgspec

from atlas.domain.requests import Request, SamplingParams

_SEED_STRIDE = 0x9E3779B97F4A7C15
_UINT64 = (1 << 64) - 1


class SeedSource:
    """Seeds for requests that bring none: a reproducible series from `base_seed`, or, without
    one, draws from `entropy` (the app passes the operating system's randomness)."""

    def __init__(self, base_seed: int | None, entropy: Callable[[], int]) -> None:
        self._counter = itertools.count()
        self._base = base_seed
        self._entropy = entropy

    def next(self) -> int:
        if self._base is None:
            return self._entropy() & _UINT64
        return (self._base + next(self._counter) * _SEED_STRIDE) & _UINT64


def fan_out(
    request_id: str,
    prompt_token_ids: Sequence[int],
    params: SamplingParams,
    seeds: SeedSource,
    arrival_s: float = 0.0,
    priority: int = 0,
) -> list[Request]:
    """The engine requests for `params.n` choices: ids `request_id` (n=1) or `request_id-i`.

    Choice i of a seeded request uses seed + i * stride, so every choice differs and the whole
    response reproduces. The choices share the prompt's KV: the scheduler admits the first,
    and the others start from its blocks in the prefix cache a step later.
    """
    base_seed = params.seed if params.seed is not None else seeds.next()
    single = msgspec.structs.replace(params, n=1) if params.n != 1 else params
    prompt = tuple(prompt_token_ids)
    if params.n == 1:
        return [Request(request_id, prompt, single, base_seed & _UINT64, arrival_s, priority)]
    return [
        Request(
            f"{request_id}-{index}", prompt, single, (base_seed + index * _SEED_STRIDE) & _UINT64, arrival_s, priority
        )
        for index in range(params.n)
    ]
