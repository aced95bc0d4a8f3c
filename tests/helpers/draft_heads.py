"""Tiny random targets with draft heads (a Qwen3-Next carrying MTP layers), and an engine core
that drafts with them on the mock backend: the harness of the MTP tests.

`TINY_QWEN3_NEXT` has full-attention layers only; `TINY_HYBRID_QWEN3_NEXT` puts Gated DeltaNet
layers around its attention layer, as the published models do (their state is rolled back past
rejected drafts through snapshot slots). Feed-forwards mix MoE (the later layers, the MTP
layer) and a dense GLU (layer 0).
"""

from __future__ import annotations

from collections.abc import Mapping

import ml_dtypes
import numpy as np
from fakes import TINY_LLAMA, DictWeights
from helpers.engines import make_cache, make_worker

from atlas.adapters.mock.backend import MockGpuBackend
from atlas.domain.engine import EngineCore
from atlas.domain.models.config import ModelConfig
from atlas.domain.models.draft_heads import HeadWorker, mtp_head
from atlas.domain.models.eagle3 import TargetFacts, load_eagle3
from atlas.domain.models.families import load_model
from atlas.domain.models.qwen3_next import load_mtp
from atlas.domain.scheduler import Scheduler, SchedulerConfig
from atlas.domain.speculative.config import SpeculativeConfig, SpeculativeMethod
from atlas.domain.speculative.draft_head import DraftHeadProposer
from atlas.domain.speculative.policy import speculation_policy
from atlas.domain.worker import WorkerConfig

BLOCK_SIZE = 4
MAX_LEN = 128
EOS = frozenset({96})

TINY_QWEN3_NEXT = dict(
    architectures=["Qwen3NextForCausalLM"], model_type="qwen3_next", vocab_size=97, hidden_size=32,
    intermediate_size=48, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
    layer_types=["full_attention", "full_attention"], linear_num_key_heads=2, linear_num_value_heads=2,
    linear_key_head_dim=8, linear_value_head_dim=8, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
    shared_expert_intermediate_size=24, norm_topk_prob=True, mlp_only_layers=[0], rms_norm_eps=1e-6,
    max_position_embeddings=256, rope_theta=10000.0, partial_rotary_factor=0.5, tie_word_embeddings=False,
)


# Gated DeltaNet, attention, Gated DeltaNet: most of the state is recurrent
TINY_HYBRID_QWEN3_NEXT = {**TINY_QWEN3_NEXT, "num_hidden_layers": 3,
                          "layer_types": ["linear_attention", "full_attention", "linear_attention"]}


def _delta_net_shapes(config: Mapping, prefix: str) -> dict[str, tuple[int, ...]]:
    hidden, key_heads, value_heads = (config["hidden_size"], config["linear_num_key_heads"],
                                      config["linear_num_value_heads"])
    key_dim, value_dim = key_heads * config["linear_key_head_dim"], value_heads * config["linear_value_head_dim"]
    p = f"{prefix}.linear_attn"
    return {
        f"{p}.in_proj_qkvz.weight": (2 * key_dim + 2 * value_dim, hidden),
        f"{p}.in_proj_ba.weight": (2 * value_heads, hidden),
        f"{p}.conv1d.weight": (2 * key_dim + value_dim, 1, config.get("linear_conv_kernel_dim", 4)),
        f"{p}.A_log": (value_heads,),
        f"{p}.dt_bias": (value_heads,),
        f"{p}.norm.weight": (config["linear_value_head_dim"],),
        f"{p}.out_proj.weight": (hidden, value_dim),
    }


