"""The ragged_dot drop-in cases of tests/ops/test_ragged_dot_compat.py on the GPU, at shapes that take the Hopper
(bf16/f16, K and N multiples of 8) and the portable kernels: dtype rules (fp8 upcast, int8 -> int32 through XLA),
group_offset shards with their gradients, forward-mode and second-order autodiff, vmap and ragged_dot_general."""
import numpy as np
import pytest

import jax
import jax.numpy as jnp
from jax.test_util import check_grads

from tests.gpu import GPU, requires_gpu
from tests.ops.test_ragged_dot_compat import (GENERAL_CASES, RAGGED_K, TOL, bounds, dense_equivalent, jax_group_sizes,
                                              operands, ref_contracting, ref_rows, rel_err, skewed_sizes)

pytestmark = requires_gpu

if GPU is not None:
    from turbo_moe import ops

# (M, K, N, G): Hopper-eligible for bf16/f16 (K, N multiples of 8), then odd sizes (portable kernel)
SHAPES = [(1024, 256, 384, 8), (777, 203, 77, 5)]


def on_gpu(*xs):
    return tuple(jax.device_put(x, GPU) for x in xs)


def on_cpu(*xs):
    return tuple(jax.device_put(x, jax.devices("cpu")[0]) for x in xs)


@pytest.mark.parametrize("routing", ["random", "skewed"])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16, jnp.float32, jnp.float8_e4m3fn, jnp.float8_e5m2],
                         ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_forward_and_gradients_against_float64(shape, dtype, routing):
    m, k, n, g = shape
    r = np.random.default_rng()
    lhs, rhs = operands(r, m, k, n, g, dtype)
    sizes = jax_group_sizes(r, m - 13, g) if routing == "random" else skewed_sizes(r, m, g)
    lhs, rhs, gs = on_gpu(lhs, rhs, jnp.asarray(sizes))
    out = jax.jit(ops.grouped_gemm)(lhs, rhs, gs)
    assert out.devices() == {GPU} and out.dtype == jnp.dtype(dtype)
    a, w = lhs.astype(jnp.float32), rhs.astype(jnp.float32)
    assert rel_err(out, ref_rows(a, w, sizes)) < TOL[jnp.dtype(dtype)]
    if jnp.dtype(dtype).itemsize == 1:
        return
    cot = jnp.asarray(r.standard_normal((m, n)), dtype)
    d_lhs, d_rhs = jax.jit(lambda a, b, c: jax.vjp(lambda x, y: ops.grouped_gemm(x, y, gs), a, b)[1](c))(lhs, rhs, cot)
    b_ = bounds(sizes, m)
    c, wf = np.asarray(cot.astype(jnp.float32), np.float64), np.asarray(w, np.float64)
    want_lhs = np.zeros((m, k))
    for i in range(g):
        want_lhs[b_[i]:b_[i + 1]] = c[b_[i]:b_[i + 1]] @ wf[i].T
    assert rel_err(d_lhs, want_lhs) < TOL[jnp.dtype(dtype)]
    assert rel_err(d_rhs, ref_contracting(a, c, sizes)) < TOL[jnp.dtype(dtype)]


@pytest.mark.parametrize("preferred", [None, jnp.float32])
@pytest.mark.parametrize("pair", [(jnp.bfloat16, jnp.float16), (jnp.float8_e4m3fn, jnp.bfloat16),
                                  (jnp.int8, jnp.int8)], ids=str)
