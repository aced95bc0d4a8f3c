"""One HTTP request's generation: submit its sequences, turn outputs into text, abort on exit.

A request has one or more prompts and `n` choices per prompt; choice `index` is
`prompt_idx * n + choice_idx`, as OpenAI numbers them. All of its sequences share one engine
stream. `batches()` waits for the next output, then takes everything else already queued and
folds it into one `ChoiceUpdate` per choice, so a consumer that falls behind gets several
tokens per wake-up (and per chunk it writes) instead of one wake-up per token:

    engine step k   -> out(seq0), out(seq1)        \\
    engine step k+1 -> out(seq0)                    >  one batch: [update(0), update(1)]
    consumer wakes  ------------------------------ /

Leaving `batches()` early (client gone, handler error, timeout, `interrupt()` at shutdown)
aborts every sequence that has not finished, so its KV blocks are freed at the engine's next
step. While `batches()` runs, the generation is in the server's `InFlight` set.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Callable, Sequence
import msgspec

from atlas.adapters.http.engine_client import EngineClient, OutputStream
from atlas.adapters.http.errors import INVALID_REQUEST, SERVER_ERROR, ApiError
from atlas.adapters.http.in_flight import InFlight
from atlas.adapters.http.server_metrics import ServerMetrics
from atlas.domain.batch import TokenLogprobs
from atlas.domain.engine_events import EngineFailure
from atlas.domain.fan_out import SeedSource, fan_out
from atlas.domain.text.sequence_text import SequenceText
from atlas.domain.requests import FinishReason, OutputConstraint, SamplingParams
from atlas.ports.tokenizer import Tokenizer


class ChoiceUpdate(msgspec.Struct):
    """What one batch adds to one choice: the text, token count and logprobs of its outputs
    in the batch, and its finish when one of them ended it. (Mutable: a batch's later outputs
    of the choice are folded in.)"""

    index: int
    text: str
    num_tokens: int
    logprobs: tuple[TokenLogprobs, ...]
    finish_reason: str | None  # the engine's: stop, length, abort
    stop_reason: str | int | None


class _Choice:
    __slots__ = ("index", "seq_id", "text", "finished", "num_output_tokens", "num_cached_tokens", "last_token_s")

    def __init__(self, index: int, seq_id: str, text: SequenceText) -> None:
        self.index = index
        self.seq_id = seq_id
        self.text = text
        self.finished = False
        self.num_output_tokens = 0
        self.num_cached_tokens: int | None = None  # known once the engine reports on it
        self.last_token_s: float | None = None


class Generation:
    """Drives the sequences of one request; iterate `batches()` once. Every sequence carries
    `constraint` (structured output, a forced tool call, a thinking budget) to the engine."""

    def __init__(
        self,
        engine: EngineClient,
        tokenizer: Tokenizer,
        request_id: str,
        prompts: Sequence[Sequence[int]],
        params: SamplingParams,
        seeds: SeedSource,
        metrics: ServerMetrics,
        in_flight: InFlight,
        timeout_s: float | None = None,
        clock: Callable[[], float] = time.monotonic,
        priority: int = 0,
        constraint: OutputConstraint | None = None,
        heartbeat_s: float | None = None,
    ) -> None:
        self._engine = engine
        self._metrics = metrics
        self._in_flight = in_flight
        self._interrupted = False
        self._stream: OutputStream | None = None  # once `batches()` has submitted the request
        self._clock = clock
        self.arrival_s = clock()
        self._deadline_s = None if timeout_s is None else self.arrival_s + timeout_s
        self._heartbeat_s = heartbeat_s
        self.num_prompt_tokens = sum(len(p) for p in prompts)
        self._num_choices_per_prompt = params.n
        self.requests = []
        self._choices: dict[str, _Choice] = {}
        for prompt_idx, prompt in enumerate(prompts):
            base_id = request_id if len(prompts) == 1 else f"{request_id}-p{prompt_idx}"
            for choice_idx, request in enumerate(fan_out(base_id, prompt, params, seeds, priority=priority)):
                if constraint is not None:
                    request = msgspec.structs.replace(request, constraint=constraint)
                index = prompt_idx * params.n + choice_idx
                text = SequenceText(tokenizer, request.prompt_token_ids, request.sampling)
                self._choices[request.request_id] = _Choice(index, request.request_id, text)
                self.requests.append(request)
        self.num_choices = len(self.requests)
        self._unfinished = dict(self._choices)  # by sequence id; `batches()` removes those that finish
        self.timed_out = False

    @property
    def num_output_tokens(self) -> int:
        return sum(choice.num_output_tokens for choice in self._choices.values())

    def interrupt(self) -> None:
        """End now (the server is shutting down): every unfinished choice finishes with
        finish_reason "abort" in the next batch."""
        self._interrupted = True
        if self._stream is not None:
            self._stream.wake()  # if `batches()` waits for output, it stops waiting

    @property
    def is_finished(self) -> bool:
        """Every choice has finished: the batch just taken from `batches()` was its last."""
        return not self._unfinished

    @property
    def num_cached_tokens(self) -> int:
        """Prompt tokens served from the prefix cache, counted once per prompt like
        `num_prompt_tokens`: the fewest any of its choices found, since the choices after the
        first reuse the blocks the first computed."""
        per_prompt: dict[int, int] = {}
        for choice in self._choices.values():
            if choice.num_cached_tokens is not None:
                prompt_idx = choice.index // self._num_choices_per_prompt
                per_prompt[prompt_idx] = min(per_prompt.get(prompt_idx, choice.num_cached_tokens),
                                             choice.num_cached_tokens)
        return sum(per_prompt.values())

    async def batches(self) -> AsyncIterator[list[ChoiceUpdate]]:
        """Updates in order of each choice's first output in the batch, every batch non-empty;
        ends when every choice has finished. With `heartbeat_s`, an empty batch after that long
        without output (a stream's keep-alive). Raises ApiError for a request the engine
        rejects or cannot run."""
        stream = self._stream = self._engine.submit(self.requests)
        unfinished = self._unfinished
        cause = "client_disconnected"  # why sequences were left unfinished, if they were
        self._in_flight.add(self)
        try:
            while unfinished:
                if self._interrupted or (self._deadline_s is not None and self._clock() >= self._deadline_s):
                    reason = FinishReason.ABORT if self._interrupted else FinishReason.LENGTH
                    self.timed_out = not self._interrupted
                    self._metrics.aborted.inc(("shutdown" if self._interrupted else "timeout",))
                    yield [self._end(choice, reason, unfinished) for choice in list(unfinished.values())]
                    return
                items = stream.take()
                if items:
                    updates = self._apply(items, unfinished)
                    if updates:
                        yield updates
                elif stream.at_end:  # the stream closed early: the engine is shutting down
                    cause = "engine_stopped"
                    return
                elif self._deadline_s is None and self._heartbeat_s is None:
                    await stream.wait()
                else:
                    timeout_s, is_heartbeat = self._wait_s()
                    if not await stream.wait(timeout_s) and is_heartbeat:
                        yield []
        except ApiError:
            cause = "error"
            raise
        finally:
            self._in_flight.discard(self)
            if unfinished:
                self._engine.abort(list(unfinished))
                self._metrics.aborted.inc((cause,))
            stream.close()

    def _wait_s(self) -> tuple[float, bool]:
        """How long to wait for output: until the deadline or the heartbeat, whichever comes
        first; True when it is the heartbeat."""
        if self._deadline_s is None:
            return self._heartbeat_s, True
        delay_s = self._deadline_s - self._clock()
        if self._heartbeat_s is not None and self._heartbeat_s < delay_s:
            return self._heartbeat_s, True
        return delay_s, False

    def _apply(self, items: list, unfinished: dict[str, _Choice]) -> list[ChoiceUpdate]:
        now = self._clock()
        inter_token_latency = self._metrics.inter_token_latency
        updates: dict[int, ChoiceUpdate] = {}
        for item in items:
            if isinstance(item, EngineFailure):
                raise _failure_error(item)
            choice = unfinished.get(item.seq_id)
            if choice is None:
                continue
            choice.num_cached_tokens = item.num_cached_tokens
            delta = choice.text.apply(item)
            num_new = len(delta.token_ids)
            if num_new:
                last_token_s = choice.last_token_s
                if last_token_s is None:
                    self._observe_first_tokens(num_new, now)
                else:
                    inter_token_latency.observe((now - last_token_s) / num_new, num_new)
                choice.last_token_s = now
            if delta.num_output_tokens > choice.num_output_tokens:
                choice.num_output_tokens = delta.num_output_tokens
            finish = None
            if delta.finish_reason is not None:
                if delta.stopped_by_text:
                    self._engine.abort([choice.seq_id])
                self._finish(choice, delta.finish_reason, unfinished, now)
                finish = delta.finish_reason.value
            update = updates.get(choice.index)
            if update is None:
                updates[choice.index] = ChoiceUpdate(choice.index, delta.text, num_new, delta.logprobs, finish,
                                                     delta.stop_reason)
                continue
            update.text += delta.text
            update.num_tokens += num_new
            if delta.logprobs:
                update.logprobs += delta.logprobs
            if finish is not None:
                update.finish_reason, update.stop_reason = finish, delta.stop_reason
        kept = []
        for update in updates.values():
            if update.text or update.num_tokens or update.finish_reason is not None:
                kept.append(update)
        return kept

    def _observe_first_tokens(self, num_new: int, now: float) -> None:
        self._metrics.time_to_first_token.observe(now - self.arrival_s)
        if num_new > 1:  # tokens that arrived together with the first one
            self._metrics.inter_token_latency.observe(0.0, num_new - 1)

    def _finish(self, choice: _Choice, reason: FinishReason, unfinished: dict[str, _Choice], now: float) -> None:
        choice.finished = True
        del unfinished[choice.seq_id]
        self._metrics.finished.inc((reason.value,))
        if not unfinished:
            self._metrics.request_duration.observe(now - self.arrival_s)

    def _end(self, choice: _Choice, reason: FinishReason, unfinished: dict[str, _Choice]) -> ChoiceUpdate:
        self._engine.abort([choice.seq_id])
        self._finish(choice, reason, unfinished, self._clock())
        return ChoiceUpdate(choice.index, "", 0, (), reason.value, None)


def _failure_error(failure: EngineFailure) -> ApiError:
    if failure.is_user_error:
        return ApiError(400, failure.message, INVALID_REQUEST, failure.field)
    return ApiError(503, f"the engine could not run this request: {failure.message}", SERVER_ERROR)
