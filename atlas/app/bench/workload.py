"""The requests of `atlas bench serve`: lengths, prompts of exact token counts, shared prefixes,
conversations and arrival times, all drawn from `--seed`.

A run is a list of conversations; a single-turn run is conversations of one turn. Each turn's
text (a completion prompt or a chat user message) is built from common English words and
measured with the server's own tokenizer, then lengthened or shortened word by word until it
holds exactly the drawn number of tokens. The count is of the text alone, without special
tokens: the server adds its BOS or chat template on top, the same for every request.

    conversation c, turn 0:  [prefix c % K: N tokens][unique words] = N + L tokens
    conversation c, turn t:  history (earlier turns and replies) + a new message of L tokens

Every random choice comes from a generator seeded by (seed, what, index), so the same flags
give the same requests whatever order the prompts are measured in.
"""

from __future__ import annotations

import asyncio
import math
import random
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Protocol

WORDS = (
    "the of and to in is it you that he was for on are with as his they be at one have this from or had by word but "
    "what some we can out other were all there when up use your how said an each she which do their time if will way "
    "about many then them write would like so these her long make thing see him two has look more day could go come "
    "did number sound no most people my over know water than call first who may down side been now find any new work "
    "part take get place made live where after back little only round man year came show every good me give our under "
    "name very through just form sentence great think say help low line turn cause much mean before move right boy old"
).split()
# Words measured to cost one token each below this many make the prompts' lengths slow to settle.
_MIN_SINGLE_TOKEN_WORDS = 8
_MAX_ADJUSTMENTS = 8


class PromptTokenizer(Protocol):
    """Counts the tokens of a text the way the server will (see `ServerTokenizer`)."""

    @property
    def exact(self) -> bool:
        """Whether counts are the server's own (False: an estimate, one word one token)."""
        ...

    async def encode(self, text: str) -> list[int]:
        """Token ids of `text` alone, without special tokens."""
        ...

    async def encode_prompt(self, prompt: str | None, messages: list[dict] | None) -> list[int]:
        """Token ids of a whole request's prompt (completions: `prompt`; chat: `messages`)."""
        ...


class WordTokenizer:
    """The estimate for servers without /tokenize: every whitespace-separated word is one token."""

    exact = False

    def __init__(self) -> None:
        self._ids: dict[str, int] = {}

    async def encode(self, text: str) -> list[int]:
        return self.ids(text)

    async def encode_prompt(self, prompt: str | None, messages: list[dict] | None) -> list[int]:
        return self.ids(prompt if messages is None else " ".join(message["content"] for message in messages))

    def ids(self, text: str) -> list[int]:
        return [self._ids.setdefault(word, len(self._ids)) for word in text.split()]


@dataclass(frozen=True, slots=True)
class LengthRange:
    """`--input-len 16:900` (uniform over 16..900 inclusive) or `--input-len 512` (fixed)."""

    low: int
    high: int

    @classmethod
    def parse(cls, text: str, flag: str) -> LengthRange:
        """Raises ValueError naming `flag` unless text is N or LOW:HIGH with 1 <= LOW <= HIGH."""
        low_text, colon, high_text = str(text).partition(":")
        try:
            low = int(low_text)
            high = int(high_text) if colon else low
        except ValueError:
            raise ValueError(f"{flag} takes N or LOW:HIGH in tokens, e.g. 512 or 16:900 (got {text!r})") from None
        if not 1 <= low <= high:
            raise ValueError(f"{flag} needs 1 <= LOW <= HIGH, e.g. 16:900 (got {text!r})")
        return cls(low, high)

    def draw(self, rng: random.Random) -> int:
        return self.low if self.low == self.high else rng.randint(self.low, self.high)

    def __str__(self) -> str:
        return str(self.low) if self.low == self.high else f"{self.low}:{self.high}"


@dataclass(frozen=True, slots=True)
class WorkloadSpec:
    """What to send. `request_rate` is conversations started per second (math.inf: all at once)."""

    num_conversations: int
    num_turns: int
    input_len: LengthRange
    output_len: LengthRange
    shared_prefix_len: int = 0
    num_prefixes: int = 1
    request_rate: float = math.inf
    seed: int = 0


@dataclass(frozen=True, slots=True)
class Turn:
    """One request's own text: the prompt (completions) or the new user message (chat)."""

    text: str
    input_len: int  # the drawn length: tokens of `text` (the prefix included) when `exact`
    num_tokens: int  # what the tokenizer counted
    output_len: int  # max_tokens, produced exactly when the server honours ignore_eos
    prefix_idx: int | None  # which shared prefix opens the text
    seed: int  # the request's sampling seed

    @property
    def exact(self) -> bool:
        return self.num_tokens == self.input_len


