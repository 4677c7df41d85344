"""permute_fp8's CUDA kernel (the permute's row copy writing FP8 E4M3 rows and 1x128 scales) bit for bit against the
jnp quantiser of permute's rows, on the CPU and on the GPU; the FP8 op on those rows (Hopper) bit for bit against the
op quantising the rows itself, and the fp8 expert block with and without the fused permute. permute_rows_fp8_call's
kernel (the backward's rows and their FP8 codes in one pass) bit for bit against its CPU handler, at the backward's
sizes, over poisoned outputs. Skipped without a GPU."""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tests.gpu import GPU, requires_gpu
from turbo_moe.shapes import DEEPSEEK_V3

pytestmark = requires_gpu

HOPPER = GPU is not None and str(getattr(GPU, "compute_capability", "")).startswith("9")
requires_hopper = pytest.mark.skipif(not HOPPER,
                                     reason="the FP8 GEMM kernel needs a Hopper GPU (compute capability 9.x)")

if GPU is not None:
    from turbo_moe import ops
    from turbo_moe.ops import GEMM_SETS, permute, permute_fp8
    from turbo_moe.ops.grouped_gemm_fp8 import quantize_rows
    from turbo_moe.ops.permute import permute_rows_call
    from turbo_moe.ops.permute_fp8 import permute_fp8_call, permute_rows_fp8_call

CPU = jax.devices("cpu")[0]

CASES = {  # name: (T, H, k, E)
    "dsv3_width": (300, DEEPSEEK_V3.d_model, DEEPSEEK_V3.top_k, DEEPSEEK_V3.local_experts(8)),  # 56 tiles a row
    "odd_tiles": (257, 640, 3, 7),       # 5 tiles: not a multiple of the tiles a warp loads at once
    "one_tile": (1000, 128, 2, 5),
}


def bits(a):
    a = np.asarray(a)
    return a.view({1: np.uint8, 2: np.uint16, 4: np.uint32}[a.dtype.itemsize])


def routed(case, dtype):
    t, h, k, e = CASES[case]
    rng = np.random.default_rng(0)
    x = rng.standard_normal((t, h)) * np.exp2(rng.integers(-8, 8, (t, h)))  # FP8 subnormals inside tiles
    x[1] = 0.0
    ids = rng.integers(0, e, (t, k)).astype(np.int32)
    ids[ids == 2] = 3       # an empty expert
    ids[::5, 0] = -1        # dropped copies: rows past sum(group_sizes)
    return jnp.asarray(x, dtype), jnp.asarray(ids), e


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32, jnp.float16])
@pytest.mark.parametrize("case", CASES)
def test_kernel_matches_the_jnp_quantiser_bit_for_bit(case, dtype):
    x, ids, e = routed(case, dtype)
    assert "turbo_moe_permute_fp8" in jax.jit(permute_fp8, static_argnums=2).lower(x, ids, e).as_text()
    q, scale, group_sizes, handle = jax.jit(permute_fp8, static_argnums=2)(x, ids, e)
    assert q.devices() == {GPU}
    rows, group_sizes_ref, handle_ref = jax.jit(permute, static_argnums=2)(x, ids, e)
    np.testing.assert_array_equal(group_sizes, group_sizes_ref)
    np.testing.assert_array_equal(handle.row_index, handle_ref.row_index)
    # the reference quantiser on the CPU (rows committed there; tests/ops/test_grouped_gemm_fp8.py checks it against
    # ml_dtypes) ...
    q_cpu, scale_cpu = jax.jit(quantize_rows)(jax.device_put(rows, CPU))
    np.testing.assert_array_equal(bits(scale), bits(scale_cpu))
    np.testing.assert_array_equal(bits(q), bits(q_cpu))
    tail = int(group_sizes.sum())
    assert tail < rows.shape[0] and not bits(q[tail:]).any() and np.all(np.asarray(scale[tail:]) == 1.0)


