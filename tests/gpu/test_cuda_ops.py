"""The CUDA handlers of turbo_moe.ops against float64 references, on fresh random inputs.

Skipped without a CUDA device. tests/conftest.py defaults JAX_PLATFORMS to cpu, so run these on a
GPU machine with the platform named:
    JAX_PLATFORMS=cuda,cpu python -m pytest tests/gpu -q
Errors are relative Frobenius norms ||out - ref|| / ||ref||; the reference sees the same
(rounded) inputs, so the bound covers accumulation and output rounding only.
"""
import numpy as np
import pytest

import jax
import jax.numpy as jnp

from tests import reference as ref

from tests.gpu import GPU, requires_gpu
from turbo_moe.shapes import REDUCED

pytestmark = requires_gpu

if GPU is not None:
    from turbo_moe import ops

TOL = {jnp.float32: 1e-5, jnp.bfloat16: 1e-2, jnp.float16: 2e-3}
DTYPES = [jnp.bfloat16, jnp.float16, jnp.float32]

# (M, K, N, group_sizes): the foundation issue's edge cases. K, N multiples of 8 take the Hopper
# kernel for bf16/f16; the others take the portable one.
GEMM_CASES = {
    "balanced": (512, 256, 384, [128, 128, 128, 128]),
    "empty_groups": (512, 128, 256, [0, 200, 0, 0, 312, 0]),
    "one_group": (512, 64, 128, [0, 0, 512, 0]),
    "odd_sizes": (1000, 200, 72, [137, 0, 401, 9, 453]),
    "not_multiple_of_8": (1000, 203, 77, [500, 0, 500]),
    "sum_below_m": (1000, 128, 64, [300, 0, 250, 150]),
    "negative_and_overflow": (1000, 96, 136, [-5, 600, 700, 3]),
    "many_small_groups": (4096, 128, 128, None),  # 256 random groups, some empty
    # more groups than the Hopper prologue's 256 threads scan at once, some empty, rows past them all
    "more_groups_than_a_block": (3000, 64, 64, 600),
    # odd counts of 256-wide N tiles take the cluster-free Hopper instance (grouped_gemm_sm90.cuh); the
    # last case has K = 512 (the `reduced` down product) and odd counts of 128-row M tiles
    "five_n_tiles": (3000, 136, 1280, [1000, 0, 1536, 464]),
    "three_n_tiles_skewed": (2048, 256, 640, [1990, 0, 50, 8]),
    "five_n_tiles_odd_m_tiles": (1500, 512, 1280, [300, 0, 1, 899, 300]),
}


def rel_err(out, expect):
    out, expect = np.asarray(out, np.float64), np.asarray(expect, np.float64)
    assert np.all(np.isfinite(out)), "non-finite values in the output"
    denom = np.linalg.norm(expect)
    return np.linalg.norm(out - expect) / (denom if denom > 0 else 1.0)


def random_sizes(rng, G, M, empty_fraction=0.25):
    p = rng.dirichlet(np.ones(G) * 2.0) * (rng.random(G) > empty_fraction)
    sizes = np.floor(p / max(p.sum(), 1e-9) * M).astype(np.int32)
    sizes[np.argmax(sizes)] += M - sizes.sum()
    return sizes


def device_put(*arrays):
    return [jax.device_put(a, GPU) for a in arrays]


def gemm_inputs(rng, case, dtype, transpose_rhs):
    M, K, N, sizes = GEMM_CASES[case]
    if sizes is None:
        sizes = random_sizes(rng, 256, M)
    elif isinstance(sizes, int):  # that many random groups over all rows but 200
        sizes = random_sizes(rng, sizes, M - 200)
    else:
        sizes = np.asarray(sizes, np.int32)
    G = len(sizes)
    lhs = jnp.asarray(rng.standard_normal((M, K)), dtype)
    rhs_shape = (G, N, K) if transpose_rhs else (G, K, N)
    rhs = jnp.asarray(rng.standard_normal(rhs_shape) / np.sqrt(K), dtype)
    d_out = jnp.asarray(rng.standard_normal((M, N)), dtype)
    return (*device_put(lhs, rhs, jnp.asarray(sizes), d_out), sizes)


