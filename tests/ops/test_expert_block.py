"""`ops.expert_block` (permute -> SwiGLU FFN -> unpermute, one custom VJP) and `ops.expert_ffn` for any GEMM set:
outputs and gradients against a float32 reference built from jnp ops (dropped copies, experts with no rows, K and N
not multiples of 8), the block against its pieces differentiated by autodiff, each set's gradients against its
forward's VJP, a set defined outside the table, and errors that name the argument."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from turbo_moe import ops
from turbo_moe.ops import GEMM_SETS, GemmSet
from turbo_moe.ops.expert_block import swiglu
from turbo_moe.ops.gemm_sets import gradients_by_autodiff
from turbo_moe.ops.permute import permute_rows_call

F32 = jnp.float32


def reference(tokens, expert_ids, combine_w, w_gate_up, w_down):
    """y[t] = sum_j combine_w[t, j] * SwiGLU expert_{ids[t, j]}(tokens[t]) in float32, each copy gathering its
    expert's weights; a copy whose id is outside [0, E) contributes nothing."""
    e, f = w_gate_up.shape[0], w_down.shape[1]
    kept = (expert_ids >= 0) & (expert_ids < e)
    ids = jnp.where(kept, expert_ids, 0)
    h = jnp.einsum("td,tkdf->tkf", tokens.astype(F32), w_gate_up.astype(F32)[ids])  # (T, k, 2F)
    act = jax.nn.silu(h[..., :f]) * h[..., f:]
    out = jnp.einsum("tkf,tkfd->tkd", act, w_down.astype(F32)[ids])  # (T, k, D)
    return jnp.einsum("tkd,tk->td", out, jnp.where(kept, combine_w.astype(F32), 0.0))


def make_case(routing="random", t=13, k=3, d=20, f=13, e=6, seed=7):
    """T*k = 39 rows, K = D = 20 and N = 2F = 26 (then K = F = 13, N = D = 20): no multiple of 8."""
    keys = jax.random.split(jax.random.key(seed), 6)
    tokens = jax.random.normal(keys[0], (t, d))
    ids = jax.random.randint(keys[1], (t, k), 0, e)
    if routing == "skewed":  # every copy on experts 0 and 1: four experts get no rows
        ids = jnp.where(jnp.arange(k) == 0, 0, 1) * jnp.ones((t, 1), jnp.int32)
    if routing == "dropped":  # ids outside [0, E) drop their copies; token 0 loses all of them
        ids = ids.at[0].set(-1).at[3, 1].set(e).at[5, 2].set(e + 3)
    combine_w = jax.random.uniform(keys[2], (t, k), minval=0.1, maxval=1.0)
    w_gate_up = jax.random.normal(keys[3], (e, d, 2 * f)) * 0.3
    w_down = jax.random.normal(keys[4], (e, f, d)) * 0.3
    cotangent = jax.random.normal(keys[5], (t, d))
    return (tokens, ids, combine_w, w_gate_up, w_down), cotangent


DIFF_ARGS = (0, 2, 3, 4)  # tokens, combine_w, w_gate_up, w_down
NAMES = ("tokens", "combine_w", "w_gate_up", "w_down")


def loss_and_grads(fn, args, cotangent, dtype):
    def loss(tokens, ids, combine_w, w_gate_up, w_down):
        y = fn(tokens.astype(dtype), ids, combine_w, w_gate_up.astype(dtype), w_down.astype(dtype))
        y = y[0] if isinstance(y, tuple) else y
        return jnp.sum(y.astype(F32) * cotangent)

    return jax.jit(jax.value_and_grad(loss, DIFF_ARGS))(*args)