@pytest.mark.parametrize("case", CASES)
def test_kernel_is_within_one_code_of_the_jnp_quantiser_on_the_gpu(case):
    """Against the emulated path's quantiser as XLA compiles it for the GPU: the scales agree bit for bit, and the
    FP8 codes within one code in a few elements in 10^4. XLA's GPU code for `x * (1 / scale)` is not IEEE float32 at
    every tie (H200, jax 0.11.2: 719 of 17.2 M codes differ by one), while the kernel matches the CPU reference bit for
    bit (the test above). So on the GPU the emulated path and the kernel path differ by that much; the kernel is the
    exact one."""
    x, ids, e = routed(case, jnp.bfloat16)
    q, scale, _, _ = jax.jit(permute_fp8, static_argnums=2)(x, ids, e)
    q_ref, scale_ref = jax.jit(lambda a, i: quantize_rows(permute(a, i, e)[0]))(x, ids)
    np.testing.assert_array_equal(bits(scale), bits(scale_ref))
    codes = np.abs(bits(q).astype(np.int32) - bits(q_ref).astype(np.int32))
    assert codes.max() <= 1 and (codes > 0).mean() < 1e-4, (codes.max(), (codes > 0).mean())


def test_unwritten_tail_leaves_group_rows_exact():
    x, ids, e = routed("odd_tiles", jnp.bfloat16)
    q, scale, group_sizes, _ = jax.jit(lambda a, i: permute_fp8_call(a, i, e, zero_tail=False))(x, ids)
    valid = int(group_sizes.sum())
    q_ref, scale_ref = jax.jit(quantize_rows)(jax.device_put(permute(x, ids, e)[0], CPU))
    np.testing.assert_array_equal(bits(q[:valid]), bits(q_ref[:valid]))
    np.testing.assert_array_equal(bits(scale[:valid]), bits(scale_ref[:valid]))


@requires_hopper
def test_gemm_on_quantised_rows_is_the_ops_forward():
    """The GEMM on the kernel's rows against the op that quantises with XLA: bit for bit given the same FP8 operands
    (the CPU quantiser's, which the kernel's equal), and within the one-code differences of XLA's GPU quantiser
    otherwise."""
    x, ids, e = routed("odd_tiles", jnp.bfloat16)
    rng = np.random.default_rng(1)
    w = jnp.asarray(rng.standard_normal((e, 640, 256)) / np.sqrt(640), jnp.bfloat16)
    q, scale, group_sizes, _ = jax.jit(permute_fp8, static_argnums=2)(x, ids, e)
    rows = permute(x, ids, e)[0]
    got = np.asarray(jax.jit(ops.grouped_gemm_fp8_quantized)(q, scale, w, group_sizes), np.float32)
    q_cpu, scale_cpu = jax.jit(quantize_rows)(jax.device_put(rows, CPU))
    same_operands = jax.jit(ops.grouped_gemm_fp8_quantized)(jax.device_put(q_cpu, GPU),
                                                            jax.device_put(scale_cpu, GPU), w, group_sizes)
    np.testing.assert_array_equal(got, np.asarray(same_operands, np.float32))
    want = np.asarray(jax.jit(ops.grouped_gemm_fp8)(rows, w, group_sizes), np.float32)
    assert np.linalg.norm(got - want) <= 1e-3 * np.linalg.norm(want)


@requires_hopper
def test_fp8_block_with_the_fused_permute_changes_no_bit():
    rng = np.random.default_rng(2)
    t, d, f, e, k = 512, 256, 128, 8, 4
    x = jnp.asarray(rng.standard_normal((t, d)), jnp.bfloat16)
    ids = jnp.asarray(rng.integers(-1, e, (t, k)), jnp.int32)
    combine_w = jax.nn.softmax(jnp.asarray(rng.standard_normal((t, k)), jnp.float32), axis=-1)
    w_gate_up = jnp.asarray(rng.standard_normal((e, d, 2 * f)) / np.sqrt(d), jnp.bfloat16)
    w_down = jnp.asarray(rng.standard_normal((e, f, d)) / np.sqrt(f), jnp.bfloat16)
    cotangent = jnp.asarray(rng.standard_normal((t, d)), jnp.float32)

    def grads(gemms):
        def loss(a, c, wg, wd):
            return jnp.sum(ops.expert_block(a, ids, c, wg, wd, gemms=gemms)[0].astype(jnp.float32) * cotangent)
        return jax.jit(jax.value_and_grad(loss, (0, 1, 2, 3)))(x, combine_w, w_gate_up, w_down)

    # the other FP8 rows quantised after their producers on both sides: only the permute's quantisation differs
    fused = dataclasses.replace(GEMM_SETS["fp8"], producer_quantized=None)
    got, want = grads(fused), grads(dataclasses.replace(fused, permute_forward=None))
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_array_equal(np.asarray(g, np.float32), np.asarray(w, np.float32))

    # the backward's FP8 rows from their producers (the row gather, SwiGLU's backward) against the bf16 producers
    # followed by quantize_rows: bit for bit on the GPU too
    pq = GEMM_SETS["fp8"].producer_quantized

    def after(rows):
        return (rows,) + tuple(ops.quantize_rows(rows))

    reference = dataclasses.replace(GEMM_SETS["fp8"], producer_quantized=dataclasses.replace(
        pq, permute_rows=lambda x_, ri, gs, zt: after(permute_rows_call(x_, ri, gs, zt)),
        swiglu_grad=lambda h, g_act, w_rows, valid: (lambda o: after(o[0]) + o[1:])(
            ops.swiglu_combine_grad(h, g_act, w_rows, valid))))
    got, want = grads(GEMM_SETS["fp8"]), grads(reference)
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_array_equal(np.asarray(g, np.float32), np.asarray(w, np.float32))


