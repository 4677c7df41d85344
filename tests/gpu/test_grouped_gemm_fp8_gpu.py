"""grouped_gemm_fp8's Hopper kernel against the emulated path on the same quantised operands (forward, data gradient,
weight gradient), and the whole op's gradients against the emulated op. Skipped without a Hopper GPU.

Tolerances: both sides multiply the same FP8 values with the same scales and accumulate in float32, promoted every 128
elements of K; they differ by the kernel's bfloat16 output (half a bf16 ulp, 2^-9 relative, per element) and the
order of float32 summation (Hopper's FP8 tensor cores keep fewer bits inside one 32-deep instruction, bounded by the
128-deep promotion). So: relative Frobenius error < 3e-3, and every element within 2^-7 of its value + 1e-3 of the
largest magnitude."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tests import reference
from tests.gpu import GPU, requires_gpu

pytestmark = requires_gpu

HOPPER = GPU is not None and str(getattr(GPU, "compute_capability", "")).startswith("9")
requires_hopper = pytest.mark.skipif(not HOPPER, reason="the FP8 kernel needs a Hopper GPU (compute capability 9.x)")

if GPU is not None:
    from turbo_moe.ops import grouped_gemm_fp8
    from turbo_moe.ops.grouped_gemm_fp8 import (
        quantize_blocks,
        quantize_group_columns,
        quantize_rows,
        rows_product,
        weight_grad_product,
    )

CASES = {  # name: (M, K, N, G, sizes-kind)
    "odd_m_empty_groups": (1001, 256, 384, 7, "with_empty"),
    "skewed_one_group": (777, 512, 256, 4, "one_group"),
    "short_tail_rows": (1500, 384, 512, 5, "short"),
    "many_tiles": (4096, 1024, 768, 8, "random"),
    "single_group": (300, 128, 128, 1, "random"),
}


def make_sizes(kind, m, g, rng):
    if kind == "one_group":
        s = np.zeros(g, np.int32)
        s[g // 2] = m
        return s
    total = m - 123 if kind == "short" else m
    s = np.bincount(rng.integers(0, g, total), minlength=g).astype(np.int32)
    if kind == "with_empty":
        s[1] += s[0] + s[-1]
        s[0] = s[-1] = 0
    return s


def inputs(case):
    m, k, n, g, kind = CASES[case]
    rng = np.random.default_rng()
    x = jnp.asarray(rng.standard_normal((m, k)), jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal((g, k, n)) / np.sqrt(k), jnp.bfloat16)
    return x, w, make_sizes(kind, m, g, rng), rng


def assert_close(got, want):
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    assert got.shape == want.shape
    err = np.linalg.norm(got - want) / max(np.linalg.norm(want), 1e-30)
    assert err < 3e-3, err
    bound = 2.0 ** -7 * np.abs(want) + 1e-3 * np.abs(want).max()
    assert np.all(np.abs(got - want) <= bound), np.abs(got - want).max()


def uses_kernel(fn, *args, target="turbo_moe_grouped_gemm_fp8"):
    return target in jax.jit(fn).lower(*args).as_text()


@requires_hopper
@pytest.mark.parametrize("case", CASES)
def test_forward_and_data_gradient_products_match_emulation(case):
    x, w, sizes, rng = inputs(case)
    gs = jnp.asarray(sizes)
    lq, ls = jax.jit(quantize_rows)(x)
    wq_t, ws = jax.jit(lambda a: quantize_blocks(a, transpose=True))(w)
    kernel = jax.jit(lambda *a: rows_product(*a, impl="auto"))
    emulated = jax.jit(lambda *a: rows_product(*a, impl="emulated"))
    assert uses_kernel(lambda *a: rows_product(*a), lq, ls, wq_t, ws, gs)
    out = kernel(lq, ls, wq_t, ws, gs)
    assert out.devices() == {GPU}
    assert_close(out, emulated(lq, ls, wq_t, ws, gs))
    tail = int(reference.group_bounds(sizes, x.shape[0])[-1])
    assert not np.any(np.asarray(out)[tail:]), "rows past sum(group_sizes) must be zero"
    # data gradient: d_out (M, N) per 1x128 against the weights in their (G, K, N) layout, scales transposed
    dq, ds = jax.jit(quantize_rows)(jnp.asarray(rng.standard_normal((x.shape[0], w.shape[2])), jnp.bfloat16))
    wq, ws = jax.jit(quantize_blocks)(w)
    ws_t = jnp.swapaxes(ws, 1, 2)
    assert_close(kernel(dq, ds, wq, ws_t, gs), emulated(dq, ds, wq, ws_t, gs))


@requires_hopper
@pytest.mark.parametrize("case", CASES)
def test_weight_gradient_product_matches_emulation(case):
    x, w, sizes, rng = inputs(case)
    gs = jnp.asarray(sizes)
    m = x.shape[0]
    d_out = jnp.asarray(rng.standard_normal((m, w.shape[2])), jnp.bfloat16)
    quant = jax.jit(quantize_group_columns)
    lq, ls = quant(x, gs)
    dq, ds = quant(d_out, gs)
    assert uses_kernel(lambda *a: weight_grad_product(*a, m), lq, ls, dq, ds, gs,
                       target="turbo_moe_grouped_gemm_fp8_weight_grad")
    got = jax.jit(lambda *a: weight_grad_product(*a, m))(lq, ls, dq, ds, gs)
    want = jax.jit(lambda *a: weight_grad_product(*a, m, impl="emulated"))(lq, ls, dq, ds, gs)
    assert_close(got, want)
    for g in np.nonzero(np.diff(reference.group_bounds(sizes, m)) == 0)[0]:
        assert not np.any(np.asarray(got)[g]), "an empty group's weight gradient is zero"


@requires_hopper
@pytest.mark.parametrize("weight_grad", ["fp8", "bf16"])
@pytest.mark.parametrize("case", ["odd_m_empty_groups", "many_tiles"])
def test_op_value_and_gradients_match_emulated_op(case, weight_grad):
    x, w, sizes, rng = inputs(case)
    gs = jnp.asarray(sizes)
    c = jnp.asarray(rng.standard_normal((x.shape[0], w.shape[2])), jnp.float32)

    def run(impl):
        def loss(a, b):
            out = grouped_gemm_fp8(a, b, gs, weight_grad=weight_grad, impl=impl)
            return jnp.sum(out.astype(jnp.float32) * c), out
        (_, out), grads = jax.jit(jax.value_and_grad(loss, (0, 1), has_aux=True))(x, w)
        return out, grads

    out, (dx, dw) = run("auto")
    out_e, (dx_e, dw_e) = run("emulated")
    assert out.dtype == dx.dtype == dw.dtype == jnp.bfloat16
    assert_close(out, out_e)
    assert_close(dx, dx_e)
    assert_close(dw, dw_e)
    # and the FP8 result is within FP8's bound of float32 (tests/ops/test_grouped_gemm_fp8.py)
    ref = reference.grouped_gemm(np.asarray(x, np.float32), np.asarray(w, np.float32), sizes)
    assert np.linalg.norm(np.asarray(out, np.float64) - ref) / np.linalg.norm(ref) < 0.06