def _layer_shapes(config: Mapping, prefix: str, moe: bool, linear: bool = False) -> dict[str, tuple[int, ...]]:
    hidden, heads, kv_heads, dim = (config["hidden_size"], config["num_attention_heads"],
                                    config["num_key_value_heads"], config["head_dim"])
    shapes = {
        f"{prefix}.input_layernorm.weight": (hidden,),
        f"{prefix}.post_attention_layernorm.weight": (hidden,),
    }
    if linear:
        shapes |= _delta_net_shapes(config, prefix)
    else:
        shapes |= {
            f"{prefix}.self_attn.q_proj.weight": (2 * heads * dim, hidden),  # each head's q rows, then its gate rows
            f"{prefix}.self_attn.k_proj.weight": (kv_heads * dim, hidden),
            f"{prefix}.self_attn.v_proj.weight": (kv_heads * dim, hidden),
            f"{prefix}.self_attn.o_proj.weight": (hidden, heads * dim),
            f"{prefix}.self_attn.q_norm.weight": (dim,),
            f"{prefix}.self_attn.k_norm.weight": (dim,),
        }
    if not moe:
        inter = config["intermediate_size"]
        return shapes | {f"{prefix}.mlp.{name}.weight": shape for name, shape in
                         (("gate_proj", (inter, hidden)), ("up_proj", (inter, hidden)), ("down_proj", (hidden, inter)))}
    inter, shared = config["moe_intermediate_size"], config["shared_expert_intermediate_size"]
    shapes[f"{prefix}.mlp.gate.weight"] = (config["num_experts"], hidden)
    for expert in range(config["num_experts"]):
        p = f"{prefix}.mlp.experts.{expert}"
        shapes |= {f"{p}.gate_proj.weight": (inter, hidden), f"{p}.up_proj.weight": (inter, hidden),
                   f"{p}.down_proj.weight": (hidden, inter)}
    p = f"{prefix}.mlp.shared_expert"
    return shapes | {f"{p}.gate_proj.weight": (shared, hidden), f"{p}.up_proj.weight": (shared, hidden),
                     f"{p}.down_proj.weight": (hidden, shared), f"{prefix}.mlp.shared_expert_gate.weight": (1, hidden)}


def random_qwen3_next_weights(config: Mapping = TINY_QWEN3_NEXT, seed: int = 0, num_mtp_layers: int = 1,
                              scale: float = 0.3) -> dict[str, np.ndarray]:
    """Random bf16 weights with the published checkpoints' names: the model, and `num_mtp_layers`
    MTP layers (`mtp.layers.N.*`, MoE) with `mtp.fc`, `mtp.pre_fc_norm_*` and `mtp.norm`.
    Norms are zero-centred (stored w, multiplier 1 + w)."""
    rng = np.random.default_rng(seed)
    hidden, vocab = config["hidden_size"], config["vocab_size"]
    shapes = {"model.embed_tokens.weight": (vocab, hidden), "model.norm.weight": (hidden,),
              "lm_head.weight": (vocab, hidden)}
    for layer in range(config["num_hidden_layers"]):
        linear = config["layer_types"][layer] == "linear_attention"
        shapes |= _layer_shapes(config, f"model.layers.{layer}", layer not in config["mlp_only_layers"], linear)
    if num_mtp_layers:
        shapes |= {"mtp.fc.weight": (hidden, 2 * hidden), "mtp.pre_fc_norm_embedding.weight": (hidden,),
                   "mtp.pre_fc_norm_hidden.weight": (hidden,), "mtp.norm.weight": (hidden,)}
    for layer in range(num_mtp_layers):
        shapes |= _layer_shapes(config, f"mtp.layers.{layer}", moe=True)
    tensors = {}
    for name, shape in shapes.items():
        values = rng.standard_normal(shape) * (0.1 if name.endswith("norm.weight") else scale)
        if name.endswith("linear_attn.A_log"):  # decay rates 1 .. 16, as the published init draws
            values = np.log(rng.uniform(1, 16, shape))
        elif name.endswith("linear_attn.norm.weight"):  # a plain multiplier, not zero-centred
            values = 1 + values
        tensors[name] = values.astype(np.float32).astype(ml_dtypes.bfloat16)
    return tensors


def copying_mtp(tensors: dict[str, np.ndarray], config: Mapping = TINY_QWEN3_NEXT) -> dict[str, np.ndarray]:
    """`tensors` made into a target whose next token depends on its last token only (every layer
    adds zero: o_proj and the feed-forwards' down projections are 0) and an MTP head that
    predicts as the target does from the token it is given (its layer adds zero too, fc is the
    identity on the token's normalised embedding, its norms those of the target): its greedy
    drafts are the target's greedy tokens, so every one is accepted."""
    hidden = config["hidden_size"]
    out = dict(tensors)
    for name, value in tensors.items():
        if name.endswith(("o_proj.weight", "out_proj.weight", "down_proj.weight")):
            out[name] = np.zeros_like(value)
    fc = np.zeros((hidden, 2 * hidden), np.float32)
    fc[:, :hidden] = np.eye(hidden)
    out["mtp.fc.weight"] = fc.astype(ml_dtypes.bfloat16)
    zero = np.zeros(hidden, ml_dtypes.bfloat16)
    out["mtp.pre_fc_norm_embedding.weight"] = zero  # a multiplier of 1: fc sees rmsnorm(embedding)
    out["mtp.norm.weight"] = tensors["model.norm.weight"]  # rmsnorm of a unit-rms row is the row
    return out


