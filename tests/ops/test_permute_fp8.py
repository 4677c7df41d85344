"""permute_fp8 (the permute's row copy writing FP8 E4M3 rows and 1x128 scales) on the CPU: bit for bit the jnp
quantiser (`quantize_rows`, itself checked against ml_dtypes in test_grouped_gemm_fp8.py) of permute's rows, with
dropped copies, empty experts, rows past the groups, every input dtype, FP8 subnormals and ties; bad input.
permute_rows_fp8_call (the backward's copy step writing the rows and their FP8 codes): rows bit for bit
permute_rows_call's, q and scale the jnp quantiser's of those rows, in both FP8 formats."""
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from turbo_moe.ops import _ffi, permute, permute_fp8, permute_rows, permute_rows_fp8
from turbo_moe.ops import fp8_scaling
from turbo_moe.ops.grouped_gemm_fp8 import quantize_rows
from turbo_moe.ops.permute import permute_rows_call
from turbo_moe.ops.permute_fp8 import permute_fp8_call, permute_rows_fp8_call


def bits(a):
    a = np.asarray(a)
    return a.view(np.uint8 if a.dtype.itemsize == 1 else np.uint32)


def assert_bit_identical(q, scale, rows):
    q_ref, scale_ref = jax.jit(quantize_rows)(rows)
    assert q.dtype == jnp.float8_e4m3fn and scale.dtype == jnp.float32
    assert q.shape == q_ref.shape and scale.shape == scale_ref.shape
    np.testing.assert_array_equal(bits(scale), bits(scale_ref))
    np.testing.assert_array_equal(bits(q), bits(q_ref))


def tokens(t, h, dtype, rng):
    """Per-element magnitudes over ~16 binades (so a tile holds E4M3 subnormals and values that round to 0), a row of
    zeros, a tile of exact E4M3 ties and negative zeros."""
    x = rng.standard_normal((t, h)) * np.exp2(rng.integers(-8, 8, (t, h)))
    x[1] = 0.0
    x[2, :128] = 0.0
    x[2, 0] = -0.0
    # 448 * 2^-10 .. : the amax maps to 448, so multiples of 2^-10 * (odd) land on E4M3 rounding ties
    x[3, :128] = (np.arange(128) + 0.5) * (448.0 / 128.0)
    x[3, 127] = 448.0
    return jnp.asarray(x, dtype)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32, jnp.float16])
def test_matches_the_jnp_quantiser_of_permutes_rows(dtype):
    rng = np.random.default_rng(0)
    t, h, k, e = 67, 384, 3, 7
    x = tokens(t, h, dtype, rng)
    ids = rng.integers(0, e, (t, k)).astype(np.int32)
    ids[ids == 4] = 5          # expert 4 empty
    ids[::5, 1] = -1           # dropped copies: rows past sum(group_sizes)
    ids[::7, 2] = e + 3        # out of range is dropped too
    q, scale, group_sizes, handle = jax.jit(permute_fp8, static_argnums=2)(x, ids, e)
    rows, group_sizes_ref, handle_ref = permute(x, ids, e)
    np.testing.assert_array_equal(group_sizes, group_sizes_ref)
    np.testing.assert_array_equal(handle.row_index, handle_ref.row_index)
    assert int(group_sizes[4]) == 0 and int(group_sizes.sum()) < t * k
    assert_bit_identical(q, scale, rows)
    tail = int(group_sizes.sum())
    assert not bits(q[tail:]).any() and np.all(np.asarray(scale[tail:]) == 1.0)  # a zero row's quantisation


def test_every_copy_dropped_and_one_expert():
    rng = np.random.default_rng(1)
    x = tokens(9, 128, jnp.bfloat16, rng)
    q, scale, group_sizes, _ = permute_fp8(x, np.full((9, 2), -1, np.int32), 3)
    assert not np.asarray(group_sizes).any() and not bits(q).any() and np.all(np.asarray(scale) == 1.0)
    ids = np.zeros((9, 2), np.int32)
    q, scale, _, _ = permute_fp8(x, ids, 1)
    assert_bit_identical(q, scale, permute(x, ids, 1)[0])


