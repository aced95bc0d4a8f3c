"""Long prompts tokenized off the event loop, together."""

from __future__ import annotations

import asyncio

from atlas.adapters.http.prompts import BatchEncoder


class _Tokenizer:
    def __init__(self, fail: bool = False) -> None:
        self.batches: list[tuple[list[str], bool]] = []
        self.fail = fail

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return ([1] if add_special_tokens else []) + [len(word) for word in text.split()]

    def encode_batch(self, texts, add_special_tokens: bool = True) -> list[list[int]]:
        self.batches.append((list(texts), add_special_tokens))
        if self.fail:
            raise RuntimeError("tokenizer broke")
        return [self.encode(text, add_special_tokens) for text in texts]


def test_texts_waiting_together_are_encoded_in_batches_and_each_gets_its_own_ids():
    tokenizer = _Tokenizer()
    encoder = BatchEncoder(tokenizer)
    texts = [("a bb ccc " * n, n % 2 == 0) for n in range(1, 20)]

    async def main():
        return await asyncio.gather(*(encoder.encode(text, flag) for text, flag in texts))

    results = asyncio.run(main())
    assert results == [tokenizer.encode(text, flag) for text, flag in texts]
    assert sum(len(batch) for batch, _ in tokenizer.batches) == len(texts)
    assert len(tokenizer.batches) < len(texts)  # the wave went in batches, not one by one
    assert all(len({flag for text, flag in texts if text in batch}) == 1 for batch, _ in tokenizer.batches)


def test_a_failing_batch_fails_its_requests_and_the_encoder_recovers():
    tokenizer = _Tokenizer(fail=True)
    encoder = BatchEncoder(tokenizer)

    async def main():
        results = await asyncio.gather(encoder.encode("x y", True), encoder.encode("z", True), return_exceptions=True)
        tokenizer.fail = False
        return results, await encoder.encode("after it", True)

    results, after = asyncio.run(main())
    assert all(isinstance(result, RuntimeError) for result in results)
    assert after == [1, 5, 2]