@dataclass(frozen=True, slots=True)
class Conversation:
    idx: int
    arrival_s: float  # when its first turn may be sent, from the start of the run
    turns: tuple[Turn, ...]


@dataclass(frozen=True, slots=True)
class Workload:
    conversations: list[Conversation]  # in arrival order
    prefix_lens: list[int]  # each shared prefix's counted tokens (spec.shared_prefix_len when exact)

    @property
    def turns(self) -> list[Turn]:
        return [turn for conversation in self.conversations for turn in conversation.turns]


async def build_workload(
    spec: WorkloadSpec, tokenizer: PromptTokenizer, progress: Callable[[int, int], None] | None = None
) -> Workload:
    """The requests of a run. Texts the tokenizer could not bring to their exact length within
    a few adjustments keep their closest length (Turn.exact False). `progress(done, total)` is
    called as texts are ready."""
    num_turns = spec.num_conversations * spec.num_turns
    ready = 0
    pool = await single_token_words(tokenizer.encode)
    prefixes = await asyncio.gather(*(
        exact_text(tokenizer.encode, _rng(spec.seed, "prefix", k), pool, spec.shared_prefix_len)
        for k in range(spec.num_prefixes if spec.shared_prefix_len else 0)
    ))

    async def turn(conversation: int, index: int) -> Turn:
        rng = _rng(spec.seed, "turn", conversation, index)
        input_len, output_len, seed = spec.input_len.draw(rng), spec.output_len.draw(rng), rng.randrange(2**31)
        prefix_idx = conversation % spec.num_prefixes if prefixes and index == 0 else None
        head, head_len = prefixes[prefix_idx] if prefix_idx is not None else ("", 0)
        target = input_len + (spec.shared_prefix_len if prefix_idx is not None else 0)
        text, num_tokens = await exact_text(tokenizer.encode, rng, pool, target, head, head_len)
        nonlocal ready
        ready += 1
        if progress is not None:
            progress(ready, num_turns)
        return Turn(text, target, num_tokens, output_len, prefix_idx, seed)

    turns = await asyncio.gather(*(
        turn(c, t) for c in range(spec.num_conversations) for t in range(spec.num_turns)
    ))
    arrivals = arrival_times(spec.num_conversations, spec.request_rate, _rng(spec.seed, "arrivals"))
    conversations = [
        Conversation(c, arrivals[c], tuple(turns[c * spec.num_turns : (c + 1) * spec.num_turns]))
        for c in range(spec.num_conversations)
    ]
    return Workload(conversations, [num_tokens for _, num_tokens in prefixes])


def arrival_times(count: int, rate: float, rng: random.Random) -> list[float]:
    """A Poisson process of `rate` per second (exponential gaps) starting at 0; all 0 at inf."""
    if math.isinf(rate):
        return [0.0] * count
    times, now = [], 0.0
    for _ in range(count):
        times.append(now)
        now += rng.expovariate(rate)
    return times


async def single_token_words(encode: Callable[[str], Awaitable[list[int]]]) -> list[str]:
    """The words of WORDS that add exactly one token after another word (most of them in
    large vocabularies); all of WORDS when fewer than a handful do (small vocabularies)."""
    base = len(await encode("the"))
    costs = await asyncio.gather(*(encode(f"the {word}") for word in WORDS))
    single = [word for word, ids in zip(WORDS, costs, strict=True) if len(ids) - base == 1]
    return single if len(single) >= _MIN_SINGLE_TOKEN_WORDS else list(WORDS)


async def exact_text(
    encode: Callable[[str], Awaitable[list[int]]], rng: random.Random, pool: list[str], num_tokens: int,
    head: str = "", head_len: int = 0,
) -> tuple[str, int]:
    """`head` (of `head_len` tokens) followed by random words of `pool`, `num_tokens` tokens in
    all, and the count reached: words are added while short and dropped while long (a word is
    at least one token, so dropping one word per excess token never leaves the text long).
    Gives up after a few rounds with the last text and its count."""
    words = [rng.choice(pool) for _ in range(max(num_tokens - head_len, 1))]
    count = -1
    for _ in range(_MAX_ADJUSTMENTS):
        text = " ".join([head, *words]) if head else " ".join(words)
        count = len(await encode(text))
        if count == num_tokens:
            break
        if count < num_tokens:
            words.extend(rng.choice(pool) for _ in range(num_tokens - count))
        elif len(words) > 1:  # never down to no words: a text has at least one
            del words[max(len(words) - (count - num_tokens), 1) :]
        else:
            break
    return text, count


def _rng(seed: int, *what: object) -> random.Random:
    # str seeds hash with SHA-512: the same on every run and platform, unlike hash().
    return random.Random(":".join(str(part) for part in (seed, *what)))
