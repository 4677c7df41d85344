"""swiglu_combine_grad on the GPU: against float64 and the CPU handler (the 16-byte and the scalar kernels), act * w
bit for bit the CUDA forward kernel's act times w, and deterministic (d_w is a fixed-order warp reduction).
swiglu_combine_grad_fp8 on the GPU: bit for bit the plain kernel's outputs and the jnp quantiser's codes of its d_h,
within the CPU handler's tolerances, at the expert block's sizes (98304 x 2*512, 8192 x 2*2048) and with a tile
across [d_gate | d_up]; outputs written over poisoned memory, rows past valid_rows left unwritten; in a scanned loop."""
import numpy as np
import pytest

import jax
import jax.numpy as jnp

from tests.gpu import GPU, requires_gpu
from tests.ops.test_swiglu_combine_grad import (FP8, _float64, _inputs, act_times_w, bits, forward_act,
                                                quantized_reference, skewed_inputs)

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


# ---- swiglu_combine_grad_fp8 ------------------------------------------------------------------------------------
CPU = jax.devices("cpu")[0]


def poisoned(shape, dtype):
    """All-ones bits on the GPU: NaN in every float and FP8 lane, never a result of finite inputs."""
    width = jnp.dtype(dtype).itemsize
    raw = jnp.full(shape, (1 << (8 * width)) - 1, {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32}[width])
    return jax.device_put(jax.lax.bitcast_convert_type(raw, dtype), GPU).block_until_ready()


