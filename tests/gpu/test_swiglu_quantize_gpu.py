"""swiglu_quantize's CUDA kernel (a warp per row; act staged in shared memory a chunk at a time for row_quantize.cuh's
step) on the GPU, for every input dtype and both FP8 formats:
- bit for bit `quantize_rows` of the CUDA forward kernel's act (grouped_gemm_swiglu: the same formula and expf);
- against the CPU handler within the exp tolerance of the CPU tests (CUDA's expf and the C++ std::exp may round an ulp
  apart; a few ulps of a float32 act), and dequantised against float64;
- widths of 1, 5 and 16 tiles (one chunk, a partial last chunk, several), M not a multiple of the 8 rows of a block,
  leading dims; large M (98304 x 2*512, 8192 x 2*2048) and valid_rows, written into poisoned buffers: every valid row
  written, the rows from valid_rows on left unwritten; no rows; inside a scanned loop (XLA may replay it from a
  command buffer). Skipped without a GPU."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tests.gpu import GPU, requires_gpu
from tests.ops.test_swiglu_quantize import (FP8, INPUTS, assert_dequantises_to_float64, assert_within_one_exp_ulp,
                                            bits, gate_up, library_act)
from turbo_moe import ops

pytestmark = requires_gpu

CPU = jax.devices("cpu")[0]

CASES = {  # name: shape of h (..., M, 2F)
    "one_tile": (1003, 2 * 128),
    "odd_tiles": (257, 2 * 640),       # a partial last chunk for every dtype
    "sixteen_tiles": (301, 2 * 2048),  # several chunks
    "leading_dims": (2, 3, 45, 2 * 384),
}


def on_cpu(fn, *args, **kwargs):
    """fn on the CPU backend: its handler there (the jitted call runs where its operands are committed)."""
    return jax.jit(lambda *a: fn(*a, **kwargs))(*(jax.device_put(a, CPU) for a in args))


def quantized_forward_act(h, fp8):
    """quantize_rows of the CUDA grouped_gemm_swiglu's act: what the kernel must equal bit for bit."""
    return jax.jit(lambda a: ops.quantize_rows(library_act(a), fp8))(h)


def assert_same_bits(got, want):
    for g, w in zip(got, want):
        assert g.shape == w.shape and g.dtype == w.dtype
        np.testing.assert_array_equal(bits(g), bits(w))


def assert_near_cpu(q, scale, q_cpu, scale_cpu, dtype):
    """CUDA's expf (2 ulps from exact at most) against the C++ std::exp: a float32 act may move by a few more ulps than
    between the CPU's two exps, and so its tile's scale (such tiles may be less rare); codes one step at most."""
    wide = jnp.dtype(dtype) == jnp.float32
    assert_within_one_exp_ulp(q, scale, q_cpu, scale_cpu, dtype, ulps=8 if wide else 4,
                              scale_fraction=5e-2 if wide else 5e-3)


@pytest.mark.parametrize("fp8", FP8)
@pytest.mark.parametrize("dtype", INPUTS)
@pytest.mark.parametrize("case", CASES)
def test_kernel_matches_the_forward_act_and_the_cpu(case, dtype, fp8):
    h = jax.device_put(gate_up(CASES[case], dtype, seed=list(CASES).index(case)), GPU)
    run = jax.jit(ops.swiglu_quantize, static_argnums=2)
    assert "turbo_moe_swiglu_quantize" in run.lower(h, None, FP8[fp8]).as_text()
    q, scale = run(h, None, FP8[fp8])
    assert q.devices() == {GPU}
    assert_same_bits((q, scale), quantized_forward_act(h, FP8[fp8]))
    q_cpu, scale_cpu = on_cpu(ops.swiglu_quantize, h, dtype=FP8[fp8])
    assert_near_cpu(q, scale, q_cpu, scale_cpu, dtype)
    assert_dequantises_to_float64(q, scale, h, FP8[fp8])


def poisoned(shape, dtype):
    """An array of all-ones bits on the GPU: NaN in every FP8 and float32 lane, never a result of finite inputs."""
    wide = jnp.dtype(dtype).itemsize == 4
    raw = jnp.full(shape, 0xFFFFFFFF if wide else 0xFF, jnp.uint32 if wide else jnp.uint8)
    return jax.device_put(jax.lax.bitcast_convert_type(raw, dtype), GPU).block_until_ready()


