"""swiglu_combine_grad on the GPU: against float64 and the CPU handler (the 16-byte and the scalar kernels), and
deterministic (d_w is a fixed-order warp reduction)."""
import numpy as np
import pytest

import jax
import jax.numpy as jnp

from tests.gpu import GPU, requires_gpu
from tests.ops.test_swiglu_combine_grad import _float64, _inputs

pytestmark = requires_gpu

if GPU is not None:
    from turbo_moe import ops


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16, jnp.float32])
@pytest.mark.parametrize("rows,F", [(4099, 512), (1000, 36), (33, 2048), (7, 1)])
def test_matches_float64_and_cpu(rows, F, dtype):
    h, g, w = _inputs(rows * F, rows, F, dtype)
    w = w.at[::5].set(0.0)
    d_h, d_w = jax.jit(ops.swiglu_combine_grad)(*(jax.device_put(a, GPU) for a in (h, g, w)))
    assert d_h.devices() == {GPU}
    want_h, want_w = _float64(h, g, w)
    tol = {jnp.float32: 1e-5, jnp.bfloat16: 2e-2, jnp.float16: 4e-3}[dtype]
    np.testing.assert_allclose(np.asarray(d_w, np.float64), want_w, rtol=1e-5, atol=1e-5 * np.abs(want_w).max())
    np.testing.assert_allclose(np.asarray(d_h, np.float64), want_h, rtol=tol, atol=tol * np.abs(want_h).max())
    cpu = jax.devices("cpu")[0]
    c_h, c_w = jax.jit(ops.swiglu_combine_grad)(*(jax.device_put(a, cpu) for a in (h, g, w)))
    # one ulp of the dtype apart at most (exp differs by an ulp between the libraries), sums to float32 rounding
    ulp = {jnp.float32: 1e-6, jnp.bfloat16: 8e-3, jnp.float16: 1e-3}[dtype]
    np.testing.assert_allclose(np.asarray(d_h, np.float64), np.asarray(c_h, np.float64), rtol=ulp,
                               atol=ulp * np.abs(want_h).max() * 1e-2)
    np.testing.assert_allclose(np.asarray(d_w), np.asarray(c_w), rtol=1e-5, atol=1e-5 * np.abs(want_w).max())
    again = jax.jit(ops.swiglu_combine_grad)(*(jax.device_put(a, GPU) for a in (h, g, w)))
    assert np.array_equal(np.asarray(again[1]), np.asarray(d_w)), "d_w must be deterministic"
