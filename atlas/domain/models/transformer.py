"""The generic decoder-only transformer: embed -> layers -> norm -> lm_head, built from port ops.

A model is data (weights grouped per layer) plus this one loop. Families differ only in how
their loader fills `DecoderLayer`s (fused projections, biases, q/k norms, window), never in
the loop. Every op writes into a `Workspace` sized for the largest step, so a step of N
tokens uses the first N rows of each buffer and a captured graph can replay the same calls.

The residual stream (pre-norm): each norm is issued with the projection that reads it, and each
output projection adds into the residual itself:

    residual = embed(ids)
    for each layer i:
        q = rope_and_cache(rmsnorm_linear(residual, input_norm[i], qkv_proj))  # qkv_rope_cache
        residual += o_proj(attention(q))                                    # linear_add
        residual += down_proj(rmsnorm_gated_linear(residual, post_attention_norm[i], gate_up_proj))
    logits = lm_head(rmsnorm(residual[sample rows], final_norm))               # rmsnorm_linear

A backend may fuse each of these: on CUDA a decode step's GEMVs apply the activation to their
own rows, add into the residual, rotate q and k and write the cache (one token row), and
normalise x themselves: rows up to 2048 wide as they load it; wider rows after the product,
the norm weight having been folded into the projection at load (`fold_norm_weights`). A
batch-1 layer is five kernels up to width 2048 (qkv + rope + cache write, attention, o_proj,
gate_up, down) and six above it, where RoPE and the cache write are a kernel of their own.
Past the GEMV sizes, CUDA runs no norm kernel for a folded norm: the projection multiplies the
residual as it is and the kernel after it (RoPE + cache write, act_mul) scales each row by its
inverse RMS, while the output projections add into the residual inside the GEMM. A backend may
instead let an output projection's product wait for the norm after it (`linear_add(...,
defer=True)` returns True; that norm takes it as `add_first`), so that the add and the norm are
one kernel (CUDA's path with that feature off).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from atlas.domain.models.config import ModelConfig
from atlas.ports.gpu import Activation, AttentionMetadata, DType, GpuBackend, HeadLayout, KvCache, Tensor


@dataclass(frozen=True, slots=True)
class AttentionWeights:
    qkv: Tensor  # [(Hq + 2 Hkv) * D, H]: q, k and v projections stacked
    qkv_bias: Tensor | None  # [(Hq + 2 Hkv) * D]
    output: Tensor  # [H, Hq * D]
    q_norm: Tensor | None  # [D], per-head RMSNorm before RoPE (Qwen3)
    k_norm: Tensor | None


@dataclass(frozen=True, slots=True)
class MlpWeights:
    gate_up: Tensor  # [2 I, H]: gate rows then up rows
    down: Tensor  # [H, I]
    activation: Activation


@dataclass(frozen=True, slots=True)
class DecoderLayer:
    input_norm: Tensor | None  # [H]; None: folded into attention.qkv (fold_norm_weights)
    attention: AttentionWeights
    post_attention_norm: Tensor | None  # [H]; None: folded into mlp.gate_up
    mlp: MlpWeights
    sliding_window: int | None


@dataclass(frozen=True, slots=True)
class StepTensors:
    """The device inputs of one step (views of the runner's persistent buffers)."""

    token_ids: Tensor  # [N] i32
    meta: AttentionMetadata
    sample_indices: Tensor | None  # [R] i32: rows of the step whose next token is sampled; None: all, in order


@dataclass(frozen=True, slots=True)
class Workspace:
    """Activation buffers for up to `max_tokens` tokens and `max_sample_rows` sampled rows."""

    max_tokens: int
    max_sample_rows: int
    residual: Tensor  # [T, H]
    normed: Tensor  # [T, H]: rmsnorm(residual) where the backend does not fuse it into a product
    delta: Tensor  # [T, H]: a projection's output before it is added to the residual (likewise)
    qkv: Tensor  # [T, (Hq + 2 Hkv) * D]
    queries: Tensor  # [T, Hq * D]
    attention_out: Tensor  # [T, Hq * D]
    mlp_hidden: Tensor  # [T, 2 I]: gate | up before the activation (likewise)
    mlp_out: Tensor  # [T, I]
    sample_hidden: Tensor  # [R, H]
    sample_normed: Tensor  # [R, H]
    logits: Tensor  # [R, V] f32


def fold_norm_weights(
    backend: GpuBackend, layers: list[DecoderLayer], final_norm: Tensor, lm_head: Tensor, embedding: Tensor
) -> tuple[list[DecoderLayer], Tensor | None]:
    """Offer each RMSNorm weight to the backend to fold into the projection it feeds
    (`GpuBackend.fold_rmsnorm`), once, when the model is loaded; returns the layers and final
    norm with None where it was folded. A tied lm_head is the embedding table, which the
    embedding lookup reads unscaled, so the final norm stays apart there."""
    folded = []
    for layer in layers:
        input_norm, post_norm = layer.input_norm, layer.post_attention_norm
        if input_norm is not None and backend.fold_rmsnorm(input_norm, layer.attention.qkv):
            input_norm = None
        if post_norm is not None and backend.fold_rmsnorm(post_norm, layer.mlp.gate_up):
            post_norm = None
        folded.append(replace(layer, input_norm=input_norm, post_attention_norm=post_norm))
    if lm_head is not embedding and backend.fold_rmsnorm(final_norm, lm_head):
        return folded, None
    return folded, final_norm


class Transformer:
    """A loaded model: weights on a backend and the forward loop over them."""

    def __init__(
        self,
        config: ModelConfig,
        backend: GpuBackend,
        embedding: Tensor,
        layers: list[DecoderLayer],
        final_norm: Tensor | None,
        lm_head: Tensor,
        rope_table: Tensor,
    ) -> None:
        self.config = config
        self.backend = backend
        self.embedding = embedding
        self.layers = layers
        self.final_norm = final_norm
        self.lm_head = lm_head
        self.rope_table = rope_table
        self.heads = HeadLayout(config.num_heads, config.num_kv_heads, config.head_dim)
        self.attention_scale = config.head_dim**-0.5

    @property
    def vocab_size(self) -> int:
        return self.lm_head.shape[0]

    @property
    def max_positions(self) -> int:
        return self.rope_table.shape[0]

    def allocate_workspace(self, max_tokens: int, max_sample_rows: int) -> Workspace:
        config, backend = self.config, self.backend
        dtype = backend.capabilities.activation_dtype
        qkv_size = self.heads.q_size + 2 * self.heads.kv_size
        return Workspace(
            max_tokens=max_tokens,
            max_sample_rows=max_sample_rows,
            residual=backend.empty((max_tokens, config.hidden_size), dtype),
            normed=backend.empty((max_tokens, config.hidden_size), dtype),
            delta=backend.empty((max_tokens, config.hidden_size), dtype),
            qkv=backend.empty((max_tokens, qkv_size), dtype),
            queries=backend.empty((max_tokens, self.heads.q_size), dtype),
            attention_out=backend.empty((max_tokens, self.heads.q_size), dtype),
            mlp_hidden=backend.empty((max_tokens, 2 * config.intermediate_size), dtype),
            mlp_out=backend.empty((max_tokens, config.intermediate_size), dtype),
            sample_hidden=backend.empty((max_sample_rows, config.hidden_size), dtype),
            sample_normed=backend.empty((max_sample_rows, config.hidden_size), dtype),
            logits=backend.empty((max_sample_rows, self.vocab_size), DType.F32),
        )

    def workspace_bytes(self, max_tokens: int, max_sample_rows: int) -> int:
        """What `allocate_workspace` will take, for the startup memory check."""
        config = self.config
        itemsize = self.backend.capabilities.activation_dtype.itemsize
        per_token = 3 * config.hidden_size + self.heads.q_size * 3 + 2 * self.heads.kv_size
        per_token += 3 * config.intermediate_size
        per_row = 2 * config.hidden_size * itemsize + self.vocab_size * 4
        return max_tokens * per_token * itemsize + max_sample_rows * per_row

    def forward(self, step: StepTensors, kv: KvCache, workspace: Workspace, num_sample_rows: int) -> Tensor:
        """Run every layer over the step's tokens; return logits [num_sample_rows, V] (a view)."""
        backend, eps = self.backend, self.config.rms_norm_eps
        num_tokens = step.meta.num_tokens
        residual = workspace.residual.rows(0, num_tokens)
        backend.embedding(step.token_ids, self.embedding, residual)
        pending = None  # a product the last layer left for the final norm to add (linear_add)
        for index, layer in enumerate(self.layers):
            last = index == len(self.layers) - 1
            # The final norm takes the add only where it reads the residual itself (no gather).
            pending = self._layer(
                index, layer, step.meta, kv, workspace, num_tokens, pending,
                defer_down=not last or step.sample_indices is None,
            )
        sample_normed = workspace.sample_normed.rows(0, num_sample_rows)
        logits = workspace.logits.rows(0, num_sample_rows)
        if step.sample_indices is None:  # a decode step samples every row: no gather
            sample_hidden = residual.rows(0, num_sample_rows)
        else:
            sample_hidden = workspace.sample_hidden.rows(0, num_sample_rows)
            backend.gather_rows(residual, step.sample_indices, sample_hidden)
        backend.rmsnorm_linear(
            sample_hidden, self.final_norm, eps, self.lm_head, logits, sample_normed, add_first=pending
        )
        return logits

    def _layer(
        self,
        index: int,
        layer: DecoderLayer,
        meta: AttentionMetadata,
        kv: KvCache,
        workspace: Workspace,
        num_tokens: int,
        pending: Tensor | None,
        defer_down: bool,
    ) -> Tensor | None:
        """One layer over the residual stream; `pending`: the previous layer's down projection,
        still to be added into the residual (its norm here adds it). Returns this layer's, or
        None where the backend added it (or `defer_down` is False)."""
        backend, eps, attention = self.backend, self.config.rms_norm_eps, layer.attention
        residual = workspace.residual.rows(0, num_tokens)
        normed = workspace.normed.rows(0, num_tokens)
        delta = workspace.delta.rows(0, num_tokens)
        qkv = workspace.qkv.rows(0, num_tokens)
        queries = workspace.queries.rows(0, num_tokens)
        attention_out = workspace.attention_out.rows(0, num_tokens)
        mlp_hidden = workspace.mlp_hidden.rows(0, num_tokens)
        mlp_out = workspace.mlp_out.rows(0, num_tokens)

        backend.qkv_rope_cache(
            residual,
            layer.input_norm,
            eps,
            attention.qkv,
            attention.qkv_bias,
            meta,
            self.rope_table,
            kv,
            index,
            self.heads,
            queries,
            qkv,
            normed,
            attention.q_norm,
            attention.k_norm,
            pending,
        )
        backend.attention(
            queries, kv, index, meta, self.heads, self.attention_scale, attention_out, layer.sliding_window
        )
        deferred = backend.linear_add(attention_out, attention.output, residual, delta, defer=True)
        post_norm, mlp = layer.post_attention_norm, layer.mlp
        backend.rmsnorm_gated_linear(
            residual, post_norm, eps, mlp.gate_up, mlp.activation, mlp_out, normed, mlp_hidden, delta if deferred else None
        )
        deferred = backend.linear_add(mlp_out, layer.mlp.down, residual, delta, defer=defer_down)
        return delta if deferred else None