def assert_close(got, want, tolerance, loss=True):
    (got_loss, got_grads), (want_loss, want_grads) = got, want
    if loss:  # a sum of T*D products: in bfloat16 its cancellation leaves no relative tolerance
        np.testing.assert_allclose(got_loss, want_loss, **tolerance)
    for name, g, w in zip(NAMES, got_grads, want_grads):
        assert g.shape == w.shape, name
        scale = float(jnp.max(jnp.abs(w))) or 1.0
        np.testing.assert_allclose(np.asarray(g, np.float32) / scale, np.asarray(w) / scale, err_msg=name,
                                   **tolerance)


SETS = {"turbo": GEMM_SETS["turbo"], "turbo_xla_swiglu": GEMM_SETS["turbo"].without_fused_swiglu(),
        "ragged_dot": GEMM_SETS["ragged_dot"]}


@pytest.mark.parametrize("routing", ["random", "skewed", "dropped"])
@pytest.mark.parametrize("gemms", list(SETS))
def test_block_matches_the_float32_reference(gemms, routing):
    args, cotangent = make_case(routing)
    block = lambda *a: ops.expert_block(*a, gemms=SETS[gemms])
    y, group_sizes = jax.jit(block)(*args)
    np.testing.assert_allclose(y, reference(*args), rtol=1e-5, atol=1e-5)
    ids = np.asarray(args[1]).ravel()
    np.testing.assert_array_equal(group_sizes, np.bincount(ids[(ids >= 0) & (ids < 6)], minlength=6))
    got = loss_and_grads(block, args, cotangent, F32)
    assert_close(got, loss_and_grads(reference, args, cotangent, F32), dict(rtol=1e-5, atol=1e-5))
    if routing == "dropped":  # token 0 lost every copy: no gradient reaches it or its weights
        assert np.all(np.asarray(got[1][0][0]) == 0) and np.all(np.asarray(got[1][1][0]) == 0)


@pytest.mark.parametrize("gemms", ["turbo", "turbo_xla_swiglu"])
def test_block_in_bfloat16_is_close_to_the_reference(gemms):
    args, cotangent = make_case("dropped")
    bf16 = [a.astype(jnp.bfloat16) if a.dtype == F32 else a for a in args]
    y, _ = jax.jit(lambda *a: ops.expert_block(*a, gemms=SETS[gemms]))(*bf16)
    assert y.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(y, np.float32), reference(*bf16), rtol=5e-2, atol=5e-2)
    got = loss_and_grads(lambda *a: ops.expert_block(*a, gemms=SETS[gemms]), bf16, cotangent, jnp.bfloat16)
    assert_close(got, loss_and_grads(reference, bf16, cotangent, F32), dict(rtol=5e-2, atol=3e-2), loss=False)


def pieces(gemms):
    """permute -> expert_ffn -> unpermute, each op differentiated by its own VJP."""

    def run(tokens, ids, combine_w, w_gate_up, w_down):
        rows, group_sizes, handle = ops.permute(tokens, ids, w_gate_up.shape[0])
        return ops.unpermute(ops.expert_ffn(rows, w_gate_up, w_down, group_sizes, gemms), handle, combine_w)

    return run


@pytest.mark.parametrize("gemms", ["turbo", "turbo_xla_swiglu"])
@pytest.mark.parametrize("routing", ["random", "skewed", "dropped"])
def test_block_equals_its_pieces_by_autodiff(routing, gemms):
    args, cotangent = make_case(routing)
    y, _ = jax.jit(lambda *a: ops.expert_block(*a, gemms=SETS[gemms]))(*args)
    np.testing.assert_allclose(y, jax.jit(pieces(SETS[gemms]))(*args), rtol=1e-6, atol=1e-6)
    assert_close(loss_and_grads(lambda *a: ops.expert_block(*a, gemms=SETS[gemms]), args, cotangent, F32),
                 loss_and_grads(pieces(SETS[gemms]), args, cotangent, F32), dict(rtol=1e-5, atol=1e-5))


def _ragged_gate_up_swiglu(rows, w, group_sizes):
    h = jax.lax.ragged_dot(rows, w, group_sizes)
    return h, swiglu(h)