def build_mtp_core(weights: dict[str, np.ndarray] | None = None, speculative: SpeculativeConfig | None = None,
                   num_blocks=400, max_num_seqs=32, budget=256, graph_sizes=(), head_blocks=None,
                   prefix_caching=True, grammars=None, shape: Mapping = TINY_QWEN3_NEXT) -> EngineCore:
    """An engine over the tiny Qwen3-Next of `shape` (`weights`, default: random with one MTP
    layer), drafting with its MTP head under an mtp `speculative` config, with n-grams under
    an ngram one (None: plain decoding); `grammars`: a GrammarCache for requests'
    constraints. A shape with DeltaNet layers gets a state slot per sequence and a snapshot
    slot per draft of each."""
    config = ModelConfig.from_dict(shape)
    weights = weights if weights is not None else random_qwen3_next_weights(shape)
    uses_head = speculative is not None and speculative.method is SpeculativeMethod.MTP
    backend = MockGpuBackend(emulate_graphs=bool(graph_sizes))
    model = load_model(config, DictWeights(weights), backend, MAX_LEN)
    num_drafts = speculative.num_speculative_tokens if speculative is not None else 0
    rows = min(max_num_seqs * (1 + num_drafts), budget)
    keep = (config.num_layers - 1,) if uses_head else ()
    worker_config = WorkerConfig(budget, rows, MAX_LEN, graph_sizes, keep, num_drafts)
    num_slots = max_num_seqs * (1 + num_drafts)
    worker = make_worker(model, num_blocks, BLOCK_SIZE, worker_config, num_slots=num_slots)
    cache = make_cache(model, num_blocks, BLOCK_SIZE, num_slots, prefix_caching)
    proposer = None
    if uses_head:
        mtp = load_mtp(config, DictWeights(weights), backend, MAX_LEN)
        head, inputs = mtp_head(mtp, backend, max(budget, *graph_sizes, 1), config.vocab_size)
        head_blocks = head_blocks or num_blocks
        head_worker = make_worker(head, head_blocks, BLOCK_SIZE,
                                  WorkerConfig(budget, max_num_seqs, MAX_LEN, graph_sizes, (len(head.layers) - 1,)))
        runner = HeadWorker(head_worker, inputs.hidden, config.hidden_size)
        proposer = DraftHeadProposer(runner, head_blocks, BLOCK_SIZE, budget, config.vocab_size)
    scheduler = Scheduler(SchedulerConfig(MAX_LEN, max_num_seqs, budget, BLOCK_SIZE), cache, None,
                          speculation_policy(speculative, proposer))
    return EngineCore(scheduler, worker, MAX_LEN, config.vocab_size, EOS, grammars)


def write_qwen3_next_folder(folder, weights_of=random_qwen3_next_weights, shape: Mapping = TINY_QWEN3_NEXT,
                            **weights_kwargs):
    """A model folder of a Qwen3-Next of `shape` (MTP layers included unless num_mtp_layers=0)
    with the tiny Llama's trained tokenizer: `weights_of(config, **weights_kwargs)` gives its
    tensors."""
    import json
    from pathlib import Path

    from atlas.adapters.weights.safetensors import write_safetensors
    from atlas.app.bench.tiny_model import write_tiny_model

    folder = write_tiny_model(Path(folder))
    vocab_size = json.loads((folder / "config.json").read_text())["vocab_size"]
    config = {**shape, "vocab_size": vocab_size, "torch_dtype": "bfloat16"}
    (folder / "config.json").write_text(json.dumps(config))
    write_safetensors(folder / "model.safetensors", weights_of(config, **weights_kwargs))
    return folder