def test_rows_variant_and_unwritten_tail():
    rng = np.random.default_rng(2)
    x = tokens(40, 256, jnp.bfloat16, rng)
    ids = rng.integers(-1, 4, (40, 2)).astype(np.int32)
    _, group_sizes, handle = permute(x, ids, 4)
    x2 = tokens(40, 256, jnp.bfloat16, rng)  # new rows through the same routing
    q, scale = permute_rows_fp8(x2, handle, group_sizes)
    assert_bit_identical(q, scale, permute_rows(x2, handle, group_sizes))
    q, scale, group_sizes, _ = permute_fp8_call(x, jnp.asarray(ids), 4, zero_tail=False)
    valid = int(group_sizes.sum())
    assert_bit_identical(q[:valid], scale[:valid], permute(x, ids, 4)[0][:valid])
    assert np.isnan(np.asarray(scale[valid:])).all()  # the CPU poisons the rows the caller promised not to read


def test_vmap_matches_each_problem():
    rng = np.random.default_rng(3)
    x = jnp.stack([tokens(20, 128, jnp.bfloat16, rng) for _ in range(2)])
    ids = rng.integers(-1, 3, (2, 20, 2)).astype(np.int32)
    q, scale, group_sizes, _ = jax.vmap(lambda a, b: permute_fp8(a, b, 3))(x, ids)
    for b in range(2):
        q_b, scale_b, gs_b, _ = permute_fp8(x[b], ids[b], 3)
        np.testing.assert_array_equal(group_sizes[b], gs_b)
        np.testing.assert_array_equal(bits(q[b]), bits(q_b))
        np.testing.assert_array_equal(bits(scale[b]), bits(scale_b))


@pytest.mark.parametrize("h", [0, 100, 192])
def test_width_not_a_multiple_of_128_is_refused(h):
    x = jnp.zeros((4, h), jnp.bfloat16)
    with pytest.raises(ValueError, match=rf"x \(T, H\) must have H a positive multiple of 128.*got H={h}"):
        permute_fp8(x, np.zeros((4, 1), np.int32), 2)
    if h:  # the kernels' contract refuses it too (a direct FFI call)
        with pytest.raises(Exception, match="permute_fp8: x's H must be a positive multiple of 128"):
            permute_fp8_call(x, jnp.zeros((4, 1), jnp.int32), 2)


def test_other_bad_input_names_the_argument():
    x = jnp.zeros((4, 128), jnp.bfloat16)
    with pytest.raises(ValueError, match="expert_ids"):
        permute_fp8(x, np.zeros((5, 1), np.int32), 2)
    with pytest.raises(TypeError, match="x"):
        permute_fp8(jnp.zeros((4, 128), jnp.int32), np.zeros((4, 1), np.int32), 2)
    with pytest.raises(TypeError, match="handle"):
        permute_rows_fp8(x, np.zeros((4, 1), np.int32), jnp.zeros((2,), jnp.int32))


# ---- permute_rows_fp8_call: the rows and their FP8 codes in one pass ----------------------------------------------

FP8 = {"e4m3": jnp.dtype(jnp.float8_e4m3fn), "e5m2": jnp.dtype(jnp.float8_e5m2)}


def routing(kind, t, k, e, rng):
    """int32 (T, k) expert ids: random with an empty expert and dropped copies (ids out of range), or every copy to
    one expert."""
    if kind == "one_expert":
        return np.full((t, k), e - 1, np.int32)
    ids = rng.integers(0, e, (t, k))
    ids[ids == 1] = 0                           # expert 1 empty
    ids[rng.random((t, k)) < 0.2] = e + 2       # out of range: dropped
    ids[::3, 0] = -1                            # dropped
    return ids.astype(np.int32)


def rows_fp8_case(t, h, k, e, dtype, kind, seed):
    """A backward's operands: the routing of a permute, and new rows d_y (T, H) to send through it."""
    rng = np.random.default_rng(seed)
    x = tokens(t, h, dtype, rng) if t >= 4 else jnp.asarray(rng.standard_normal((t, h)), dtype)
    _, group_sizes, handle = permute(x, routing(kind, t, k, e, rng), e)
    d_y = tokens(t, h, dtype, rng) if t >= 4 else jnp.asarray(rng.standard_normal((t, h)), dtype)
    return d_y, handle.row_index, group_sizes