# ---- permute_rows_fp8_call: the backward's rows and FP8 codes in one pass -----------------------------------------

FP8 = {"e4m3": jnp.dtype(jnp.float8_e4m3fn), "e5m2": jnp.dtype(jnp.float8_e5m2)}
ROWS_CASES = {  # name: (T, H, k, E)
    "d1280_k6": (16384, 1280, 6, 64),
    "dsv3_k8": (8192, DEEPSEEK_V3.d_model, 8, 256),
    "odd": (1001, 640, 3, 7),            # 5 tiles a row, T not a multiple of the 8 copies of a block
}


def backward_operands(case, dtype, seed=0):
    """d_y (T, H) made on the GPU (magnitudes over 16 binades within a tile, tile exponents over 40, zero rows) and
    the row index and group sizes of a permute: an empty expert, dropped copies, one expert taking ~1/4 of them."""
    t, h, k, e = ROWS_CASES[case]
    keys = jax.random.split(jax.random.key(seed), 3)
    x = (jax.random.normal(keys[0], (t, h)) * jnp.exp2(jax.random.randint(keys[1], (t, h), -8, 8).astype(jnp.float32))
         * jnp.repeat(jnp.exp2(jax.random.randint(keys[2], (t, h // 128), -20, 20).astype(jnp.float32)), 128, axis=1))
    x = x.at[::97].set(0.0).astype(dtype)
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, e, (t, k))
    ids[ids == 2] = 3                      # an empty expert
    ids[rng.random((t, k)) < 0.25] = 5     # a skewed one
    ids[::7, 0] = -1                       # dropped copies: rows past sum(group_sizes)
    _, group_sizes, handle = jax.jit(permute, static_argnums=2)(x, jnp.asarray(ids, jnp.int32), e)
    return jax.device_put(x, GPU), handle.row_index, group_sizes


def poisoned(shape, dtype):
    """All-ones bits on the GPU: NaN in every float lane, never a result of finite inputs."""
    width = jnp.dtype(dtype).itemsize
    raw = jnp.full(shape, (1 << (8 * width)) - 1, {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32}[width])
    return jax.device_put(jax.lax.bitcast_convert_type(raw, dtype), GPU).block_until_ready()


def rows_fp8_over_poison(x, row_index, group_sizes, fp8, zero_tail):
    """permute_rows_fp8_call on the GPU with its outputs in donated poisoned buffers (the pointers are checked), so
    any element it left unwritten shows as all-ones bits."""
    n, h = row_index.size, x.shape[1]
    outs = (poisoned((n, h), x.dtype), poisoned((n, h), fp8), poisoned((n, h // 128), jnp.float32))
    pointers = tuple(o.unsafe_buffer_pointer() for o in outs)
    run = jax.jit(lambda r0, q0, s0, a, ri, gs: permute_rows_fp8_call(a, ri, gs, zero_tail, fp8),
                  donate_argnums=(0, 1, 2), keep_unused=True)
    assert "turbo_moe_permute_rows_fp8" in run.lower(*outs, x, row_index, group_sizes).as_text()
    got = run(*outs, x, row_index, group_sizes)
    assert tuple(o.unsafe_buffer_pointer() for o in got) == pointers, "outputs not in the poisoned buffers"
    assert all(o.devices() == {GPU} for o in got)
    return got


def rows_fp8_on_cpu(x, row_index, group_sizes, fp8, zero_tail=True):
    """The CPU handler (tests/ops/test_permute_fp8.py checks it against permute_rows and the jnp quantiser)."""
    args = [jax.device_put(a, CPU) for a in (x, row_index, group_sizes)]
    return jax.jit(permute_rows_fp8_call, static_argnums=(3, 4))(*args, zero_tail, fp8)


def assert_rows_fp8_equal(got, want, valid):
    for g, w in zip(got, want):
        assert g.shape == w.shape and g.dtype == w.dtype
        np.testing.assert_array_equal(bits(g[:valid]), bits(w[:valid]))


@pytest.mark.parametrize("case", ["d1280_k6", "dsv3_k8"])
def test_rows_fp8_kernel_matches_the_cpu_handler_at_the_backwards_sizes(case):
    x, row_index, group_sizes = backward_operands(case, jnp.bfloat16)
    got = rows_fp8_over_poison(x, row_index, group_sizes, FP8["e4m3"], zero_tail=True)
    valid = int(group_sizes.sum())
    assert 0 < valid < row_index.size and int(group_sizes[2]) == 0
    # every row, the tail included (a zero row and q 0, scale 1 on both); the CPU never writes all-ones bits
    assert_rows_fp8_equal(got, rows_fp8_on_cpu(x, row_index, group_sizes, FP8["e4m3"]), row_index.size)
    assert not np.isnan(np.asarray(got[0][:valid], np.float32)).any()


@pytest.mark.parametrize("zero_tail", [True, False])
@pytest.mark.parametrize("fp8", FP8)
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32, jnp.float16])
def test_rows_fp8_kernel_every_dtype_and_format(dtype, fp8, zero_tail):
    x, row_index, group_sizes = backward_operands("odd", dtype, seed=1)
    got = rows_fp8_over_poison(x, row_index, group_sizes, FP8[fp8], zero_tail)
    valid = int(group_sizes.sum())
    want = rows_fp8_on_cpu(x, row_index, group_sizes, FP8[fp8], zero_tail)
    assert_rows_fp8_equal(got, want, row_index.size if zero_tail else valid)
    # the rows the CPU checks bit for bit against permute_rows' and the jnp quantiser's, so the GPU's equal those
    np.testing.assert_array_equal(bits(got[0][:valid]), bits(jax.jit(permute_rows_call)(
        jax.device_put(x, CPU), jax.device_put(row_index, CPU), jax.device_put(group_sizes, CPU))[:valid]))
    if not zero_tail:  # rows past the groups are left unwritten: the poison is still there
        assert all(np.all(bits(o[valid:]) == np.iinfo(bits(o).dtype).max) for o in got)


def test_rows_fp8_no_tokens_and_every_copy_dropped():
    rows, q, scale = jax.jit(permute_rows_fp8_call)(jnp.zeros((0, 256), jnp.bfloat16), jnp.zeros((0, 6), jnp.int32),
                                                    jnp.zeros((4,), jnp.int32))
    assert rows.shape == q.shape == (0, 256) and scale.shape == (0, 2) and rows.devices() == {GPU}
    x, _, _ = backward_operands("odd", jnp.bfloat16)
    row_index, group_sizes = jnp.full((x.shape[0], 3), -1, jnp.int32), jnp.zeros((7,), jnp.int32)
    rows, q, scale = rows_fp8_over_poison(x, row_index, group_sizes, FP8["e4m3"], zero_tail=True)
    assert not bits(rows).any() and not bits(q).any() and np.all(np.asarray(scale) == 1.0)


def test_rows_fp8_in_a_scanned_loop():
    """Each iteration copies new rows (XLA may record the call into a command buffer it replays)."""
    x, row_index, group_sizes = backward_operands("odd", jnp.bfloat16, seed=2)
    xs = jnp.stack([x, -x, x * 0.5])

    def body(carry, a):
        rows, q, scale = permute_rows_fp8_call(a, row_index, group_sizes)
        return carry + scale.sum(), (rows, q, scale)

    _, got = jax.jit(lambda a: jax.lax.scan(body, jnp.float32(0), a))(xs)
    for i in range(xs.shape[0]):
        assert_rows_fp8_equal([o[i] for o in got], rows_fp8_on_cpu(xs[i], row_index, group_sizes, FP8["e4m3"]),
                              row_index.size)
