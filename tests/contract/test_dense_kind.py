"""The dense kind: embedding, projections with their norms and gated activations, the residual
add, the logits."""

from __future__ import annotations

import numpy as np
import pytest
from contract_harness import prepared_or_skip
from kind_references import bf16, glu, rel, rmsnorm

from atlas.ports.gpu import DType
from atlas.ports.kernels.dense import HostProjection, HostVocab
from atlas.ports.kernels.host_weights import Activation, ClampedSwiglu, HostLinear, RmsNorm

EPS = 1e-5


def _norm(rng, width):
    return RmsNorm(bf16(1 + 0.3 * rng.standard_normal(width)), EPS)


def _linear(rng, rows, inner, bias=False):
    weight = bf16(rng.standard_normal((rows, inner)) / np.sqrt(inner))
    return HostLinear(weight, bf16(rng.standard_normal(rows)) if bias else None)


def _reference(x, host: HostProjection):
    values = np.asarray(x, np.float64)
    if host.input_norm is not None:
        values = rmsnorm(values, host.input_norm.weight, host.input_norm.eps)
    values = values @ host.linear.values().T.astype(np.float64)
    if host.linear.bias is not None:
        values = values + host.linear.bias
    if host.activation is not None:
        values = glu(values, host.activation)
    if host.output_norm is not None:
        values = rmsnorm(values, host.output_norm.weight, host.output_norm.eps)
    return values


# (tokens, output rows, inner): one token and a few (decode GEMVs), past them, odd widths, and
# rows of 2048 and wider (CUDA folds the norm weight into the matrix there: ops_dense.FOLD_NORM_MIN_WIDTH).
SHAPES = [(1, 576, 576), (1, 1536, 4096), (3, 96, 264), (8, 1000, 4096), (16, 576, 1536), (37, 256, 2560)]


@pytest.mark.parametrize("num_tokens, rows, inner", SHAPES)
@pytest.mark.parametrize("with_norm, with_bias", [(False, False), (True, False), (True, True), (False, True)])
def test_project(harness, rng, num_tokens, rows, inner, with_norm, with_bias):
    backend = harness.backend
    host = HostProjection(_linear(rng, rows, inner, with_bias), _norm(rng, inner) if with_norm else None)
    x = bf16(rng.standard_normal((num_tokens, inner)) * 3)
    out = harness.poisoned((num_tokens, rows))
    backend.dense.project(backend.upload(x, harness.act), prepared_or_skip(backend.dense.prepare, host), out)
    assert rel(harness.host(out), _reference(x, host)) < harness.tolerance


@pytest.mark.parametrize("num_tokens, features, inner", [(1, 768, 576), (1, 1000, 4096), (5, 300, 512), (70, 96, 2560)])
@pytest.mark.parametrize("activation", [Activation.SILU, Activation.GELU_TANH, ClampedSwiglu(alpha=1.702, limit=7.0)])
def test_project_with_a_gated_activation(harness, rng, num_tokens, features, inner, activation):
    """out = act(gate) * up over the [gate; up] rows' products, after the input norm."""
    backend = harness.backend
    host = HostProjection(_linear(rng, 2 * features, inner), _norm(rng, inner), activation)
    assert host.out_features == features
    x = bf16(rng.standard_normal((num_tokens, inner)) * 3)
    x[0] *= 20  # rows of very different RMS
    out = harness.poisoned((num_tokens, features))
    backend.dense.project(backend.upload(x, harness.act), prepared_or_skip(backend.dense.prepare, host), out)
    assert rel(harness.host(out), _reference(x, host)) < harness.tolerance


@pytest.mark.parametrize("num_tokens, hidden, inner", [(1, 4096, 4096), (1, 576, 1536), (4, 1000, 4096), (64, 576, 576), (300, 256, 512)])
def test_project_add_adds_into_the_residual(harness, rng, num_tokens, hidden, inner):
    backend = harness.backend
    host = HostProjection(_linear(rng, hidden, inner))
    prepared = prepared_or_skip(backend.dense.prepare, host)
    x = bf16(rng.standard_normal((num_tokens, inner)))
    residual = bf16(rng.standard_normal((num_tokens, hidden)) * 4)
    stream = backend.upload(residual, harness.act)
    x_tensor = backend.upload(x, harness.act)
    backend.dense.project_add(x_tensor, prepared, stream)
    backend.dense.project_add(x_tensor, prepared, stream)  # a second add, onto the first one's result
    assert rel(harness.host(stream), residual + 2 * _reference(x, host)) < harness.tolerance


def test_project_add_with_an_output_norm(harness, rng):
    """Gemma's post-norms: residual += rmsnorm(x @ W.T)."""
    backend = harness.backend
    host = HostProjection(_linear(rng, 128, 64), output_norm=_norm(rng, 128))
    prepared = prepared_or_skip(backend.dense.prepare, host)
    x = bf16(rng.standard_normal((5, 64)))
    residual = bf16(rng.standard_normal((5, 128)))
    stream = backend.upload(residual, harness.act)
    backend.dense.project_add(backend.upload(x, harness.act), prepared, stream)
    assert rel(harness.host(stream), residual + _reference(x, host)) < harness.tolerance


def test_project_add_refuses_a_gated_activation(harness, rng):
    backend = harness.backend
    prepared = prepared_or_skip(backend.dense.prepare, HostProjection(_linear(rng, 64, 32), activation=Activation.SILU))
    with pytest.raises(ValueError):
        backend.dense.project_add(backend.upload(bf16(np.ones((2, 32))), harness.act), prepared,
                                  backend.upload(np.zeros((2, 32), np.float32), harness.act))