def assert_rows_fp8_exact(rows, q, scale, x, row_index, group_sizes, fp8, zero_tail=True):
    """rows bit for bit permute_rows_call's; q and scale the jnp quantiser's of those rows on the group rows (and on
    the zero tail too: a zero row quantises to q 0, scale 1)."""
    want = permute_rows_call(x, row_index, group_sizes, zero_tail)
    n = row_index.size if zero_tail else int(np.maximum(np.asarray(group_sizes), 0).sum())
    assert rows.dtype == x.dtype and rows.shape == want.shape
    assert q.dtype == fp8 and q.shape == rows.shape
    assert scale.dtype == jnp.float32 and scale.shape == (rows.shape[0], rows.shape[1] // 128)
    np.testing.assert_array_equal(bits16(rows[:n]), bits16(want[:n]))
    q_ref, scale_ref = jax.jit(fp8_scaling.quantize_rows, static_argnums=1)(want[:n], fp8)
    np.testing.assert_array_equal(bits(scale[:n]), bits(scale_ref))
    np.testing.assert_array_equal(bits(q[:n]), bits(q_ref))


def bits16(a):
    a = np.asarray(a)
    return a.view({2: np.uint16, 4: np.uint32}[a.dtype.itemsize])


@pytest.mark.parametrize("fp8", FP8)
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32, jnp.float16])
@pytest.mark.parametrize("t, k, e, kind", [(67, 6, 9, "random"), (37, 1, 4, "random"), (45, 6, 64, "one_expert")])
def test_rows_fp8_matches_permute_rows_and_the_jnp_quantiser(t, k, e, kind, dtype, fp8):
    x, row_index, group_sizes = rows_fp8_case(t, 384, k, e, dtype, kind, seed=t * k + e)
    rows, q, scale = jax.jit(permute_rows_fp8_call, static_argnums=(3, 4))(x, row_index, group_sizes, True, FP8[fp8])
    assert_rows_fp8_exact(rows, q, scale, x, row_index, group_sizes, FP8[fp8])
    valid = int(group_sizes.sum())
    if kind == "one_expert":
        assert valid == t * k and int(group_sizes[e - 1]) == valid
    else:
        assert int(group_sizes[1]) == 0 and valid < t * k
    # past the groups: a zero row and its quantisation (the jnp quantiser's for an all-zero tile)
    assert not bits16(rows[valid:]).any() and not bits(q[valid:]).any() and np.all(np.asarray(scale[valid:]) == 1.0)
    np.testing.assert_array_equal(np.asarray(fp8_scaling.quantize_rows(jnp.zeros((1, 128)), FP8[fp8])[1]), [[1.0]])


@pytest.mark.parametrize("fp8", FP8)
def test_rows_fp8_unwritten_tail(fp8):
    x, row_index, group_sizes = rows_fp8_case(53, 256, 3, 5, jnp.bfloat16, "random", seed=7)
    rows, q, scale = permute_rows_fp8_call(x, row_index, group_sizes, zero_tail=False, dtype=FP8[fp8])
    assert_rows_fp8_exact(rows, q, scale, x, row_index, group_sizes, FP8[fp8], zero_tail=False)
    valid = int(group_sizes.sum())
    assert valid < rows.shape[0]
    # the CPU poisons the rows the caller promised not to read (the GPU leaves them unwritten)
    assert np.isnan(np.asarray(rows[valid:], np.float32)).all() and np.isnan(np.asarray(scale[valid:])).all()
    assert np.all(bits(q[valid:]) == 0xFF)


def test_rows_fp8_every_copy_dropped_and_no_tokens():
    x = tokens(9, 128, jnp.bfloat16, np.random.default_rng(8))
    row_index = jnp.full((9, 2), -1, jnp.int32)
    rows, q, scale = permute_rows_fp8_call(x, row_index, jnp.zeros((3,), jnp.int32))
    assert not bits16(rows).any() and not bits(q).any() and np.all(np.asarray(scale) == 1.0)
    for k in (1, 6):
        rows, q, scale = jax.jit(permute_rows_fp8_call)(jnp.zeros((0, 256), jnp.float16), jnp.zeros((0, k), jnp.int32),
                                                        jnp.zeros((4,), jnp.int32))
        assert (rows.shape, rows.dtype, q.shape, scale.shape) == ((0, 256), jnp.float16, (0, 256), (0, 2))


def test_rows_fp8_vmap_matches_each_problem():
    cases = [rows_fp8_case(21, 256, 2, 3, jnp.bfloat16, "random", seed=s) for s in range(2)]
    x, row_index, group_sizes = (jnp.stack(a) for a in zip(*cases))
    got = jax.vmap(permute_rows_fp8_call)(x, row_index, group_sizes)
    for b in range(2):
        for g, w in zip(got, permute_rows_fp8_call(x[b], row_index[b], group_sizes[b])):
            np.testing.assert_array_equal(bits16(g[b]) if g.dtype.itemsize > 1 else bits(g[b]),
                                          bits16(w) if w.dtype.itemsize > 1 else bits(w))


I32 = np.int32