# EAGLE-3: a 4-layer tiny Llama target, and a head reading the inputs of its layers 1, 2 and 3
TARGET_LLAMA = {**TINY_LLAMA, "num_hidden_layers": 4}
TINY_EAGLE3 = dict(
    architectures=["LlamaForCausalLMEagle3"], model_type="llama", vocab_size=97, hidden_size=64,
    intermediate_size=96, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
    max_position_embeddings=256, rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=False,
    draft_vocab_size=64, eagle_config={"eagle_aux_hidden_state_layer_ids": [1, 2, 3]},
)


def random_eagle3_weights(config: Mapping = TINY_EAGLE3, seed: int = 5, scale: float = 0.2,
                          draft_ids: np.ndarray | None = None, spelling: str = "midlayer.") -> dict[str, np.ndarray]:
    """Random bf16 weights of an EAGLE-3 head as the published checkpoints name them (`midlayer.`,
    or another `spelling` of the layer's prefix such as "model.layers.0."); `draft_ids`: the
    target id of each draft id (default: every other id, then the first ones), stored as d2t."""
    rng = np.random.default_rng(seed)
    hidden, inter, vocab = config["hidden_size"], config["intermediate_size"], config["vocab_size"]
    draft_vocab = config["draft_vocab_size"]
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    dim = hidden // heads
    shapes = {"fc.weight": (hidden, 3 * hidden), "norm.weight": (hidden,), "lm_head.weight": (draft_vocab, hidden)}
    layer = {
        "input_layernorm.weight": (hidden,), "hidden_norm.weight": (hidden,),
        "post_attention_layernorm.weight": (hidden,),
        "self_attn.q_proj.weight": (heads * dim, 2 * hidden), "self_attn.k_proj.weight": (kv_heads * dim, 2 * hidden),
        "self_attn.v_proj.weight": (kv_heads * dim, 2 * hidden), "self_attn.o_proj.weight": (hidden, heads * dim),
        "mlp.gate_proj.weight": (inter, hidden), "mlp.up_proj.weight": (inter, hidden),
        "mlp.down_proj.weight": (hidden, inter),
    }
    shapes |= {spelling + name: shape for name, shape in layer.items()}
    tensors = {}
    for name, shape in shapes.items():
        is_norm = name.endswith("norm.weight")
        values = 1.0 + 0.1 * rng.standard_normal(shape) if is_norm else scale * rng.standard_normal(shape)
        tensors[name] = values.astype(np.float32).astype(ml_dtypes.bfloat16)
    if draft_ids is None:
        draft_ids = np.sort(np.concatenate([np.arange(0, vocab, 2), np.arange(1, vocab, 2)])[:draft_vocab])
    tensors["d2t"] = (np.asarray(draft_ids) - np.arange(draft_vocab)).astype(np.int64)
    t2d = np.zeros(vocab, bool)
    t2d[draft_ids] = True
    tensors["t2d"] = t2d
    return tensors


def bigram_target(tensors: dict[str, np.ndarray]) -> tuple[dict[str, np.ndarray], np.ndarray]:
    """`tensors` (a Llama's) made into a target whose every layer adds zero (o_proj and down_proj
    are 0): its every layer's output is the token's embedding, its next token a function f of
    the last one. Returns the weights and f as an array."""
    out = {name: np.zeros_like(value) if name.endswith(("o_proj.weight", "down_proj.weight")) else value
           for name, value in tensors.items()}
    embedding = out["model.embed_tokens.weight"].astype(np.float32)
    normed = embedding / np.sqrt(np.mean(embedding**2, axis=-1, keepdims=True) + TARGET_LLAMA["rms_norm_eps"])
    logits = (normed * out["model.norm.weight"].astype(np.float32)) @ out["lm_head.weight"].astype(np.float32).T
    return out, logits.argmax(axis=-1)