@pytest.mark.parametrize("transpose_rhs", [False, True])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", list(GEMM_CASES))
def test_grouped_gemm_forward_and_grads(case, dtype, transpose_rhs):
    rng = np.random.default_rng()
    lhs, rhs, gs, d_out, sizes = gemm_inputs(rng, case, dtype, transpose_rhs)
    f = jax.jit(lambda a, b, g: ops.grouped_gemm(a, b, g, transpose_rhs=transpose_rhs))
    out, vjp = jax.vjp(lambda a, b: f(a, b, gs), lhs, rhs)
    d_lhs, d_rhs = vjp(d_out)
    assert out.dtype == dtype and out.devices() == {GPU}

    M = lhs.shape[0]
    bounds = ref.group_bounds(sizes, M)
    expect = ref.grouped_gemm(lhs.astype(jnp.float32), rhs.astype(jnp.float32), sizes, transpose_rhs)
    assert rel_err(out, expect) < TOL[dtype]
    assert np.all(np.asarray(out[bounds[-1]:], np.float32) == 0), "rows past sum(group_sizes) must be 0"

    rhs_kn = np.asarray(rhs, np.float64).transpose(0, 2, 1) if transpose_rhs else np.asarray(rhs, np.float64)
    expect_d_lhs = ref.grouped_gemm(np.asarray(d_out, np.float64), rhs_kn, sizes, transpose_rhs=True)
    assert rel_err(d_lhs, expect_d_lhs) < TOL[dtype]
    expect_d_rhs = ref.weight_grad(np.asarray(lhs, np.float64), np.asarray(d_out, np.float64), sizes)
    if transpose_rhs:
        expect_d_rhs = expect_d_rhs.transpose(0, 2, 1)
    assert rel_err(d_rhs, expect_d_rhs) < TOL[dtype]
    empty = np.diff(bounds) == 0
    assert np.all(np.asarray(d_rhs, np.float32)[empty] == 0), "empty groups must get zero weight grads"


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_weight_grad_is_deterministic(dtype):
    rng = np.random.default_rng()
    M, K, N = 8192, 256, 512
    sizes = random_sizes(rng, 16, M)
    lhs, d_out, gs = device_put(jnp.asarray(rng.standard_normal((M, K)), dtype),
                                jnp.asarray(rng.standard_normal((M, N)), dtype), jnp.asarray(sizes))
    f = jax.jit(ops.grouped_gemm_weight_grad)
    first = np.asarray(f(lhs, d_out, gs), np.float32)
    for _ in range(3):
        assert np.array_equal(np.asarray(f(lhs, d_out, gs), np.float32), first)


def test_weight_grad_odd_group_sizes_bf16():
    """The Hopper weight-grad kernel on groups of 1 and 3 rows, empty groups, partial tiles."""
    rng = np.random.default_rng()
    M, K, N = 3000, 136, 264
    sizes = np.array([0, 1, 700, 0, 1299, 1000, 0, 3], np.int32)
    lhs, d_out, gs = device_put(jnp.asarray(rng.standard_normal((M, K)), jnp.bfloat16),
                                jnp.asarray(rng.standard_normal((M, N)), jnp.bfloat16), jnp.asarray(sizes))
    dw = jax.jit(ops.grouped_gemm_weight_grad)(lhs, d_out, gs)
    expect = ref.weight_grad(lhs.astype(jnp.float32), d_out.astype(jnp.float32), sizes)
    assert rel_err(dw, expect) < 1e-2
    assert np.all(np.asarray(dw, np.float32)[sizes == 0] == 0)


def test_large_m_bf16():
    rng = np.random.default_rng()
    M, K, N, G = 131072, 256, 128, 64
    sizes = random_sizes(rng, G, M)
    lhs, rhs, gs, d_out = device_put(jnp.asarray(rng.standard_normal((M, K)), jnp.bfloat16),
                                     jnp.asarray(rng.standard_normal((G, K, N)) / 16, jnp.bfloat16),
                                     jnp.asarray(sizes), jnp.asarray(rng.standard_normal((M, N)), jnp.bfloat16))
    out = jax.jit(ops.grouped_gemm)(lhs, rhs, gs)
    assert rel_err(out, ref.grouped_gemm(lhs.astype(jnp.float32), rhs.astype(jnp.float32), sizes)) < 1e-2
    dw = jax.jit(ops.grouped_gemm_weight_grad)(lhs, d_out, gs)
    assert rel_err(dw, ref.weight_grad(lhs.astype(jnp.float32), d_out.astype(jnp.float32), sizes)) < 1e-2


def test_grouped_gemm_and_weight_grad_vmap_match_loop():
    rng = np.random.default_rng()
    B, M, K, N, G = 3, 384, 64, 96, 5
    lhs = jnp.asarray(rng.standard_normal((B, M, K)), jnp.bfloat16)
    rhs = jnp.asarray(rng.standard_normal((B, G, K, N)) / 8, jnp.bfloat16)
    sizes = np.stack([random_sizes(rng, G, M - 50) for _ in range(B)])
    sizes[:, 2] = 0  # an empty group in every batch element: its weight gradient must be zeros
    d_out = jnp.asarray(rng.standard_normal((B, M, N)), jnp.bfloat16)
    lhs, rhs, sizes, d_out = device_put(lhs, rhs, jnp.asarray(sizes), d_out)
    batched = jax.jit(jax.vmap(ops.grouped_gemm))(lhs, rhs, sizes)
    dw = jax.jit(jax.vmap(ops.grouped_gemm_weight_grad))(lhs, d_out, sizes)
    for b in range(B):
        expect = ref.grouped_gemm(lhs[b].astype(jnp.float32), rhs[b].astype(jnp.float32), np.asarray(sizes[b]))
        assert rel_err(batched[b], expect) < 1e-2
        tail = int(np.asarray(sizes[b]).sum())
        assert np.all(np.asarray(batched[b, tail:], np.float32) == 0), "rows past the groups must be 0"
        expect_dw = ref.weight_grad(lhs[b].astype(jnp.float32), d_out[b].astype(jnp.float32), np.asarray(sizes[b]))
        assert rel_err(dw[b], expect_dw) < 1e-2
        assert np.all(np.asarray(dw[b, 2], np.float32) == 0)


