"""A small run of every CUDA handler with empty groups, for `compute-sanitizer --tool memcheck`.

    JAX_PLATFORMS=cuda,cpu XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONPATH=$PWD \
        compute-sanitizer --tool memcheck --error-exitcode 1 python tests/gpu/sanitizer_case.py
Prints one line per op with its max abs error against a float64 reference.
"""
import numpy as np

import jax
import jax.numpy as jnp

from tests import reference as ref
from turbo_moe import ops


def main():
    rng = np.random.default_rng(0)
    gpu = jax.devices("gpu")[0]
    M, K = 300, 64
    sizes = np.array([0, 120, 0, 0, 100, 0, 30], np.int32)  # empty groups; sum < M
    # the Hopper kernel's cluster-free (N = 72: one N tile) and clustered (N = 512: two) instances, and
    # the portable kernel
    for dtype, N in ((jnp.bfloat16, 72), (jnp.bfloat16, 512), (jnp.float32, 72)):
        lhs = jax.device_put(jnp.asarray(rng.standard_normal((M, K)), dtype), gpu)
        rhs = jax.device_put(jnp.asarray(rng.standard_normal((len(sizes), K, N)) / 8, dtype), gpu)
        d_out = jax.device_put(jnp.asarray(rng.standard_normal((M, N)), dtype), gpu)
        gs = jax.device_put(jnp.asarray(sizes), gpu)
        out = ops.grouped_gemm(lhs, rhs, gs)
        dgrad = ops.grouped_gemm(d_out, rhs, gs, transpose_rhs=True)
        wgrad = ops.grouped_gemm_weight_grad(lhs, d_out, gs)
        f32 = lambda a: np.asarray(a, np.float64)
        e1 = np.abs(f32(out) - ref.grouped_gemm(f32(lhs), f32(rhs), sizes)).max()
        e2 = np.abs(f32(dgrad) - ref.grouped_gemm(f32(d_out), f32(rhs), sizes, transpose_rhs=True)).max()
        e3 = np.abs(f32(wgrad) - ref.weight_grad(f32(lhs), f32(d_out), sizes)).max()
        print(f"grouped_gemm {jnp.dtype(dtype).name} N={N}: fwd {e1:.3g} dgrad {e2:.3g} wgrad {e3:.3g}", flush=True)
        h, act = ops.grouped_gemm_swiglu(lhs, rhs, gs)  # N = 72: F = 36, the scalar SwiGLU; N = 512 the vectors
        g, u = f32(h)[:, :N // 2], f32(h)[:, N // 2:]
        e4 = np.abs(f32(act) - g / (1 + np.exp(-g)) * u).max()
        print(f"grouped_gemm_swiglu {jnp.dtype(dtype).name} N={N}: h {np.abs(f32(h) - f32(out)).max():.3g} "
              f"act {e4:.3g}", flush=True)
        h_f, act_f = ops.grouped_gemm_swiglu(lhs, rhs, gs, zero_tail=False)  # the expert block's: tail unwritten
        dgrad_f = ops.grouped_gemm(d_out, rhs, gs, transpose_rhs=True, zero_tail=False)
        rows = int(np.clip(np.cumsum(np.maximum(sizes, 0)), 0, M)[-1])
        same = all(np.array_equal(f32(a)[:rows], f32(b)[:rows]) for a, b in ((h_f, h), (act_f, act), (dgrad_f, dgrad)))
        print(f"zero_tail=False {jnp.dtype(dtype).name} N={N}: group rows equal {same}", flush=True)
        w_rows = jax.device_put(jnp.asarray(rng.random(M), jnp.float32), gpu)
        d_h, d_w, act_w = ops.swiglu_combine_grad(h, act, w_rows)  # act as the cotangent: any (M, F) of h's dtype
        print(f"swiglu_combine_grad {jnp.dtype(dtype).name} F={N // 2}: d_w finite {bool(np.isfinite(f32(d_w)).all())}"
              f" d_h finite {bool(np.isfinite(f32(d_h)).all())} act_w finite {bool(np.isfinite(f32(act_w)).all())}",
              flush=True)

    T, H, k, E = 200, 40, 3, 8
    ids = rng.integers(0, E - 3, size=(T, k)).astype(np.int32)  # experts 5..7 stay empty
    ids[0, 0], ids[1, 2] = -1, E  # dropped copies
    x = jax.device_put(jnp.asarray(rng.standard_normal((T, H)), jnp.bfloat16), gpu)
    w = jax.device_put(jnp.asarray(rng.random((T, k)), jnp.float32), gpu)
    x_sorted, group_sizes, handle = ops.permute(x, jnp.asarray(ids), E)
    y, vjp = jax.vjp(lambda a, b: ops.unpermute(a, handle, b), x_sorted, w)
    d_y, d_w = vjp(jnp.ones_like(y))
    ex, es, er = ref.permute(np.asarray(x, np.float64), ids, E)
    print("permute exact:", np.array_equal(np.asarray(x_sorted, np.float64), ex)
          and np.array_equal(np.asarray(group_sizes), es) and np.array_equal(np.asarray(handle.row_index), er))
    print("unpermute max err:", float(np.abs(np.asarray(y, np.float64) - ref.unpermute(ex, er, np.asarray(w))).max()),
          "bwd finite:", bool(np.isfinite(np.asarray(d_y, np.float32)).all() and np.isfinite(np.asarray(d_w)).all()))
    other = jax.device_put(jnp.asarray(rng.standard_normal((T, H)), jnp.bfloat16), gpu)
    rows = ops.permute_rows(other, handle, group_sizes)  # the copy step again; the dropped copies' tail rows zeroed
    expect_rows = ref.permute(np.asarray(other, np.float64), ids, E)[0]
    print("permute_rows exact:", np.array_equal(np.asarray(rows, np.float64), expect_rows))

    # quantize_group_columns: empty groups, sum < M, C not a multiple of the 64-column blocks
    xq = jnp.asarray(rng.standard_normal((M, 70)), jnp.bfloat16)
    got = [jax.device_get(ops.quantize_group_columns(jax.device_put(xq, dev), jax.device_put(jnp.asarray(sizes), dev)))
           for dev in (gpu, jax.devices("cpu")[0])]
    print("quantize_group_columns equals the CPU handler:",
          all(np.array_equal(np.asarray(a).view(np.uint8), np.asarray(b).view(np.uint8)) for a, b in zip(*got)))

    # grouped_gemm_fp8 (Hopper): empty groups, sum < M, N = 384 (the 128x256 forward tile's second N tile half
    # outside the matrix), K = 256; forward, data and weight gradients through the op's VJP
    if jax.devices("gpu")[0].compute_capability.startswith("9"):
        x8 = jax.device_put(jnp.asarray(rng.standard_normal((M, 256)), jnp.bfloat16), gpu)
        w8 = jax.device_put(jnp.asarray(rng.standard_normal((len(sizes), 256, 384)) / 16, jnp.bfloat16), gpu)
        gs8 = jax.device_put(jnp.asarray(sizes), gpu)
        y8, vjp8 = jax.vjp(lambda a, b: ops.grouped_gemm_fp8(a, b, gs8), x8, w8)
        dx8, dw8 = vjp8(jnp.ones_like(y8))
        want = ref.grouped_gemm(np.asarray(x8, np.float64), np.asarray(w8, np.float64), sizes)
        err = np.linalg.norm(np.asarray(y8, np.float64) - want) / np.linalg.norm(want)
        print(f"grouped_gemm_fp8 N=384: fwd rel err {err:.3g}, grads finite "
              f"{bool(np.isfinite(np.asarray(dx8, np.float32)).all() and np.isfinite(np.asarray(dw8, np.float32)).all())}",
              flush=True)

    # router_topk: both kernels (penalty: a block per sequence over chunks, the last one partial; none: a grid)
    sel = rng.uniform(0, 1, (2, 45, 64)).astype(np.float32)
    bias = rng.normal(0, 0.05, 64).astype(np.float32)
    for penalty in (0.1, 0.0):
        got = [np.asarray(ops.router_topk(jax.device_put(jnp.asarray(sel), dev), jax.device_put(jnp.asarray(bias), dev),
                                          top_k=6, n_groups=8, topk_groups=4, penalty=penalty, chunk=16))
               for dev in (gpu, jax.devices("cpu")[0])]
        print(f"router_topk penalty {penalty} equals the CPU handler:", np.array_equal(*got))

    # segment_sum: a heavy id, absent and dropped ids, vector (D = 64 bf16) and scalar (D = 13) rows
    seg_ids = np.minimum(rng.zipf(1.2, 700) - 1, 40).astype(np.int32)
    seg_ids[:5] = [-1, 41, 99, -3, 40]
    for d in (64, 13):
        data = jnp.asarray(rng.standard_normal((700, d)), jnp.bfloat16)
        got = [np.asarray(ops.segment_sum(jax.device_put(data, dev), jax.device_put(jnp.asarray(seg_ids), dev), 41),
                          np.float32) for dev in (gpu, jax.devices("cpu")[0])]
        print(f"segment_sum D={d} equals the CPU handler:", np.array_equal(*got))


if __name__ == "__main__":
    main()
