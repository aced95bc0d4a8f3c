"""Atlas: an LLM inference server.

    import atlas
    llm = atlas.LLM("smollm2")
    print(llm.generate("The capital of France is", atlas.SamplingParams(max_tokens=8))[0].outputs[0].text)

`LLM` and `SamplingParams` load on first use, so `import atlas` stays cheap.
"""

from __future__ import annotations

from typing import Any

__all__ = ["LLM", "SamplingParams"]


def __getattr__(name: str) -> Any:
    if name == "LLM":
        from atlas.app.llm import LLM

        return LLM
    if name == "SamplingParams":
        from atlas.domain.requests import SamplingParams

        return SamplingParams
    raise AttributeError(f"module 'atlas' has no attribute {name!r}")
