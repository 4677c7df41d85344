"""grouped_gemm_swiglu on the GPU: h equal to grouped_gemm's bit for bit, act against float64 from that h (the
16-byte and the scalar SwiGLU kernels, empty groups, zero tails, skewed routing), gradients against the pieces, and
the reason the op exists: inside a layer scan XLA writes h into the stacked outputs from inside the FFI call."""
import re

import numpy as np
import pytest

import jax
import jax.numpy as jnp

from tests.gpu import GPU, requires_gpu
from tests.gpu.test_cuda_ops import GEMM_CASES, TOL, gemm_inputs, rel_err

pytestmark = requires_gpu

if GPU is not None:
    from turbo_moe import ops

EVEN_CASES = [c for c, (_, _, n, _) in GEMM_CASES.items() if n % 2 == 0]
# act: one rounding of a float32 value (half an ulp) plus float32's exp: 2 ulps of slack
ACT_RTOL = {jnp.bfloat16: 8e-3, jnp.float16: 1e-3, jnp.float32: 2e-6}


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16, jnp.float32])
@pytest.mark.parametrize("case", EVEN_CASES)
def test_forward_matches_grouped_gemm_and_float64(case, dtype):
    rng = np.random.default_rng()
    lhs, rhs, gs, _, sizes = gemm_inputs(rng, case, dtype, False)
    n = rhs.shape[-1]
    h, act = jax.jit(ops.grouped_gemm_swiglu)(lhs, rhs, gs)
    assert h.devices() == {GPU} and act.shape == (lhs.shape[0], n // 2) and act.dtype == dtype
    same = jax.jit(ops.grouped_gemm)(lhs, rhs, gs)
    assert np.array_equal(np.asarray(h, np.float32), np.asarray(same, np.float32))
    hf = np.asarray(h, np.float64)
    gate, up = hf[:, :n // 2], hf[:, n // 2:]
    want = gate / (1 + np.exp(-gate)) * up
    np.testing.assert_allclose(np.asarray(act, np.float64), want, rtol=ACT_RTOL[dtype],
                               atol=ACT_RTOL[dtype] * 1e-2 * max(np.abs(want).max(), 1e-30))
    tail = int(np.clip(np.cumsum(np.maximum(sizes, 0)), 0, lhs.shape[0])[-1])
    assert not np.any(np.asarray(act, np.float32)[tail:]), "rows past sum(group_sizes) must be 0"


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_gradients_match_the_pieces(dtype):
    rng = np.random.default_rng()
    lhs, rhs, gs, _, _ = gemm_inputs(rng, "five_n_tiles_odd_m_tiles", dtype, False)
    n = rhs.shape[-1]
    c_h = jnp.asarray(rng.standard_normal((lhs.shape[0], n)), jnp.float32)
    c_act = jnp.asarray(rng.standard_normal((lhs.shape[0], n // 2)), jnp.float32)

    def fused(x, w):
        h, act = ops.grouped_gemm_swiglu(x, w, gs)
        return jnp.sum(h.astype(jnp.float32) * c_h) + jnp.sum(act.astype(jnp.float32) * c_act)

    def pieces(x, w):
        h = ops.grouped_gemm(x, w, gs).astype(jnp.float32)
        return jnp.sum(h * c_h) + jnp.sum(jax.nn.silu(h[:, :n // 2]) * h[:, n // 2:] * c_act)

    got = jax.jit(jax.grad(fused, (0, 1)))(lhs, rhs)
    want = jax.jit(jax.grad(pieces, (0, 1)))(lhs, rhs)
    for g, w in zip(got, want):
        assert rel_err(g, w) < TOL[dtype]


def test_scan_writes_h_into_its_stack_in_place():
    """h's only reader is the scan's stacked output: XLA's dynamic-slice fusion runs the FFI call with the stack slice
    as its h buffer (no copy of h), and act still reaches its reader."""
    rng = np.random.default_rng(0)
    L, M, K, F, G = 3, 1024, 128, 256, 8
    rows = jax.device_put(jnp.asarray(rng.standard_normal((M, K)), jnp.bfloat16), GPU)
    ws = jax.device_put(jnp.asarray(rng.standard_normal((L, G, K, 2 * F)) / 16, jnp.bfloat16), GPU)
    gs = jax.device_put(jnp.asarray([200, 0, 100, 300, 24, 0, 300, 50], jnp.int32), GPU)  # 974 of 1024 rows

    def body(total, w):
        h, act = ops.grouped_gemm_swiglu(rows, w, gs)
        return total + jnp.sum(act.astype(jnp.float32)), h

    fn = jax.jit(lambda w: jax.lax.scan(body, jnp.float32(0), w))
    total, hs = fn(ws)
    want = [ops.grouped_gemm_swiglu(rows, ws[i], gs) for i in range(L)]
    for i, (h, act) in enumerate(want):
        assert np.array_equal(np.asarray(hs[i], np.float32), np.asarray(h, np.float32)), i
    np.testing.assert_allclose(float(total), sum(float(jnp.sum(a.astype(jnp.float32))) for _, a in want), rtol=1e-5)
    text = fn.lower(ws).compile().as_text()
    fusions = re.findall(r"\n(%dynamic-slice-fusion[^\n]*\{\n(?:[^\n]*\n)*?\})", text)
    fused = [f for f in fusions if "turbo_moe_grouped_gemm_swiglu" in f]
    assert fused and any("dynamic-update-slice(" in f for f in fused), (
        "XLA no longer writes the FFI call's h into the scan's stack in place: " + text[:2000])


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
@pytest.mark.parametrize("case", EVEN_CASES)
def test_zero_tail_false_writes_the_group_rows_alone(case, dtype):
    """zero_tail=False (the expert block under EP): every group row equals the zero_tail=True call's bit for bit, in
    grouped_gemm, grouped_gemm_swiglu, permute and permute_rows (the rows past the groups are left unwritten: their
    content is whatever the buffer held, so nothing is asserted of them)."""
    rng = np.random.default_rng()
    lhs, rhs, gs, _, sizes = gemm_inputs(rng, case, dtype, False)
    rows = int(np.clip(np.cumsum(np.maximum(sizes, 0)), 0, lhs.shape[0])[-1])
    h, act = jax.jit(ops.grouped_gemm_swiglu)(lhs, rhs, gs)
    h_f, act_f = jax.jit(lambda a, b, s: ops.grouped_gemm_swiglu(a, b, s, zero_tail=False))(lhs, rhs, gs)
    assert np.array_equal(np.asarray(h_f[:rows], np.float32), np.asarray(h[:rows], np.float32))
    assert np.array_equal(np.asarray(act_f[:rows], np.float32), np.asarray(act[:rows], np.float32))
    out = jax.jit(ops.grouped_gemm)(lhs, rhs, gs)
    out_f = jax.jit(lambda a, b, s: ops.grouped_gemm(a, b, s, zero_tail=False))(lhs, rhs, gs)
    assert np.array_equal(np.asarray(out_f[:rows], np.float32), np.asarray(out[:rows], np.float32))
    from turbo_moe.ops.permute import _permute_call, permute_rows_call

    T, k, E = 96, 3, 5
    x = jnp.asarray(rng.normal(size=(T, 40)), dtype)
    ids = jnp.asarray(rng.integers(-3, E, size=(T, k)), jnp.int32)
    rows_z, g, ri = jax.jit(lambda x, i: _permute_call(x, i, E))(x, ids)
    rows_f, g_f, ri_f = jax.jit(lambda x, i: _permute_call(x, i, E, False))(x, ids)
    n = int(np.asarray(g).sum())
    assert np.array_equal(np.asarray(g_f), np.asarray(g)) and np.array_equal(np.asarray(ri_f), np.asarray(ri))
    assert np.array_equal(np.asarray(rows_f[:n], np.float32), np.asarray(rows_z[:n], np.float32))
    again = jax.jit(lambda x, r, g: permute_rows_call(x, r, g, False))(x, ri, g)
    assert np.array_equal(np.asarray(again[:n], np.float32), np.asarray(rows_z[:n], np.float32))