def predicting_eagle3(target: dict[str, np.ndarray], follows: np.ndarray, config: Mapping = TINY_EAGLE3
                      ) -> dict[str, np.ndarray]:
    """An EAGLE-3 head for `bigram_target`'s target (next token `follows[token]`) that drafts
    what the target generates next: entry p pairs the target's hidden state at p (the embedding
    of token p) with token p + 1 = f(token p) and must predict f(f(token p)). fc passes the
    first aux layer through, the layer adds zero, and lm_head's row of each draft id t is the sum
    of the unit embeddings of the tokens i with f(f(i)) = t: its largest logit is f(f(i))'s
    unless random embeddings happen to align (rare at 64 dims). The draft vocabulary holds
    every f(f(i)) (d2t maps it), then other ids."""
    hidden, draft_vocab, vocab = config["hidden_size"], config["draft_vocab_size"], config["vocab_size"]
    twice = follows[follows]
    needed = sorted(set(twice.tolist()))
    assert len(needed) <= draft_vocab, f"f(f(i)) takes {len(needed)} ids; raise draft_vocab_size"
    others = [i for i in range(vocab) if i not in set(needed)]
    draft_ids = np.array(sorted(needed + others[: draft_vocab - len(needed)]))
    tensors = random_eagle3_weights(config, draft_ids=draft_ids)
    for name, value in list(tensors.items()):
        if name.endswith(("o_proj.weight", "out_proj.weight", "down_proj.weight")):
            tensors[name] = np.zeros_like(value)
    fc = np.zeros((hidden, 3 * hidden), np.float32)
    fc[:, :hidden] = np.eye(hidden)
    tensors["fc.weight"] = fc.astype(ml_dtypes.bfloat16)
    embedding = target["model.embed_tokens.weight"].astype(np.float32)
    unit = embedding / np.linalg.norm(embedding, axis=-1, keepdims=True)
    lm_head = np.zeros((draft_vocab, hidden), np.float32)
    for token in range(vocab):
        lm_head[int(np.searchsorted(draft_ids, twice[token]))] += unit[token]
    tensors["lm_head.weight"] = lm_head.astype(ml_dtypes.bfloat16)
    tensors["norm.weight"] = np.ones(hidden, ml_dtypes.bfloat16)
    return tensors


def build_eagle3_core(target: dict[str, np.ndarray], head: dict[str, np.ndarray] | None = None,
                      speculative: SpeculativeConfig | None = None, num_blocks=400, max_num_seqs=32, budget=256,
                      graph_sizes=(), head_blocks=None, prefix_caching=True) -> EngineCore:
    """An engine over the 4-layer Llama `target` drafting with the EAGLE-3 `head` under an
    eagle3 `speculative` config (None: plain decoding)."""
    config = ModelConfig.from_dict(TARGET_LLAMA)
    backend = MockGpuBackend(emulate_graphs=bool(graph_sizes))
    model = load_model(config, DictWeights(target), backend, MAX_LEN)
    num_drafts = speculative.num_speculative_tokens if speculative is not None else 0
    rows = min(max_num_seqs * (1 + num_drafts), budget)
    proposer, keep = None, ()
    if speculative is not None:
        facts = TargetFacts(config.hidden_size, config.vocab_size, config.num_layers,
                            lambda: target["model.embed_tokens.weight"])
        loaded = load_eagle3(ModelConfig.from_dict(TINY_EAGLE3), DictWeights(head), backend, MAX_LEN,
                             max(budget, *graph_sizes, 1), facts)
        keep = loaded.target_layers
        head_blocks = head_blocks or num_blocks
        head_worker = make_worker(loaded.model, head_blocks, BLOCK_SIZE,
                                  WorkerConfig(budget, max_num_seqs, MAX_LEN, graph_sizes, (0,)))
        runner = HeadWorker(head_worker, loaded.buffers.hidden, 3 * config.hidden_size, loaded.fuse, loaded.target_ids)
        proposer = DraftHeadProposer(runner, head_blocks, BLOCK_SIZE, budget, config.vocab_size)
    worker_config = WorkerConfig(budget, rows, MAX_LEN, graph_sizes, keep, num_drafts)
    num_slots = max_num_seqs * (1 + num_drafts)
    worker = make_worker(model, num_blocks, BLOCK_SIZE, worker_config, num_slots=num_slots)
    cache = make_cache(model, num_blocks, BLOCK_SIZE, num_slots, prefix_caching)
    scheduler = Scheduler(SchedulerConfig(MAX_LEN, max_num_seqs, budget, BLOCK_SIZE), cache, None,
                          speculation_policy(speculative, proposer))
    return EngineCore(scheduler, worker, MAX_LEN, config.vocab_size, EOS)