@pytest.mark.parametrize("block_shape", [None, (4, 8)])
def test_quantized_weights_stand_for_weight_times_scales(harness, rng, block_shape):
    """FP8 E4M3 values with per-channel or block scales project as their dequantized values."""
    import ml_dtypes

    backend = harness.backend
    rows, inner = 24, 40
    weight = (rng.standard_normal((rows, inner)) * 100).astype(ml_dtypes.float8_e4m3fn)
    scale_shape = (rows,) if block_shape is None else (-(-rows // block_shape[0]), -(-inner // block_shape[1]))
    scales = bf16(rng.uniform(0.001, 0.01, scale_shape))
    host = HostProjection(HostLinear(weight, scales=scales, block_shape=block_shape))
    expanded = scales[:, None] if block_shape is None else np.kron(scales, np.ones(block_shape))[:rows, :inner]
    x = bf16(rng.standard_normal((3, inner)))
    out = harness.poisoned((3, rows))
    backend.dense.project(backend.upload(x, harness.act), prepared_or_skip(backend.dense.prepare, host), out)
    expected = x.astype(np.float64) @ (weight.astype(np.float64) * expanded).T
    assert rel(harness.host(out), expected) < harness.tolerance


def _fp8_linear(rng, rows, inner, block):
    import ml_dtypes

    data = np.clip(rng.standard_normal((rows, inner)) * 100, -448, 448).astype(ml_dtypes.float8_e4m3fn)
    shape = (-(-rows // 128), -(-inner // 128)) if block else (rows,)
    scales = rng.uniform(0.5, 2.0, shape).astype(np.float32) / (100 * np.sqrt(inner))
    return HostLinear(data, scales=scales, block_shape=(128, 128) if block else None)


@pytest.mark.parametrize("num_tokens, rows, inner", [(1, 1024, 4096), (4, 300, 1024), (40, 256, 2560)])
@pytest.mark.parametrize("block", [False, True], ids=["channel", "block"])
def test_quantized_projections_in_every_form(harness, rng, num_tokens, rows, inner, block):
    """FP8 weights (per channel, or the 128 x 128 blocks of Qwen3-FP8 / DeepSeek-V3) behind the
    input norm, in the plain, gated and residual-add forms, as their dequantized values."""
    backend = harness.backend
    x = bf16(rng.standard_normal((num_tokens, inner)) * 3)
    norm = _norm(rng, inner)
    plain = HostProjection(_fp8_linear(rng, rows, inner, block), norm)
    gated = HostProjection(_fp8_linear(rng, 2 * rows, inner, block), norm, Activation.SILU)
    for host in (plain, gated):
        out = harness.poisoned((num_tokens, host.out_features))
        backend.dense.project(backend.upload(x, harness.act), prepared_or_skip(backend.dense.prepare, host), out)
        assert rel(harness.host(out), _reference(x, host)) < harness.fp8_tolerance
    residual = bf16(rng.standard_normal((num_tokens, rows)))
    stream = backend.upload(residual, harness.act)
    added = HostProjection(_fp8_linear(rng, rows, inner, block))
    backend.dense.project_add(backend.upload(x, harness.act), prepared_or_skip(backend.dense.prepare, added), stream)
    assert rel(harness.host(stream) - residual, _reference(x, added)) < harness.fp8_tolerance


@pytest.mark.parametrize("scale", [1.0, 24.0])
def test_embed(harness, rng, scale):
    backend = harness.backend
    table = bf16(rng.standard_normal((1000, 64)))
    host = HostVocab(table, RmsNorm(np.ones(64, np.float32), EPS), None, embedding_scale=scale)
    vocab = prepared_or_skip(backend.dense.prepare_vocab, host)
    ids = rng.integers(0, 1000, 37, dtype=np.int32)
    out = harness.poisoned((37, 64))
    backend.dense.embed(backend.upload(ids), vocab, out)
    assert rel(harness.host(out), table[ids].astype(np.float64) * scale) < harness.tolerance


@pytest.mark.parametrize("tied, softcap", [(False, None), (True, None), (False, 30.0)])
def test_logits(harness, rng, tied, softcap):
    """f32 logits of the final norm's output through the head (the embedding itself when tied)."""
    backend = harness.backend
    vocab_size, hidden = 3000, 256
    table = bf16(rng.standard_normal((vocab_size, hidden)))
    head = None if tied else _linear(rng, vocab_size, hidden)
    final_norm = _norm(rng, hidden)
    host = HostVocab(table, final_norm, head, logit_softcap=softcap)
    vocab = prepared_or_skip(backend.dense.prepare_vocab, host)
    for num_rows in (1, 6):
        hidden_rows = bf16(rng.standard_normal((num_rows, hidden)) * 3)
        out = harness.poisoned((num_rows, vocab_size), DType.F32)
        backend.dense.logits(backend.upload(hidden_rows, harness.act), vocab, out)
        weight = table if tied else head.weight
        expected = rmsnorm(hidden_rows, final_norm.weight, EPS) @ weight.T.astype(np.float64)  # std ~16
        if softcap is not None:
            expected = softcap * np.tanh(expected / softcap)
        assert rel(harness.host(out), expected) < harness.tolerance


def test_a_projection_that_does_not_fit_names_the_argument(harness, rng):
    backend = harness.backend
    prepared = prepared_or_skip(backend.dense.prepare, HostProjection(_linear(rng, 32, 48)))
    with pytest.raises(ValueError, match="x|weight|out"):
        backend.dense.project(backend.upload(bf16(np.ones((2, 64))), harness.act), prepared, harness.poisoned((2, 32)))
