"""quantize_group_columns' CUDA kernel (the FP8 weight gradient's 128x1 quantiser, transposed into the group-padded
layout) bit for bit against the jnp reference computed on the CPU, for both FP8 formats, every input dtype, empty
groups, skewed routing, rows past the groups, widths off the 16-byte vector, more work units than the grid has blocks,
no rows; and grouped_gemm_fp8's weight gradient through the kernel bit for bit the product of the reference's
operands. Skipped without a GPU."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tests.gpu import GPU, requires_gpu
from turbo_moe.shapes import DEEPSEEK_V3, REDUCED

pytestmark = requires_gpu

HOPPER = GPU is not None and str(getattr(GPU, "compute_capability", "")).startswith("9")

if GPU is not None:
    from turbo_moe import ops
    from turbo_moe.ops.grouped_gemm_fp8 import E4M3, E5M2, quantize_group_columns_xla, weight_grad_product

CPU = jax.devices("cpu")[0]

CASES = {  # name: (M, C, group sizes)
    "dsv3_width_skewed": (700, DEEPSEEK_V3.d_model, [0] * 10 + [600] + [3] * 20 + [0]),  # 32 groups, one holding most
    "odd_empty_groups": (517, 200, [130, 0, 1, 255, 0, 128, 3]),       # one partial column step, M not of 8
    "sum_below_m": (1000, REDUCED.d_model, [300, 0, 129, 64]),          # rows 493.. belong to no group
    "many_column_blocks": (300, 64 * 40 + 5, [150, 150]),              # odd width: element loads, 11 steps
    "one_column": (129, 1, [1, 128]),
    # More work units (tile, column step) than the persistent grid has blocks: each block's contiguous range crosses
    # tiles and groups; 1000 columns end in a partial step; ragged groups, an empty one, rows past the groups.
    "many_units": (20000, 1000, [5000, 1, 0, 4477, 128, 9000, 1000]),
    "width_4_mod_8": (300, 1028, [0, 129, 127, 44]),  # 16-byte vectors for float32, element loads for 2-byte dtypes
    "all_groups_empty": (200, 72, [0, 0, 0]),         # every tile is padding: zeros, scale 1
}


def bits(a):
    a = np.asarray(a)
    return a.view(np.uint8 if a.dtype.itemsize == 1 else np.uint32)


def rows(m, c, dtype, fmax, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((m, c)) * np.exp2(rng.integers(-8, 8, (m, c)))  # FP8 subnormals inside tiles
    x[1] = 0.0
    x[2, 0] = -0.0
    x[:128, -1] = (np.arange(128) + 0.5) * (fmax / 128.0)  # rounding ties at the format's maximum
    x[127, -1] = fmax
    return jnp.asarray(x, dtype)


@pytest.mark.parametrize("fp8", ["e4m3", "e5m2"])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32, jnp.float16])
@pytest.mark.parametrize("case", CASES)
def test_kernel_matches_the_cpu_reference_bit_for_bit(case, dtype, fp8):
    fp8 = {"e4m3": E4M3, "e5m2": E5M2}[fp8]
    m, c, sizes = CASES[case]
    x = rows(m, c, dtype, float(jnp.finfo(fp8).max))
    gs = jnp.asarray(sizes, jnp.int32)
    run = jax.jit(ops.quantize_group_columns, static_argnums=2)
    assert "turbo_moe_quantize_group_columns" in run.lower(x, gs, fp8).as_text()
    q_t, scale = run(x, gs, fp8)
    assert q_t.devices() == {GPU}
    q_ref, scale_ref = jax.jit(quantize_group_columns_xla, static_argnums=2)(jax.device_put(x, CPU),
                                                                             jax.device_put(gs, CPU), fp8)
    np.testing.assert_array_equal(bits(scale), bits(scale_ref))
    np.testing.assert_array_equal(bits(q_t), bits(q_ref))


def test_no_rows():
    """M = 0 (the reference's gather cannot index an empty x): every tile is padding, zeros with scale 1."""
    q_t, scale = jax.jit(ops.quantize_group_columns)(jnp.zeros((0, 40), jnp.bfloat16), jnp.asarray([0, 0], jnp.int32))
    assert q_t.shape == (40, 256) and scale.shape == (2, 40)
    assert not bits(q_t).any() and np.all(np.asarray(scale) == 1.0)


@pytest.mark.parametrize("case", ["odd_empty_groups", "sum_below_m"])
def test_weight_gradient_through_the_kernel_is_the_reference_operands_product(case):
    """grouped_gemm_fp8's weight gradient (its backward quantises with the kernel) equals the weight-gradient product
    of the CPU reference's FP8 operands, bit for bit (Hopper: the FP8 kernel; elsewhere the emulated product)."""
    m, _, sizes = CASES[case]
    k, n = 256, 128
    rng = np.random.default_rng(1)
    lhs = jnp.asarray(rng.standard_normal((m, k)), jnp.bfloat16)
    rhs = jnp.asarray(rng.standard_normal((len(sizes), k, n)) / np.sqrt(k), jnp.bfloat16)
    d_out = jnp.asarray(rng.standard_normal((m, n)), jnp.bfloat16)
    gs = jnp.asarray(sizes, jnp.int32)
    impl = "auto" if HOPPER else "emulated"
    _, vjp = jax.vjp(lambda w: ops.grouped_gemm_fp8(lhs, w, gs, weight_grad="fp8", impl=impl), rhs)
    (d_rhs,) = jax.jit(vjp)(d_out)
    ref = jax.jit(quantize_group_columns_xla)
    lq, ls = jax.device_put(ref(jax.device_put(lhs, CPU), jax.device_put(gs, CPU)), GPU)
    dq, ds = jax.device_put(ref(jax.device_put(d_out, CPU), jax.device_put(gs, CPU)), GPU)
    want = jax.jit(lambda *a: weight_grad_product(*a, m, out_dtype=rhs.dtype, impl=impl))(lq, ls, dq, ds, gs)
    np.testing.assert_array_equal(np.asarray(d_rhs, np.float32), np.asarray(want, np.float32))
