"""A random-weight checkpoint of a real config that speaks a real model's tokenizer.

    python3 benchmarks/with_tokenizer.py llama-3.1-8b ~/.cache/atlas/models/smollm2 /tmp/llama8b-smol

The folder gets the named config (atlas.app.bench.random_model.CONFIGS) with the tokenizer
folder's vocabulary size and special ids, weights generated when read (no files written), and
the tokenizer folder's tokenizer files. Structured output needs this: llguidance must spell JSON
with the vocabulary, which a --random checkpoint's placeholder words cannot; the weights stay
random, so only speed means anything (the masks keep every document valid).
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

from atlas.app.bench.random_model import CONFIGS, write_random_model

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json")


def main(name: str, tokenizer_dir: str, out_dir: str) -> None:
    source = Path(tokenizer_dir).expanduser()
    donor = json.loads((source / "config.json").read_text())
    config = {**CONFIGS[name], **{key: donor[key] for key in ("vocab_size", "bos_token_id", "eos_token_id")}}
    folder = write_random_model(config, Path(out_dir), files=False, progress=False)
    for filename in _TOKENIZER_FILES:
        if (source / filename).is_file():
            shutil.copyfile(source / filename, folder / filename)
    print(folder)


if __name__ == "__main__":
    if len(sys.argv) != 4:
        sys.exit("usage: with_tokenizer.py CONFIG_NAME TOKENIZER_DIR OUT_DIR")
    main(*sys.argv[1:])