def test_a_set_defined_outside_the_table_runs_the_fused_branch():
    """Adding a GEMM is one GemmSet: here XLA's ragged_dot with a gate/up + SwiGLU of its own, passed as an object."""
    forward = GEMM_SETS["ragged_dot"].forward
    mine = GemmSet("mine", forward, *gradients_by_autodiff(forward), gate_up_swiglu=_ragged_gate_up_swiglu)
    args, cotangent = make_case("dropped")
    block = lambda *a: ops.expert_block(*a, gemms=mine)
    np.testing.assert_allclose(jax.jit(block)(*args)[0], reference(*args), rtol=1e-5, atol=1e-5)
    assert_close(loss_and_grads(block, args, cotangent, F32), loss_and_grads(reference, args, cotangent, F32),
                 dict(rtol=1e-5, atol=1e-5))


@pytest.mark.parametrize("name", ["turbo", "ragged_dot"])
def test_each_set_holds_its_forwards_gradients(name):
    """data_grad and weight_grad are the forward's VJP; gate_up_swiglu is forward then SwiGLU (on the group rows)."""
    gemms = GEMM_SETS[name]
    keys = jax.random.split(jax.random.key(3), 4)
    rows, w = jax.random.normal(keys[0], (21, 12)), jax.random.normal(keys[1], (4, 12, 10))
    group_sizes = jnp.array([5, 0, 9, 3], jnp.int32)  # 17 group rows of 21, an empty group
    d_out = jax.random.normal(keys[2], (21, 10))
    out, vjp = jax.vjp(lambda r, w: gemms.forward(r, w, group_sizes), rows, w)
    d_rows, d_w = vjp(d_out)
    np.testing.assert_allclose(gemms.data_grad(d_out, w, group_sizes)[:17], d_rows[:17], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(gemms.weight_grad(rows, d_out, group_sizes), d_w, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(gemms.forward(rows, w, group_sizes, zero_tail=False)[:17], out[:17])
    if gemms.gate_up_swiglu is not None:
        h, act = gemms.gate_up_swiglu(rows, w, group_sizes)
        np.testing.assert_allclose(h[:17], out[:17], rtol=1e-6, atol=1e-6)
        np.testing.assert_allclose(act[:17], jax.nn.silu(out[:17, :5]) * out[:17, 5:], rtol=1e-5, atol=1e-5)



def test_fp8_set_runs_the_block_within_fp8_error():
    """Adding a GEMM is one set: the FP8 grouped GEMM (E4M3, 128-wide scale tiles, so D = F = 128) in the same block.
    Its error against float32 is FP8's, and its gradients come through its own VJP (the kernel's exactness against
    the quantised products is tests/ops/test_grouped_gemm_fp8.py's)."""
    args, cotangent = make_case("dropped", d=128, f=128)
    block = lambda *a: ops.expert_block(*a, gemms="fp8")
    y, _ = jax.jit(block)(*args)
    want = reference(*args)
    scale = float(jnp.max(jnp.abs(want)))
    error = float(jnp.max(jnp.abs(y - want))) / scale
    assert 1e-4 < error < 0.08  # FP8 rounding shows (not a float32 GEMM), and stays within its bound
    got_loss, got_grads = loss_and_grads(block, args, cotangent, F32)
    want_loss, want_grads = loss_and_grads(reference, args, cotangent, F32)
    errors = {name: float(jnp.linalg.norm(g - w) / jnp.linalg.norm(w)) for name, g, w in zip(NAMES, got_grads, want_grads)}
    # Relative (Frobenius) error of each gradient: ~6% (two FP8 GEMMs and the E4M3 output gradient in a chain),
    # ~10% for combine_w (a dot product of the FFN's output, itself two FP8 GEMMs deep, with the cotangent).
    assert all(1e-4 < e < 0.15 for e in errors.values()), errors
    assert np.all(np.asarray(got_grads[0][0]) == 0)  # token 0 lost every copy: no gradient reaches it


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_fp8_set_quantising_in_the_permute_changes_no_bit(dtype):
    """The fp8 set's permute_forward (rows quantised in the permute's copy) against the same set quantising the
    permuted rows with XLA: the same values and gradients bit for bit."""
    args, cotangent = make_case("dropped", d=128, f=128)
    fp8 = dataclasses.replace(GEMM_SETS["fp8"], producer_quantized=None)  # the other FP8 rows quantised after
    unfused = dataclasses.replace(fp8, permute_forward=None)
    assert fp8.permute_forward is not None
    got = loss_and_grads(lambda *a: ops.expert_block(*a, gemms=fp8), args, cotangent, dtype)
    want = loss_and_grads(lambda *a: ops.expert_block(*a, gemms=unfused), args, cotangent, dtype)
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_array_equal(np.asarray(g, np.float32), np.asarray(w, np.float32))


def test_einsum_set_multiplies_capacity_slots():
    gemms = GEMM_SETS["einsum"]
    slots, w = jax.random.normal(jax.random.key(0), (3, 2, 4, 6)), jax.random.normal(jax.random.key(1), (3, 6, 5))
    d_out = jax.random.normal(jax.random.key(2), (3, 2, 4, 5))
    np.testing.assert_allclose(gemms.forward(slots, w, None), jnp.einsum("ebck,ekn->ebcn", slots, w), rtol=1e-6)
    np.testing.assert_allclose(gemms.weight_grad(slots, d_out, None), jnp.einsum("ebck,ebcn->ekn", slots, d_out),
                               rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(gemms.data_grad(d_out, w, None), jnp.einsum("ebcn,ekn->ebck", d_out, w),
                               rtol=1e-5, atol=1e-5)


def test_pallas_set_names_what_it_needs_off_hopper():
    if jax.devices()[0].platform == "gpu" and str(jax.devices()[0].compute_capability).startswith("9."):
        pytest.skip("a Hopper GPU runs the set")
    assert "Hopper GPU" in GEMM_SETS["pallas"].device_problem()
    assert GEMM_SETS["turbo"].device_problem() is None


def test_bad_arguments_name_themselves():
    (tokens, ids, combine_w, w_gu, w_down), _ = make_case()
    block = ops.expert_block
    with pytest.raises(ValueError, match=r"tokens must have rank 2 \(T, D\)"):
        block(tokens[None], ids, combine_w, w_gu, w_down)
    with pytest.raises(TypeError, match="tokens must be bfloat16, float16 or float32"):
        block(tokens.astype(jnp.int32), ids, combine_w, w_gu, w_down)
    with pytest.raises(TypeError, match="expert_ids must be an integer array"):
        block(tokens, ids.astype(F32), combine_w, w_gu, w_down)
    with pytest.raises(ValueError, match=r"combine_w must be \(T, k\)"):
        block(tokens, ids, combine_w[:, :2], w_gu, w_down)
    with pytest.raises(TypeError, match="combine_w must be a float array"):
        block(tokens, ids, ids, w_gu, w_down)
    with pytest.raises(ValueError, match=r"w_gate_up must be \(E, D, 2F\) with D = 20"):
        block(tokens, ids, combine_w, w_gu[:, :8], w_down)
    with pytest.raises(ValueError, match=r"w_gate_up must be \(E, D, 2F\) with D = 20 .* even 2F"):
        block(tokens, ids, combine_w, w_gu[..., :25], w_down)
    with pytest.raises(ValueError, match=r"w_down must be \(E, F, D\) with E = 6 and D = 20"):
        block(tokens, ids, combine_w, w_gu, w_down[:5])
    with pytest.raises(ValueError, match=r"w_gate_up's last dimension must be 2F = 26 .* got 24"):
        block(tokens, ids, combine_w, w_gu[..., :24], w_down)
    with pytest.raises(TypeError, match="w_down must have w_gate_up's dtype"):
        block(tokens, ids, combine_w, w_gu, w_down.astype(jnp.bfloat16))
    with pytest.raises(TypeError, match="must have tokens' dtype float32"):
        block(tokens, ids, combine_w, w_gu.astype(jnp.bfloat16), w_down.astype(jnp.bfloat16))
    with pytest.raises(ValueError, match="gemms must be a GemmSet or one of"):
        block(tokens, ids, combine_w, w_gu, w_down, gemms="cutlass")
    with pytest.raises(ValueError, match="'einsum' set multiplies capacity slots"):
        block(tokens, ids, combine_w, w_gu, w_down, gemms="einsum")
    with pytest.raises(ValueError, match=r"w_gate_up must be \(E, D, 2F\) with D = 20"):
        ops.expert_ffn(tokens, w_gu[:, :8], w_down, jnp.zeros((6,), jnp.int32))


def test_fp8_widths_are_checked_at_trace_time():
    """The fp8 set's GEMMs need K and N multiples of 128 (its scale tiles): a ValueError naming the argument, before
    any kernel runs (under jit too)."""
    (tokens, ids, combine_w, w_gu, w_down), _ = make_case()  # D = 20
    with pytest.raises(ValueError, match=r"tokens: gemms='fp8' needs D a multiple of 128 .* got D = 20"):
        jax.jit(ops.expert_block, static_argnames="gemms")(tokens, ids, combine_w, w_gu, w_down, gemms="fp8")
    (tokens, ids, combine_w, w_gu, w_down), _ = make_case(d=128)  # F = 13
    with pytest.raises(ValueError, match=r"w_down: gemms='fp8' needs F a multiple of 128 .* got F = 13"):
        ops.expert_block(tokens, ids, combine_w, w_gu, w_down, gemms="fp8")
    with pytest.raises(ValueError, match="w_down: gemms='fp8' needs F"):
        ops.expert_ffn(tokens, w_gu, w_down, jnp.zeros((6,), jnp.int32), gemms="fp8")


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_fp8_block_backward_in_one_swiglu_pass_matches_xla(dtype):
    """The fp8 set's backward runs SwiGLU's gradient, the combine weights' gradient and w * act as one kernel pass
    (`swiglu_combine_grad`); against the same set with those left to XLA: the same output, gradients equal to
    rounding (float32: 2e-4; bfloat16: the kernel rounds d_act once where XLA rounds (w g) first)."""
    rng = np.random.default_rng()
    t, d, f, e, k = 90, 256, 128, 4, 2
    x = jnp.asarray(rng.standard_normal((t, d)), dtype)
    ids = jnp.asarray(rng.integers(-1, e, (t, k)), jnp.int32)  # some copies dropped
    cw = jnp.asarray(rng.random((t, k)), jnp.float32)
    wg = jnp.asarray(rng.standard_normal((e, d, 2 * f)) * 0.05, dtype)
    wd = jnp.asarray(rng.standard_normal((e, f, d)) * 0.05, dtype)
    probe = jnp.asarray(rng.standard_normal((t, d)), jnp.float32)

    def grads(gemms):
        def loss(a, c, g, w):
            return jnp.sum(ops.expert_block(a, ids, c, g, w, gemms=gemms)[0].astype(jnp.float32) * probe)
        return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3)))(x, cw, wg, wd)

    fp8 = dataclasses.replace(ops.GEMM_SETS["fp8"], producer_quantized=None)  # SwiGLU's rows quantised after it
    assert fp8.swiglu_backward_kernel
    got, want = grads(fp8), grads(dataclasses.replace(fp8, swiglu_backward_kernel=False))
    np.testing.assert_array_equal(got[0], want[0])
    # float32: 2e-4, not float32's rounding alone: the weight gradients run in bf16 here (the per-shape rule) and the
    # data gradients on FP8 codes, so where the two d_h (or act * w) differ by an ulp a bf16 rounding or an FP8 code
    # can move a step (up to 4.6e-5 of the weight gradients' norm in 80 fresh draws)
    tol = 2e-4 if dtype == jnp.float32 else 2e-2
    for g, w in zip(got[1], want[1]):
        g, w = np.asarray(g, np.float64), np.asarray(w, np.float64)
        assert np.linalg.norm(g - w) <= tol * np.linalg.norm(w), np.linalg.norm(g - w) / np.linalg.norm(w)