def run_into_poison(h, valid, fp8):
    """The outputs written into donated poisoned buffers (the same memory: the pointers are checked), so a row the
    kernel left unwritten stays all-ones."""
    f = h.shape[-1] // 2
    q0, scale0 = poisoned(h.shape[:-1] + (f,), fp8), poisoned(h.shape[:-1] + (f // 128,), jnp.float32)
    pointers = (q0.unsafe_buffer_pointer(), scale0.unsafe_buffer_pointer())
    run = jax.jit(lambda q_, s_, a, v: ops.swiglu_quantize(a, v, fp8), donate_argnums=(0, 1), keep_unused=True)
    q, scale = run(q0, scale0, h, valid)
    assert (q.unsafe_buffer_pointer(), scale.unsafe_buffer_pointer()) == pointers, "outputs not in the poisoned buffers"
    return q, scale


def assert_valid_rows_written(q, scale, want, valid):
    """Rows before valid are `want`'s bit for bit; the rest are still poison (unwritten)."""
    q, scale = bits(q), bits(scale)
    want_q, want_scale = bits(want[0]), bits(want[1])
    lead = q.shape[:-2]
    for b in np.ndindex(lead):
        n = int(np.asarray(valid)[b])
        np.testing.assert_array_equal(q[b][:n], want_q[b][:n])
        np.testing.assert_array_equal(scale[b][:n], want_scale[b][:n])
        assert np.all(q[b][n:] == 0xFF) and np.all(scale[b][n:] == 0xFFFFFFFF), f"problem {b}: a row past valid written"


def large_gate_up(m, f, seed):
    """(m, 2f) bfloat16 made on the GPU: gates out to +-9, up per 128-wide tile over 2^-10..2^10."""
    keys = jax.random.split(jax.random.key(seed), 3)
    gate = jax.random.normal(keys[0], (m, f)) * 3
    up = jax.random.normal(keys[1], (m, f)) * jnp.repeat(
        jnp.exp2(jax.random.randint(keys[2], (m, f // 128), -10, 11).astype(jnp.float32)), 128, axis=1)
    return jnp.concatenate([gate, up], axis=1).astype(jnp.bfloat16)


@pytest.mark.parametrize("fp8", FP8)
@pytest.mark.parametrize("m,f", [(98304, 512), (8192, 2048)])
def test_large_m_into_poisoned_buffers(m, f, fp8):
    """The expert block's sizes: every row before valid_rows written, bit for bit the forward act's quantisation and
    near the CPU handler's; the tail (1001 rows) unwritten."""
    h = large_gate_up(m, f, seed=m + f)
    valid = jnp.int32(m - 1001)
    q, scale = run_into_poison(h[None], valid[None], FP8[fp8])
    want = tuple(a[None] for a in quantized_forward_act(h, FP8[fp8]))
    assert_valid_rows_written(q, scale, want, valid[None])
    n = m - 1001
    q_cpu, scale_cpu = on_cpu(ops.swiglu_quantize, h[:n], dtype=FP8[fp8])
    assert_near_cpu(q[0, :n], scale[0, :n], q_cpu, scale_cpu, jnp.bfloat16)


@pytest.mark.parametrize("dtype", INPUTS)
def test_valid_rows_of_each_problem_into_poisoned_buffers(dtype):
    h = jax.device_put(gate_up((2, 3, 77, 2 * 640), dtype, seed=5), GPU)
    valid = jnp.array([[77, 0, 40], [1, 76, 200]], jnp.int32)  # a count past M is every row
    q, scale = run_into_poison(h, valid, FP8["e4m3"])
    assert_valid_rows_written(q, scale, quantized_forward_act(h, FP8["e4m3"]), jnp.minimum(valid, 77))


def test_no_rows():
    for shape in [(0, 512), (4, 0, 256)]:
        q, scale = jax.jit(ops.swiglu_quantize)(jnp.zeros(shape, jnp.bfloat16))
        f = shape[-1] // 2
        assert q.shape == shape[:-1] + (f,) and scale.shape == shape[:-1] + (f // 128,) and q.devices() == {GPU}
    q, _ = jax.jit(ops.swiglu_quantize)(jnp.zeros((3, 256), jnp.bfloat16), jnp.int32(0))  # rows, none valid
    assert q.shape == (3, 128)


def test_in_a_scanned_loop():
    """Each iteration quantises new rows with its own valid count (XLA may record the call into a command buffer it
    replays)."""
    hs = jnp.stack([gate_up((67, 2 * 384), jnp.bfloat16, seed=s) for s in range(4)])
    valid = jnp.array([67, 0, 30, 66], jnp.int32)

    def body(carry, x):
        return carry, ops.swiglu_quantize(x[0], x[1])

    _, (q, scale) = jax.jit(lambda a, v: jax.lax.scan(body, jnp.float32(0), (a, v)))(hs, valid)
    for i in range(hs.shape[0]):
        n = int(valid[i])
        want_q, want_scale = quantized_forward_act(hs[i], FP8["e4m3"])
        np.testing.assert_array_equal(bits(q[i, :n]), bits(want_q[:n]))
        np.testing.assert_array_equal(bits(scale[i, :n]), bits(want_scale[:n]))