@pytest.mark.parametrize("args, kwargs, err, match", [
    ((jnp.zeros((4, 192), jnp.bfloat16), np.zeros((4, 2), I32), np.zeros(3, I32)), {}, ValueError,
     r"x \(T, H\) must have H a positive multiple of 128.*got H=192"),
    ((jnp.zeros((4, 0), jnp.bfloat16), np.zeros((4, 2), I32), np.zeros(3, I32)), {}, ValueError, "got H=0"),
    ((jnp.zeros((4, 128), jnp.int32), np.zeros((4, 2), I32), np.zeros(3, I32)), {}, TypeError, "^x must be"),
    ((jnp.zeros((128,), jnp.float32), np.zeros((4, 2), I32), np.zeros(3, I32)), {}, ValueError, r"^x must be \(T, H\)"),
    ((jnp.zeros((4, 128)), np.zeros((5, 2), I32), np.zeros(3, I32)), {}, ValueError, "^row_index must be .* T=4"),
    ((jnp.zeros((4, 128)), np.zeros((4, 2), np.int64), np.zeros(3, I32)), {}, TypeError, "^row_index must be int32"),
    ((jnp.zeros((4, 128)), np.zeros((4, 2), np.float32), np.zeros(3, I32)), {}, TypeError, "^row_index must be int32"),
    ((jnp.zeros((4, 128)), np.zeros((4, 2), I32), np.zeros((1, 3), I32)), {}, ValueError, "^group_sizes must be"),
    ((jnp.zeros((4, 128)), np.zeros((4, 2), I32), np.zeros(3, np.float32)), {}, TypeError,
     "^group_sizes must be int32"),
    ((jnp.zeros((4, 128)), np.zeros((4, 2), I32), np.zeros(3, I32)), {"dtype": jnp.bfloat16}, TypeError,
     "^dtype must be float8_e4m3fn or float8_e5m2"),
    ((jnp.zeros((4, 128)), np.zeros((4, 2), I32), np.zeros(3, I32)), {"zero_tail": 1}, TypeError, "^zero_tail must be"),
])
def test_rows_fp8_bad_input_names_the_argument(args, kwargs, err, match):
    with pytest.raises(err, match=match):
        permute_rows_fp8_call(*args, **kwargs)


def _raw_rows_fp8(x, rows, q, scale, row_index=(4, 2), group_sizes=(3,)):
    spec = jax.ShapeDtypeStruct
    operands = (jnp.zeros(x[0], x[1]), jnp.zeros(row_index, jnp.int32), jnp.zeros(group_sizes, jnp.int32))
    return _ffi.ffi_call("turbo_moe_permute_rows_fp8", (spec(*rows), spec(*q), spec(*scale)), *operands,
                         zero_tail=True)


E4, F32, BF16 = jnp.float8_e4m3fn, jnp.float32, jnp.bfloat16


@pytest.mark.parametrize("call, match", [
    (lambda: _raw_rows_fp8(((4, 192), F32), ((8, 192), F32), ((8, 192), E4), ((8, 1), F32)),
     "permute_rows_fp8: x's H must be a positive multiple of 128 (the FP8 scale tiles), got H=192"),
    (lambda: _raw_rows_fp8(((4, 128), F32), ((8, 128), F32), ((8, 128), BF16), ((8, 1), F32)),
     "permute_rows_fp8: q must be float8_e4m3fn or float8_e5m2 and scale float32"),
    (lambda: _raw_rows_fp8(((4, 128), F32), ((8, 128), BF16), ((8, 128), E4), ((8, 1), F32)),
     "permute_rows_fp8: expected result rows [..., T*k, H] of x's dtype"),
    (lambda: _raw_rows_fp8(((4, 128), F32), ((7, 128), F32), ((8, 128), E4), ((8, 1), F32)),
     "permute_rows_fp8: expected result rows [..., T*k, H] of x's dtype"),
    (lambda: _raw_rows_fp8(((4, 128), F32), ((8, 128), F32), ((8, 128), E4), ((8, 2), F32)),
     "permute_rows_fp8: expected results q [..., T*k, H] and scale [..., T*k, H/128]"),
    (lambda: _raw_rows_fp8(((4, 128), F32), ((8, 128), F32), ((8, 128), E4), ((8, 1), F32), row_index=(5, 2)),
     "permute_rows_fp8: row_index must have T rows like x"),
])
def test_rows_fp8_contract_refuses_bad_calls(call, match):
    """A direct FFI call past the Python checks: the C++ contract (kernels/contracts/permute_fp8.h) refuses it."""
    with pytest.raises(Exception, match=re.escape(match)):
        call()