def test_dtype_rules_are_ragged_dots(pair, preferred):
    m, k, n, g = 512, 128, 64, 4
    r = np.random.default_rng()
    lhs, rhs, gs = on_gpu(jnp.asarray(r.integers(-8, 8, (m, k)), pair[0]),
                          jnp.asarray(r.integers(-8, 8, (g, k, n)), pair[1]), jnp.asarray(jax_group_sizes(r, m, g)))
    pet = jnp.int32 if pair[0] == jnp.int8 else preferred
    out = jax.jit(ops.grouped_gemm, static_argnums=(3, 4))(lhs, rhs, gs, None, pet)
    want = jax.lax.ragged_dot(lhs, rhs, gs, preferred_element_type=pet)
    assert out.dtype == want.dtype and out.devices() == {GPU}
    ref = ref_rows(lhs.astype(jnp.float32), rhs.astype(jnp.float32), np.asarray(gs))
    np.testing.assert_array_equal(np.asarray(out.astype(jnp.float32), np.float64),
                                  np.asarray(jnp.asarray(ref, jnp.float32).astype(out.dtype).astype(jnp.float32)))


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_group_offset_shards_add_up_to_the_whole(dtype):
    m, k, n, g, stride = 1024, 128, 256, 8, 2
    r = np.random.default_rng()
    lhs, rhs = operands(r, m, k, n, g, dtype)
    sizes = jax_group_sizes(r, m - 40, g)
    lhs, rhs, gs = on_gpu(lhs, rhs, jnp.asarray(sizes))
    cot = jax.device_put(jnp.asarray(r.standard_normal((m, n)), jnp.float32), GPU)

    @jax.jit
    def shard(a, b, o, c):
        out, vjp = jax.vjp(lambda x, y: ops.grouped_gemm(x, y, gs, None, jnp.float32, o), a, b)
        return (out, *vjp(c))
    parts = [shard(lhs, rhs[o:o + stride], jnp.array(o), cot) for o in range(0, g, stride)]
    a, w = lhs.astype(jnp.float32), rhs.astype(jnp.float32)
    tol = TOL[jnp.dtype(dtype)]
    assert rel_err(sum(p[0] for p in parts), ref_rows(a, w, sizes)) < tol
    # On the CPU: ragged_dot's float32 default on the GPU is TF32, coarser than the tolerance.
    want_lhs, want_rhs = jax.vjp(lambda x, y, s: jax.lax.ragged_dot(x, y, s, preferred_element_type=jnp.float32),
                                 *on_cpu(a, w, gs))[1](*on_cpu(cot))[:2]
    assert rel_err(sum(p[1].astype(jnp.float32) for p in parts), want_lhs) < tol
    assert rel_err(jnp.concatenate([p[2] for p in parts]).astype(jnp.float32), want_rhs) < tol


def test_second_order_autodiff_and_vmap():
    m, k, n, g = 40, 16, 8, 4
    r = np.random.default_rng()
    lhs, rhs = on_gpu(*operands(r, m, k, n, g, jnp.float32))
    sizes = jnp.asarray(jax_group_sizes(r, m - 3, g))
    check_grads(lambda a, b: jnp.sin(ops.grouped_gemm(a, b, sizes)), (lhs, rhs), order=2, modes=("fwd", "rev"),
                atol=2e-2, rtol=2e-2, eps=3e-3)
    check_grads(lambda a, d: jnp.sin(ops.ragged_dot_general(a, d, sizes, RAGGED_K)), (lhs, lhs), order=2,
                modes=("fwd", "rev"), atol=2e-2, rtol=2e-2, eps=3e-3)
    dense = dense_equivalent(sizes, m)

    def loss(f):
        return lambda a, b: jnp.sum(jnp.tanh(f(a, b)) ** 2)
    for x, y in zip(jax.tree.leaves(jax.hessian(loss(lambda a, b: ops.grouped_gemm(a, b, sizes)))(lhs, rhs)),
                    jax.tree.leaves(jax.hessian(loss(dense))(lhs, rhs))):
        assert rel_err(x, y) < 1e-4
    batch = jnp.stack([lhs, 2 * lhs])
    out = jax.vmap(lambda a: ops.grouped_gemm(a, rhs, sizes))(batch)
    assert rel_err(out[1], 2 * ops.grouped_gemm(lhs, rhs, sizes)) < 1e-6


@pytest.mark.parametrize("case", list(GENERAL_CASES))
def test_ragged_dot_general_matches_jax(case):
    lhs_shape, rhs_shape, gs_shape, dims = GENERAL_CASES[case]
    r = np.random.default_rng()
    lhs = jnp.asarray(r.standard_normal(lhs_shape), jnp.float32)
    rhs = jnp.asarray(r.standard_normal(rhs_shape), jnp.float32)
    ragged = lhs_shape[dims.lhs_ragged_dimensions[0]]
    sizes = jnp.asarray(np.stack([jax_group_sizes(r, ragged, gs_shape[-1])
                                  for _ in range(int(np.prod(gs_shape[:-1])))]).reshape(gs_shape))
    lhs, rhs, sizes = on_gpu(lhs, rhs, sizes)
    out = jax.jit(ops.ragged_dot_general, static_argnums=3)(lhs, rhs, sizes, dims)
    # The reference runs on the CPU: XLA's GPU ragged_dot rewriter rejects the shared-sizes batch case
    # ("A dimension number is not unique in Dot").
    want = jax.lax.ragged_dot_general(*on_cpu(lhs, rhs, sizes), dims, precision="highest")
    assert out.shape == want.shape and out.devices() == {GPU}
    assert rel_err(out, want) < 1e-5