def _quantized_after(h_dtype_rows):
    """A bf16 producer's output and its quantize_rows: what a producer_quantized hook replaces."""
    return (h_dtype_rows,) + tuple(ops.quantize_rows(h_dtype_rows))


def _reference_hooks(fp8):
    """The fp8 set's producer hooks rebuilt from the bf16 producers and `quantize_rows` (SwiGLU's own hook kept: its
    act is the kernels' float32 formula, which XLA's exp does not reproduce bit for bit)."""
    pq = fp8.producer_quantized

    def permute_rows(x, row_index, group_sizes, zero_tail):
        return _quantized_after(permute_rows_call(x, row_index, group_sizes, zero_tail))

    def swiglu_grad(h, g_act, w_rows, valid):
        d_h, d_w, act_w = ops.swiglu_combine_grad(h, g_act, w_rows, valid)
        return _quantized_after(d_h) + (d_w, act_w)

    return dataclasses.replace(fp8, producer_quantized=dataclasses.replace(
        pq, permute_rows=permute_rows, swiglu_grad=swiglu_grad))


@pytest.mark.parametrize("routing", ["dropped", "skewed"])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_fp8_rows_written_by_their_producers_change_no_bit(routing, dtype):
    """The fp8 set's backward takes its FP8 rows from the kernels that produce them (the output gradient's row
    gather, SwiGLU's one-pass backward); the same block with those rows quantised after their bf16 producers gives
    the same loss and gradients bit for bit."""
    args, cotangent = make_case(routing, d=256, f=128)
    fp8 = GEMM_SETS["fp8"]
    assert fp8.producer_quantized is not None
    got = loss_and_grads(lambda *a: ops.expert_block(*a, gemms=fp8), args, cotangent, dtype)
    want = loss_and_grads(lambda *a: ops.expert_block(*a, gemms=_reference_hooks(fp8)), args, cotangent, dtype)
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_array_equal(np.asarray(g, np.float32), np.asarray(w, np.float32))


