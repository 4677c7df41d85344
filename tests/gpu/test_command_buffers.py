"""The grouped GEMM and permute handlers with their workspace as a result, on the GPU.

They take their workspace as an extra uint8 result (sized by the CUDA library through ctypes) instead of XLA
scratch, and are marked command-buffer compatible, so XLA may record them into the CUDA graphs it replays
(XLA forms those from its thunks, after the HLO: the compiled HLO text does not show them). These tests check
that the handlers inside a scanned loop, where XLA wraps them with the loop's dynamic slices, compute what a
float64 reference does (every iteration's group sizes are new device data, one iteration's groups all empty
but one), and that a workspace too small is refused by name.
"""
import numpy as np
import pytest

import jax
import jax.numpy as jnp

from tests import reference as ref
from tests.gpu import GPU, requires_gpu

pytestmark = requires_gpu

if GPU is not None:
    from turbo_moe import ops


def _expert_layer(x, w_up, w_down, expert_ids, E):
    xs, sizes, handle = ops.permute(x, expert_ids, E)
    h = jax.nn.silu(ops.grouped_gemm(xs, w_up, sizes))
    y = ops.grouped_gemm(h, w_down, sizes, transpose_rhs=True)
    return ops.unpermute(y, handle, jnp.ones(expert_ids.shape, jnp.float32))


def _inputs(rng, layers=4, T=512, D=128, F=256, E=8, k=2):
    x = jnp.asarray(rng.standard_normal((T, D)), jnp.bfloat16)
    w_up = jnp.asarray(rng.standard_normal((layers, E, D, F)) / 16, jnp.bfloat16)
    w_down = jnp.asarray(rng.standard_normal((layers, E, D, F)) / 16, jnp.bfloat16)  # (E, N=D, K=F): transposed
    ids = np.stack([rng.integers(0, E, (T, k)) for _ in range(layers)]).astype(np.int32)
    ids[1, :, :] = 3  # one layer sends every copy to one expert: the others' groups are empty
    return x, w_up, w_down, jnp.asarray(ids), E


def _stack(x, w_up, w_down, ids, E):
    def body(h, layer):
        wu, wd, i = layer
        return h + _expert_layer(h, wu, wd, i, E).astype(h.dtype), None
    return jax.lax.scan(body, x, (w_up, w_down, ids))[0]


def test_replayed_loop_matches_the_reference():
    x, w_up, w_down, ids, E = _inputs(np.random.default_rng(1))
    got = np.asarray(jax.jit(_stack, static_argnums=4)(x, w_up, w_down, ids, E), np.float64)
    h = np.asarray(x, np.float64)
    for layer in range(ids.shape[0]):
        hb = jnp.asarray(h, jnp.bfloat16)
        xs, sizes, rows = ref.permute(np.asarray(hb, np.float64), np.asarray(ids[layer]), E)
        up = ref.grouped_gemm(xs, np.asarray(w_up[layer], np.float64), sizes)
        act = np.asarray(jax.nn.silu(jnp.asarray(up, jnp.float32).astype(jnp.bfloat16)), np.float64)
        down = ref.grouped_gemm(act, np.asarray(w_down[layer], np.float64), sizes, transpose_rhs=True)
        y = ref.unpermute(down, rows, np.ones(ids.shape[1:], np.float64))
        h = np.asarray(jnp.asarray(hb, jnp.float32) + jnp.asarray(y, jnp.float32).astype(jnp.bfloat16), np.float64)
    err = np.linalg.norm(got - h) / np.linalg.norm(h)
    assert err < 2e-2, f"relative error {err:.2e} of the scanned expert layers against the float64 reference"


def test_too_small_workspace_is_refused_by_name():
    M, K, N, G = 256, 64, 64, 4
    lhs, rhs = jnp.ones((M, K), jnp.bfloat16), jnp.ones((G, K, N), jnp.bfloat16)
    sizes = jnp.full((G,), M // G, jnp.int32)
    tiny = jax.ShapeDtypeStruct((8,), jnp.uint8)
    call = jax.ffi.ffi_call("turbo_moe_grouped_gemm", (jax.ShapeDtypeStruct((M, N), jnp.bfloat16), tiny))
    with pytest.raises(Exception, match=r"grouped_gemm: workspace of 8 bytes, this call needs \d+"):
        jax.block_until_ready(jax.jit(lambda a, b, s: call(a, b, s, transpose_rhs=False, zero_tail=True))(
            lhs, rhs, sizes))
    x, ids = jnp.ones((M, K), jnp.bfloat16), jnp.zeros((M, 2), jnp.int32)
    out = (jax.ShapeDtypeStruct((2 * M, K), jnp.bfloat16), jax.ShapeDtypeStruct((G,), jnp.int32),
           jax.ShapeDtypeStruct((M, 2), jnp.int32), tiny)
    with pytest.raises(Exception, match=r"permute: workspace of 8 bytes, this call needs \d+"):
        jax.block_until_ready(jax.jit(lambda a, i: jax.ffi.ffi_call("turbo_moe_permute", out)(
            a, i, num_experts=G, zero_tail=True))(x, ids))
