"""`fp8_weights` (expert weights' FP8 blocks made once) and the weight gradient's precision rule of the FP8 GEMM.

Fp8Weights must change no bit of what the op computes from the weight itself: the same blocks, the same scales, the
gradient to the weight. The weight gradient runs in FP8 or bf16 by `weight_grad`; "auto" follows a measured rule."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tests import reference
from turbo_moe import ops
from turbo_moe.ops.fp8_scaling import Fp8Weights, fp8_weights, quantize_blocks, quantize_rows
from turbo_moe.ops.grouped_gemm_fp8 import (
    FP8_WEIGHT_GRAD_MIN_ROWS_PER_GROUP,
    FP8_WEIGHT_GRAD_MIN_WIDTH,
    grouped_gemm_fp8,
    grouped_gemm_fp8_quantized,
    weight_grad_in_fp8,
)


def _problem(m=301, k=256, n=384, g=5, dtype=jnp.bfloat16, seed=None):
    """Fresh random rows, weights and output gradient; group sizes with an empty group, not summing to M."""
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.standard_normal((m, k)) * rng.lognormal(0, 2, (m, 1)), dtype)  # a wide dynamic range
    w = jnp.asarray(rng.standard_normal((g, k, n)) / np.sqrt(k), dtype)
    sizes = rng.multinomial(m - 13, np.ones(g) / g).astype(np.int32)
    sizes[1] = 0
    d_out = jnp.asarray(rng.standard_normal((m, n)), dtype)
    return x, w, jnp.asarray(sizes), d_out


def _bits(a):
    return np.asarray(a.astype(jnp.float32)).view(np.uint32)


def test_fp8_weights_are_the_op_blocks_in_both_layouts_for_any_leading_axes():
    _, w, _, _ = _problem(g=3)
    w8 = jax.jit(fp8_weights)(w)
    q, scale = quantize_blocks(w)
    assert w8.master is w or np.array_equal(_bits(w8.master), _bits(w))
    np.testing.assert_array_equal(np.asarray(w8.q_kn).view(np.uint8), np.asarray(q).view(np.uint8))
    np.testing.assert_array_equal(np.asarray(w8.q_nk).view(np.uint8),
                                  np.asarray(jnp.swapaxes(q, 1, 2)).view(np.uint8))
    np.testing.assert_array_equal(np.asarray(w8.scale), np.asarray(scale))
    assert (w8.shape, w8.dtype, w8.ndim) == (w.shape, w.dtype, 3)
    stacked = fp8_weights(jnp.stack([w, 2 * w]))  # (L, G, K, N): a layer stack's weights, all layers at once
    for layer, scale_by in enumerate((1, 2)):
        one = fp8_weights(scale_by * w)
        for name in ("q_nk", "q_kn", "scale"):
            np.testing.assert_array_equal(np.asarray(getattr(stacked, name)[layer]).view(np.uint8),
                                          np.asarray(getattr(one, name)).view(np.uint8), err_msg=name)


@pytest.mark.parametrize("weight_grad", ["fp8", "bf16"])
def test_op_on_fp8_weights_changes_no_bit(weight_grad):
    x, w, gs, d_out = _problem()

    def run(prepare):
        f = lambda a, b: grouped_gemm_fp8(a, fp8_weights(b) if prepare else b, gs, weight_grad=weight_grad)
        out, vjp = jax.vjp(jax.jit(f), x, w)
        return (out,) + vjp(d_out)

    for name, a, b in zip(("out", "d_x", "d_w"), run(True), run(False)):
        assert a.dtype == b.dtype == jnp.bfloat16
        np.testing.assert_array_equal(_bits(a), _bits(b), err_msg=name)
    q, s = quantize_rows(x)

    def run_quantized(prepare):  # the op on rows quantised beforehand (permute_fp8's)
        out, vjp = jax.vjp(lambda b: grouped_gemm_fp8_quantized(q, s, fp8_weights(b) if prepare else b, gs,
                                                                weight_grad=weight_grad), w)
        return out, vjp(d_out)[0]

    for a, b in zip(run_quantized(True), run_quantized(False)):
        np.testing.assert_array_equal(_bits(a), _bits(b))


def test_gradient_through_fp8_weights_reaches_the_weight_only():
    x, w, gs, d_out = _problem(dtype=jnp.float32)
    w8 = fp8_weights(w)
    _, vjp = jax.vjp(lambda b: grouped_gemm_fp8(x, b, gs), w8)
    (d_w8,) = vjp(d_out)
    assert isinstance(d_w8, Fp8Weights) and d_w8.master.shape == w.shape and float(jnp.abs(d_w8.master).max()) > 0
    for name in ("q_nk", "q_kn", "scale"):
        assert not np.asarray(getattr(d_w8, name), np.float32).any(), name


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_bf16_weight_gradient_is_the_bf16_grouped_gemm_of_the_unquantised_operands(dtype):
    x, w, gs, d_out = _problem(dtype=dtype)
    _, vjp_bf16 = jax.vjp(lambda a, b: grouped_gemm_fp8(a, b, gs, weight_grad="bf16"), x, w)
    _, vjp_fp8 = jax.vjp(lambda a, b: grouped_gemm_fp8(a, b, gs, weight_grad="fp8"), x, w)
    d_x, d_w = vjp_bf16(d_out)
    want = ops.grouped_gemm_weight_grad(x.astype(jnp.bfloat16), d_out.astype(jnp.bfloat16), gs,
                                        preferred_element_type=dtype)
    assert d_w.dtype == dtype
    np.testing.assert_array_equal(_bits(d_w), _bits(want))
    np.testing.assert_array_equal(_bits(d_x), _bits(vjp_fp8(d_out)[0]))  # the data gradient stays in FP8
    exact = reference.weight_grad(np.asarray(x, np.float64), np.asarray(d_out, np.float64), np.asarray(gs))
    err_bf16 = np.linalg.norm(np.asarray(d_w, np.float64) - exact) / np.linalg.norm(exact)
    err_fp8 = np.linalg.norm(np.asarray(vjp_fp8(d_out)[1], np.float64) - exact) / np.linalg.norm(exact)
    assert err_bf16 < 1e-2 < err_fp8 < 0.06  # bf16 rounding of the inputs only; FP8's ~3.5%


def test_weight_grad_rule():
    wide, rows = FP8_WEIGHT_GRAD_MIN_WIDTH, FP8_WEIGHT_GRAD_MIN_ROWS_PER_GROUP
    assert weight_grad_in_fp8(rows * 32, wide, wide, 32)
    assert not weight_grad_in_fp8(rows * 32 - 1, wide, wide, 32)  # too few rows a group
    assert not weight_grad_in_fp8(rows * 32, wide - 128, wide, 32)  # a narrow side
    assert weight_grad_in_fp8(8, 128, 128, 4, "fp8") and not weight_grad_in_fp8(10 ** 7, 8192, 8192, 1, "bf16")
    with pytest.raises(ValueError, match=r"weight_grad must be one of \('auto', 'fp8', 'bf16'\), got 'fp16'"):
        weight_grad_in_fp8(8, 128, 128, 1, "fp16")
    x, w, gs, _ = _problem()
    with pytest.raises(ValueError, match="weight_grad must be one of"):
        grouped_gemm_fp8(x, w, gs, weight_grad="e4m3")


def test_expert_block_on_fp8_weights_changes_no_bit_and_other_sets_refuse_them():
    rng = np.random.default_rng()
    t, d, f, e, k = 70, 256, 128, 4, 2
    x = jnp.asarray(rng.standard_normal((t, d)), jnp.bfloat16)
    ids = jnp.asarray(rng.integers(0, e, (t, k)), jnp.int32)
    cw = jnp.asarray(rng.random((t, k)), jnp.float32)
    wg = jnp.asarray(rng.standard_normal((e, d, 2 * f)) * 0.05, jnp.bfloat16)
    wd = jnp.asarray(rng.standard_normal((e, f, d)) * 0.05, jnp.bfloat16)

    def loss_and_grads(prepare):
        def f_(a, c, g, w):
            g, w = (fp8_weights(g), fp8_weights(w)) if prepare else (g, w)
            return jnp.sum(ops.expert_block(a, ids, c, g, w, gemms="fp8")[0].astype(jnp.float32) ** 2)
        return jax.jit(jax.value_and_grad(f_, argnums=(0, 1, 2, 3)))(x, cw, wg, wd)

    for a, b in zip(jax.tree.leaves(loss_and_grads(True)), jax.tree.leaves(loss_and_grads(False))):
        np.testing.assert_array_equal(_bits(a), _bits(b))
    with pytest.raises(TypeError, match="w_down is Fp8Weights .* only gemms='fp8' reads; got gemms='turbo'"):
        ops.expert_block(x, ids, cw, wg, fp8_weights(wd), gemms="turbo")


def test_bad_input_names_the_argument():
    with pytest.raises(TypeError, match="w must be a bfloat16, float16 or float32 jax.Array"):
        fp8_weights(jnp.ones((2, 128, 128), jnp.int32))
    with pytest.raises(TypeError, match="w must be"):
        fp8_weights(jnp.ones((2, 128, 128), jnp.float8_e4m3fn))
    with pytest.raises(ValueError, match=r"K and N positive multiples of 128 .* got \(2, 128, 100\)"):
        fp8_weights(jnp.ones((2, 128, 100)))
    with pytest.raises(ValueError, match=r"\(\.\.\., G, K, N\)"):
        fp8_weights(jnp.ones((128, 128)))
    x, w, gs, _ = _problem(k=128, n=128, g=2)
    w8 = fp8_weights(w)
    with pytest.raises(ValueError, match=r"rhs.q_nk must be float8_e4m3fn \(2, 128, 128\)"):
        grouped_gemm_fp8(x, w8._replace(q_nk=w8.q_nk[:1]), gs)
    with pytest.raises(ValueError, match=r"rhs.scale must be float32"):
        grouped_gemm_fp8(x, w8._replace(scale=w8.scale.astype(jnp.bfloat16)), gs)