def test_fp8_swiglu_written_in_fp8_is_close_to_xla_swiglu_quantized_after():
    """SwiGLU writing its FP8 rows (act in the kernels' float32 formula, as the bf16 fused kernels compute it) against
    XLA's SwiGLU quantised after: they differ only where an act's last bit moves an FP8 code, so the block's output
    and gradients agree far inside FP8's own error (test_fp8_set_runs_the_block_within_fp8_error: 1e-4 to 0.15)."""
    args, cotangent = make_case("dropped", d=256, f=128)
    fp8 = GEMM_SETS["fp8"]
    got_loss, got = loss_and_grads(lambda *a: ops.expert_block(*a, gemms=fp8), args, cotangent, F32)
    want_loss, want = loss_and_grads(lambda *a: ops.expert_block(
        *a, gemms=dataclasses.replace(fp8, producer_quantized=None)), args, cotangent, F32)
    assert abs(float(got_loss) - float(want_loss)) <= 1e-3 * abs(float(want_loss))
    for name, g, w in zip(NAMES, got, want):
        g, w = np.asarray(g, np.float64), np.asarray(w, np.float64)
        assert np.linalg.norm(g - w) <= 1e-2 * np.linalg.norm(w), (name, np.linalg.norm(g - w) / np.linalg.norm(w))

