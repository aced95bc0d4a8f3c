"""A tiny random-weight Llama folder with a real byte-level BPE tokenizer and a ChatML template.

Protocol tests and the HTTP benchmark need a model that loads through the ordinary path
(`atlas serve FOLDER`) but costs almost nothing per step, so what they measure is the server.
The tokenizer is trained here, with `tokenizers`, on a fixed English text, so the folder needs
no download and its output decodes to word pieces rather than noise.

    python -m atlas.app.bench.tiny_model OUT_DIR [--seed N] [--num-layers L] [--hidden-size H]

The HTTP benchmark uses `--num-layers 1 --hidden-size 32`, so the engine's share of each
step is small and the figure measures the server.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from pathlib import Path

import ml_dtypes
import numpy as np

from atlas.adapters.weights.safetensors import SafetensorsWriter, TensorSpec
from atlas.app.bench.folders import staged_folder

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
_CORPUS = """
The capital of France is Paris. The capital of Italy is Rome. The capital of Spain is Madrid.
A server answers requests from many clients at the same time, and each client reads its answer
as a stream of small pieces. The engine runs one step for every running sequence, then hands
each new token to the request that asked for it. Numbers such as 0, 1, 2, 3, 4, 5, 6, 7, 8, 9,
10, 42, 100 and 2024 appear in text; so do questions, answers, lists and short stories.
Once upon a time a small model learned to count, to spell and to tell the weather: today it is
sunny, tomorrow it will rain, and on the weekend the wind comes from the west over the hills.
Engineers measure throughput in tokens per second and latency in milliseconds; they care about
the time to the first token, the time between tokens and how much memory the cache holds.
"""


@dataclass(frozen=True, slots=True)
class TinyModelShape:
    """The architecture of the tiny model: small enough that a step costs well under a millisecond."""

    vocab_size: int = 1024  # the BPE target; the trained vocabulary may come out a little smaller
    hidden_size: int = 64
    intermediate_size: int = 128
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    max_position_embeddings: int = 4096


def train_tokenizer(vocab_size: int):
    """A byte-level BPE over `_CORPUS` with the ChatML special tokens at ids 0..2."""
    import tokenizers
    from tokenizers import decoders, models, pre_tokenizers, trainers

    tokenizer = tokenizers.Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator([line for line in _CORPUS.splitlines() if line] * 4, trainer=trainer)
    return tokenizer


def _weight_shapes(shape: TinyModelShape, vocab_size: int) -> dict[str, tuple[int, ...]]:
    head_dim = shape.hidden_size // shape.num_heads
    hidden, inter = shape.hidden_size, shape.intermediate_size
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (vocab_size, hidden)}
    for layer_idx in range(shape.num_layers):
        prefix = f"model.layers.{layer_idx}"
        shapes.update({
            f"{prefix}.input_layernorm.weight": (hidden,),
            f"{prefix}.self_attn.q_proj.weight": (shape.num_heads * head_dim, hidden),
            f"{prefix}.self_attn.k_proj.weight": (shape.num_kv_heads * head_dim, hidden),
            f"{prefix}.self_attn.v_proj.weight": (shape.num_kv_heads * head_dim, hidden),
            f"{prefix}.self_attn.o_proj.weight": (hidden, shape.num_heads * head_dim),
            f"{prefix}.post_attention_layernorm.weight": (hidden,),
            f"{prefix}.mlp.gate_proj.weight": (inter, hidden),
            f"{prefix}.mlp.up_proj.weight": (inter, hidden),
            f"{prefix}.mlp.down_proj.weight": (hidden, inter),
        })
    shapes["model.norm.weight"] = (hidden,)
    shapes["lm_head.weight"] = (vocab_size, hidden)
    return shapes


def _write_weights(path: Path, shape: TinyModelShape, vocab_size: int, damped_ids: list[int], seed: int) -> None:
    rng = np.random.default_rng(seed)
    shapes = _weight_shapes(shape, vocab_size)
    specs = [TensorSpec(name, np.dtype(ml_dtypes.bfloat16), dims) for name, dims in shapes.items()]
    with SafetensorsWriter(path, specs, metadata={"format": "pt"}) as writer:
        for name, dims in shapes.items():
            if name.endswith("norm.weight"):
                values = 1.0 + 0.1 * rng.standard_normal(dims)
            else:
                # an untied, wide lm_head makes the next token depend on the whole hidden state
                # rather than echo the input token, so greedy text varies with the prompt
                wide = name in ("model.embed_tokens.weight", "lm_head.weight")
                values = (1.0 if wide else 0.15) * rng.standard_normal(dims)
                if name == "lm_head.weight":
                    values[damped_ids] *= 0.1
            writer.write(name, values.astype(np.float32).astype(ml_dtypes.bfloat16))


def _config(shape: TinyModelShape, vocab_size: int, bos_id: int, eos_id: int) -> dict:
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": vocab_size,
        "hidden_size": shape.hidden_size,
        "intermediate_size": shape.intermediate_size,
        "num_hidden_layers": shape.num_layers,
        "num_attention_heads": shape.num_heads,
        "num_key_value_heads": shape.num_kv_heads,
        "max_position_embeddings": shape.max_position_embeddings,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "tie_word_embeddings": False,
        "bos_token_id": bos_id,
        "eos_token_id": eos_id,
        "torch_dtype": "bfloat16",
    }


def _tokenizer_config(shape: TinyModelShape) -> dict:
    return {
        "bos_token": "<|im_start|>",
        "eos_token": "<|im_end|>",
        "unk_token": "<|endoftext|>",
        "pad_token": "<|im_end|>",
        "add_bos_token": False,
        "chat_template": CHAT_TEMPLATE,
        "model_max_length": shape.max_position_embeddings,
    }


def write_tiny_model(out_dir: Path | str, seed: int = 0, shape: TinyModelShape = TinyModelShape()) -> Path:
    """Write the folder (config, tokenizer files, bf16 safetensors) atomically; returns its path.

    An existing folder at `out_dir` is replaced. Raises OSError when the parent is not writable.
    """
    out_dir = Path(out_dir).expanduser().resolve()
    with staged_folder(out_dir) as staging:
        tokenizer = train_tokenizer(shape.vocab_size)
        tokenizer.save(str(staging / "tokenizer.json"))
        vocab_size = tokenizer.get_vocab_size(with_added_tokens=True)
        eos_id = tokenizer.token_to_id("<|im_end|>")
        bos_id = tokenizer.token_to_id("<|im_start|>")
        (staging / "config.json").write_text(json.dumps(_config(shape, vocab_size, bos_id, eos_id), indent=2))
        (staging / "tokenizer_config.json").write_text(json.dumps(_tokenizer_config(shape), indent=2))
        (staging / "generation_config.json").write_text(json.dumps({"eos_token_id": eos_id, "bos_token_id": bos_id}))
        # single-byte tokens get small logits: the text comes out as word pieces, not raw bytes
        single_bytes = [i for token, i in tokenizer.get_vocab().items() if len(token) == 1]
        _write_weights(staging / "model.safetensors", shape, vocab_size, single_bytes, seed)
    return out_dir


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m atlas.app.bench.tiny_model", description=__doc__.split("\n")[0])
    parser.add_argument("out_dir")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--num-layers", type=int, default=TinyModelShape().num_layers)
    parser.add_argument("--hidden-size", type=int, default=TinyModelShape().hidden_size,
                        help="a multiple of 8 (4 heads of at least 2 dims); the MLP is twice as wide")
    args = parser.parse_args(argv)
    if args.num_layers < 1 or args.hidden_size < 8 or args.hidden_size % 8:
        parser.error("--num-layers must be >= 1 and --hidden-size a positive multiple of 8")
    shape = TinyModelShape(hidden_size=args.hidden_size, intermediate_size=2 * args.hidden_size,
                           num_layers=args.num_layers)
    print(write_tiny_model(args.out_dir, args.seed, shape))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