def random_ids(rng, T, k, E, dropped_fraction=0.05):
    ids = rng.integers(0, E, size=(T, k)).astype(np.int32)
    drop = rng.random((T, k)) < dropped_fraction
    ids[drop] = rng.choice(np.array([-1, E, E + 7], np.int32), size=int(drop.sum()))
    return ids


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("T,H,k,E", [(1000, 72, 4, 8), (333, 2048, 2, 3), (65536, 128, 8, 256), (50, 7, 3, 64)])
def test_permute_unpermute_and_grads(T, H, k, E, dtype):
    rng = np.random.default_rng()
    ids = random_ids(rng, T, k, E)
    x, expert_ids, weights, d_y_sorted = device_put(
        jnp.asarray(rng.standard_normal((T, H)), dtype), jnp.asarray(ids),
        jnp.asarray(rng.random((T, k)), jnp.float32), jnp.asarray(rng.standard_normal((T, H)), dtype))
    x_sorted, sizes, handle = jax.jit(ops.permute, static_argnums=2)(x, expert_ids, E)
    expect_x, expect_sizes, expect_rows = ref.permute(np.asarray(x, np.float64), ids, E)
    assert np.array_equal(np.asarray(sizes), expect_sizes)
    assert np.array_equal(np.asarray(handle.row_index), expect_rows)
    assert np.array_equal(np.asarray(x_sorted, np.float64), expect_x), "permute must copy rows exactly"

    y_sorted = x_sorted * 2 + 1  # any rows; the dropped rows stay nonzero: unpermute must skip them
    out, vjp = jax.vjp(lambda y, w: ops.unpermute(y, handle, w), y_sorted, weights)
    expect = ref.unpermute(np.asarray(y_sorted, np.float64), expect_rows, np.asarray(weights))
    assert rel_err(out, expect) < TOL[dtype]
    d_y, d_w = vjp(d_y_sorted)
    expect_d_y, expect_d_w = ref.unpermute_bwd(np.asarray(d_y_sorted, np.float64), np.asarray(y_sorted, np.float64),
                                               expect_rows, np.asarray(weights))
    assert rel_err(d_y, expect_d_y) < TOL[dtype]
    assert rel_err(d_w, expect_d_w) < max(TOL[dtype], 1e-5)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("T,H,k,E", [(1000, 72, 4, 8), (333, 2048, 2, 3),
                                     (16384, REDUCED.d_model, REDUCED.top_k, REDUCED.n_experts), (50, 7, 3, 64)])
def test_permute_rows_equals_permute_and_cpu(T, H, k, E, dtype):
    rng = np.random.default_rng()
    ids = random_ids(rng, T, k, E)
    x, other, expert_ids = device_put(jnp.asarray(rng.standard_normal((T, H)), dtype),
                                      jnp.asarray(rng.standard_normal((T, H)), dtype), jnp.asarray(ids))
    _, sizes, handle = jax.jit(ops.permute, static_argnums=2)(x, expert_ids, E)
    want, _, _ = jax.jit(ops.permute, static_argnums=2)(other, expert_ids, E)
    got = jax.jit(ops.permute_rows)(other, handle, sizes)
    assert np.array_equal(np.asarray(got, np.float64), np.asarray(want, np.float64))
    cpu = jax.devices("cpu")[0]
    on_cpu = jax.jit(ops.permute_rows)(*(jax.device_put(a, cpu) for a in (other, handle, sizes)))
    assert np.array_equal(np.asarray(on_cpu, np.float64), np.asarray(got, np.float64))


def test_permute_vmap_matches_loop():
    rng = np.random.default_rng()
    B, T, H, k, E = 2, 300, 64, 2, 16
    ids = np.stack([random_ids(rng, T, k, E) for _ in range(B)])
    x, expert_ids = device_put(jnp.asarray(rng.standard_normal((B, T, H)), jnp.float32), jnp.asarray(ids))
    xs, sizes, handle = jax.jit(jax.vmap(lambda a, i: ops.permute(a, i, E)))(x, expert_ids)
    for b in range(B):
        ex, es, er = ref.permute(np.asarray(x[b]), ids[b], E)
        assert np.array_equal(np.asarray(sizes[b]), es) and np.array_equal(np.asarray(handle.row_index[b]), er)
        assert np.array_equal(np.asarray(xs[b], np.float64), ex)


def test_cuda_handlers_are_registered():
    assert "CUDA" in ops.ensure_registered()
