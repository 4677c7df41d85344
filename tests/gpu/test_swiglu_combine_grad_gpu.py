"""swiglu_combine_grad on the GPU: against float64 and the CPU handler (the 16-byte and the scalar kernels), act * w
bit for bit the CUDA forward kernel's act times w, and deterministic (d_w is a fixed-order warp reduction)."""
import numpy as np
import pytest

import jax
import jax.numpy as jnp

from tests.gpu import GPU, requires_gpu
from tests.ops.test_swiglu_combine_grad import _float64, _inputs, act_times_w, forward_act

pytestmark = requires_gpu

if GPU is not None:
    from turbo_moe import ops


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16, jnp.float32])
@pytest.mark.parametrize("rows,F", [(4099, 512), (1000, 36), (33, 2048), (7, 1)])
def test_matches_float64_and_cpu(rows, F, dtype):
    h, g, w = _inputs(rows * F, rows, F, dtype)
    w = w.at[::5].set(0.0)
    d_h, d_w, act_w = jax.jit(ops.swiglu_combine_grad)(*(jax.device_put(a, GPU) for a in (h, g, w)))
    assert d_h.devices() == {GPU}
    want_h, want_w, want_aw = _float64(h, g, w)
    tol = {jnp.float32: 1e-5, jnp.bfloat16: 2e-2, jnp.float16: 4e-3}[dtype]
    np.testing.assert_allclose(np.asarray(d_w, np.float64), want_w, rtol=1e-5, atol=1e-5 * np.abs(want_w).max())
    np.testing.assert_allclose(np.asarray(d_h, np.float64), want_h, rtol=tol, atol=tol * np.abs(want_h).max())
    np.testing.assert_allclose(np.asarray(act_w, np.float64), want_aw, rtol=2 * tol, atol=tol * np.abs(want_aw).max())
    fwd_act = jax.jit(forward_act)(jax.device_put(h, GPU))  # the CUDA forward kernel's act (h @ I is exact)
    want_exact = jax.jit(act_times_w)(fwd_act, jax.device_put(w, GPU))
    np.testing.assert_array_equal(np.asarray(act_w, np.float32), np.asarray(want_exact, np.float32))
    cpu = jax.devices("cpu")[0]
    c_h, c_w, c_aw = jax.jit(ops.swiglu_combine_grad)(*(jax.device_put(a, cpu) for a in (h, g, w)))
    # one ulp of the dtype apart at most (exp differs by an ulp between the libraries), sums to float32 rounding
    ulp = {jnp.float32: 1e-6, jnp.bfloat16: 8e-3, jnp.float16: 1e-3}[dtype]
    np.testing.assert_allclose(np.asarray(d_h, np.float64), np.asarray(c_h, np.float64), rtol=ulp,
                               atol=ulp * np.abs(want_h).max() * 1e-2)
    np.testing.assert_allclose(np.asarray(d_w), np.asarray(c_w), rtol=1e-5, atol=1e-5 * np.abs(want_w).max())
    np.testing.assert_allclose(np.asarray(act_w, np.float64), np.asarray(c_aw, np.float64), rtol=ulp,
                               atol=ulp * np.abs(want_aw).max() * 1e-2)
    again = jax.jit(ops.swiglu_combine_grad)(*(jax.device_put(a, GPU) for a in (h, g, w)))
    assert np.array_equal(np.asarray(again[1]), np.asarray(d_w)), "d_w must be deterministic"


def test_valid_rows_match_the_full_call_below_the_count():
    """valid_rows (the expert block's worst-case EP tail): rows below the count equal the full call's bit for bit."""
    rng = np.random.default_rng()
    h = jnp.asarray(rng.standard_normal((2, 300, 256)) * 3, jnp.bfloat16)
    g = jnp.asarray(rng.standard_normal((2, 300, 128)), jnp.bfloat16)
    w = jnp.asarray(rng.random((2, 300)), jnp.float32)
    full = jax.jit(ops.swiglu_combine_grad)(h, g, w)
    part = jax.jit(ops.swiglu_combine_grad)(h, g, w, jnp.asarray([300, 37], jnp.int32))
    for a, b in zip(part, full):
        assert np.array_equal(np.asarray(a[0], np.float32), np.asarray(b[0], np.float32))
        assert np.array_equal(np.asarray(a[1, :37], np.float32), np.asarray(b[1, :37], np.float32))