def fp8_over_poison(h, g, w, valid, fp8):
    """swiglu_combine_grad_fp8 on the GPU, its five results written into donated poisoned buffers (the pointers are
    checked), so an element the kernel should have written and did not shows as NaN."""
    M, two_f = h.shape[-2:]
    lead = h.shape[:-2]
    outs = [poisoned(h.shape, h.dtype), poisoned(h.shape, fp8), poisoned(lead + (M, two_f // 128), jnp.float32),
            poisoned(lead + (M,), jnp.float32), poisoned(lead + (M, two_f // 2), h.dtype)]
    pointers = [o.unsafe_buffer_pointer() for o in outs]
    run = jax.jit(lambda o, a, b, c, v: ops.swiglu_combine_grad_fp8(a, b, c, v, fp8), donate_argnums=0,
                  keep_unused=True)
    got = run(outs, *(jax.device_put(a, GPU) for a in (h, g, w, valid)))
    assert [o.unsafe_buffer_pointer() for o in got] == pointers, "outputs not in the poisoned buffers"
    return got


def check_fp8_on_gpu(h, g, w, valid, fp8):
    """Valid rows: d_h, d_w, act_w bit for bit the GPU swiglu_combine_grad's; d_h_q, d_h_scale bit for bit the jnp
    quantiser's (on the CPU) of that d_h; all five within the existing test's tolerances of the CPU handler's.
    Rows past `valid` still hold the poison (unwritten)."""
    d_h, d_h_q, d_h_scale, d_w, act_w = fp8_over_poison(h, g, w, valid, fp8)
    assert d_h.devices() == {GPU} and d_h_q.dtype == fp8
    plain = jax.jit(ops.swiglu_combine_grad)(*(jax.device_put(a, GPU) for a in (h, g, w, valid)))
    q_ref, scale_ref = quantized_reference(jax.device_put(d_h, CPU), fp8)
    cpu = jax.jit(ops.swiglu_combine_grad_fp8, static_argnums=4)(*(jax.device_put(a, CPU) for a in (h, g, w, valid)),
                                                                 fp8)
    got = (d_h, d_h_q, d_h_scale, d_w, act_w)
    exact = (plain[0], q_ref, scale_ref, plain[1], plain[2])
    ulp = {jnp.dtype(jnp.float32): 1e-6, jnp.dtype(jnp.bfloat16): 8e-3, jnp.dtype(jnp.float16): 1e-3}[h.dtype]
    counts = np.broadcast_to(np.asarray(valid), h.shape[:-2])
    for idx in np.ndindex(*h.shape[:-2]):
        n = int(counts[idx])
        for a, b in zip(got, exact):
            np.testing.assert_array_equal(bits(a[idx][:n]), bits(b[idx][:n]))
        for a in got:
            assert (bits(a[idx][n:]) == np.iinfo(bits(a).dtype).max).all(), "a row past valid_rows was written"
        c_h, c_q, c_scale, c_w, c_aw = (np.asarray(a[idx][:n], np.float64) for a in cpu)
        g_h, g_q, g_scale, g_w, g_aw = (np.asarray(a[idx][:n], np.float64) for a in got)
        h_max, aw_max = np.abs(c_h).max(initial=0), np.abs(c_aw).max(initial=0)
        np.testing.assert_allclose(g_h, c_h, rtol=ulp, atol=ulp * h_max * 1e-2)
        np.testing.assert_allclose(g_w, c_w, rtol=1e-5, atol=1e-5 * np.abs(c_w).max(initial=0))
        np.testing.assert_allclose(g_aw, c_aw, rtol=ulp, atol=ulp * aw_max * 1e-2)
        np.testing.assert_allclose(g_scale, c_scale, rtol=ulp)  # amax * (1/fmax): the amax one ulp apart at most
        # codes: one FP8 step apart where d_h's last bit differs (dequantised, a step is 2^-2 of the value at most)
        deq_g = g_q * np.repeat(g_scale, 128, axis=-1)
        deq_c = c_q * np.repeat(c_scale, 128, axis=-1)
        step = np.repeat(c_scale, 128, axis=-1) * float(jnp.finfo(fp8).smallest_subnormal)
        assert np.all(np.abs(deq_g - deq_c) <= 2**-2 * np.abs(deq_c) + step + ulp * np.abs(deq_c))


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16, jnp.float32])
@pytest.mark.parametrize("rows,F", [(98304, 512), (8192, 2048), (4097, 192), (333, 320), (37, 64)])
def test_fp8_matches_the_plain_kernel_the_quantiser_and_the_cpu(rows, F, dtype):
    """The 16-byte packs (a loop step of 256 or 128 columns); F = 64 * odd: a tile across [d_gate | d_up], and d_up's
    tiles spanning two loop steps."""
    h, g, w = skewed_inputs(rows % 1000 + F, rows, F, dtype)
    check_fp8_on_gpu(h, g, w, jnp.int32(rows), FP8["e4m3"])


@pytest.mark.parametrize("fp8", ["e4m3", "e5m2"])
def test_fp8_valid_rows_and_leading_dims_leave_the_tail_unwritten(fp8):
    h, g, w = skewed_inputs(9, 301, 192, jnp.bfloat16, lead=(2, 3))
    check_fp8_on_gpu(h, g, w, jnp.asarray([[301, 0, 17], [300, 1, 128]], jnp.int32), FP8[fp8])


def test_fp8_scalar_kernel_on_unaligned_rows():
    """h, g and d_h rows off the 16-byte grid (a slice of a larger buffer inside one jit: XLA may or may not copy
    it) still give the plain kernel's outputs and the quantiser's codes; the one-element loop step (V = 1) covers a
    tile in four steps."""
    h, g, w = skewed_inputs(4, 65, 192, jnp.float32)
    pad = jnp.concatenate([jnp.zeros((1,), h.dtype), h.reshape(-1)])
    run = jax.jit(lambda p, g_, w_: ops.swiglu_combine_grad_fp8(p[1:].reshape(h.shape), g_, w_))
    d_h, d_h_q, d_h_scale, d_w, act_w = run(*(jax.device_put(a, GPU) for a in (pad, g, w)))
    plain = jax.jit(ops.swiglu_combine_grad)(*(jax.device_put(a, GPU) for a in (h, g, w)))
    q_ref, scale_ref = quantized_reference(jax.device_put(d_h, CPU), FP8["e4m3"])
    for a, b in zip((d_h, act_w, d_h_q, d_h_scale), (plain[0], plain[2], q_ref, scale_ref)):
        np.testing.assert_array_equal(bits(a), bits(b))
    # d_w sums F products in float32; the one-element step adds them in another order than the vector kernel: the
    # two agree within float32 summation's bound, F * eps * sum |act * g| a row (a cancelling row's relative error
    # is larger: 1.3e-5 was seen on an H200)
    hf, gf = np.asarray(h, np.float64), np.asarray(g, np.float64)
    f = gf.shape[-1]
    act = hf[..., :f] / (1 + np.exp(-hf[..., :f])) * hf[..., f:]
    bound = f * np.finfo(np.float32).eps * np.sum(np.abs(act * gf), axis=-1)
    assert np.all(np.abs(np.asarray(d_w, np.float64) - np.asarray(plain[1], np.float64)) <= bound)


def test_fp8_in_a_scanned_loop():
    """Each iteration's new rows (XLA may record the call into a command buffer it replays)."""
    hs, gs, ws = (jnp.stack(a) for a in zip(*(skewed_inputs(s, 67, 192, jnp.bfloat16) for s in range(3))))

    def body(carry, x):
        out = ops.swiglu_combine_grad_fp8(*x)
        return carry + out[2].sum(), out

    _, outs = jax.jit(lambda *a: jax.lax.scan(body, jnp.float32(0), a))(*(jax.device_put(a, GPU) for a in (hs, gs, ws)))
    for i in range(3):
        one = jax.jit(ops.swiglu_combine_grad_fp8)(*(jax.device_put(a[i], GPU) for a in (hs, gs, ws)))
        for a, b in zip(outs, one):
            np.testing.assert_array_equal(bits(a[i]), bits(b))
