"""Greedy token ids of SmolLM2 on the 5 chat prompts of tests/chat_prompts.py, as JSON (a diagnostic).

  python3 scripts/smollm2_tokens.py cuda [mock]   # one JSON line per device
  ATLAS_CUDA_DISABLE=gemv_fused python3 scripts/smollm2_tokens.py cuda

The fourth prompt meets a near-tie at its tenth token (the mock's top two log-probabilities
-2.274 and -2.314). With the fourth session's kernels CUDA chose token 4461 there, CUDA without
the fused GEMVs 4231, the mock 260, and the mock run alone with attention's P rounded to bf16
(as flash attention does) 1116 (H200, 2026-11-22); the other four prompts agreed in every
variant. With the fifth session's kernels CUDA chooses 260 as the mock does.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # for chat_prompts

from chat_prompts import CHAT_PROMPTS

from atlas.app.llm import LLM
from atlas.domain.requests import SamplingParams

if __name__ == "__main__":
    params = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=False)
    conversations = [[{"role": "user", "content": p}] for p in CHAT_PROMPTS]
    for device in sys.argv[1:] or ["cuda"]:
        llm = LLM(
            os.environ.get("ATLAS_SMOLLM2_DIR", os.path.expanduser("~/.cache/atlas/models/smollm2")),
            device=device,
            dtype="bf16",
            show_progress=False,
            max_seq_len=1024,
        )
        results = llm.chat(conversations, params)
        print(json.dumps({"device": device, "ids": [list(r.outputs[0].token_ids) for r in results]}), flush=True)
