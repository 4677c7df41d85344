"""fused_dispatch / fused_combine (the expert-parallel transport's protocol, its CPU reference) on forced host devices:
bit-equal to moe_dispatch's packed layout + permute + grouped GEMM + unpermute + moe_combine (the same rows in the
same order, the same outputs and gradients) at EP = 2, 4, 8, with skewed routing, an empty rank, a capacity, a
worst-case buffer exactly full, and a buffer too small (an error the caller sees, never a silent drop)."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, PartitionSpec as P

from tests.ops.test_moe_dispatch_layouts import mesh_of, problem, reference
from turbo_moe.ops import grouped_gemm, moe_combine, moe_dispatch, permute, unpermute
from turbo_moe.ops.fused_dispatch import (ReceiveBufferOverflow, check_receive_buffer, fused_combine, fused_dispatch,
                                          worst_case_rows)

ROUTINGS = ("uniform", "skew", "empty_rank")  # skew: every copy to rank 0; empty_rank: the last rank gets nothing


def fused_layer(E, capacity, recv_rows, dtype):
    def layer(x, ids, w, W):
        xs, sizes, recv_w, handle = fused_dispatch(x.astype(dtype), ids, w, num_experts=E, axis_name="expert",
                                                   capacity=capacity, recv_rows=recv_rows)
        out = fused_combine(grouped_gemm(xs, W.astype(dtype), sizes), recv_w, handle, axis_name="expert")
        return out.astype(jnp.float32), (xs, sizes, handle.rows, recv_w, handle.overflow, handle.lost_rows[None])
    return layer


def packed_layer(E, capacity, dtype, n_local):
    """Today's exchange at its packed layout: the reference the fused transport must equal bit for bit."""
    def layer(x, ids, w, W):
        rx, rids, recv_w, handle = moe_dispatch(x.astype(dtype), ids, w, num_experts=E, axis_name="expert",
                                                capacity=capacity, layout="packed")
        xs, sizes, ph = permute(rx, rids, n_local)
        out = moe_combine(unpermute(grouped_gemm(xs, W.astype(dtype), sizes), ph, recv_w), handle, axis_name="expert")
        return out.astype(jnp.float32), (xs, sizes, ph.row_index, recv_w, handle.overflow, jnp.zeros((1,), jnp.int32))
    return layer


@functools.lru_cache(maxsize=None)
def both_paths(mesh, E, capacity=None, recv_rows=None, dtype=jnp.float32):
    """jit of (x, w, W, ids, probe) -> for the fused and the packed layer: ((loss, (out, extras)), grads wrt x, w, W).
    Tokens are split over every mesh axis, the experts over "expert"."""
    tokens = P(tuple(mesh.axis_names))
    n_local = E // dict(mesh.shape)["expert"]

    def grads_of(layer):
        sharded = jax.shard_map(layer, mesh=mesh, in_specs=(tokens, tokens, tokens, P("expert")),
                                out_specs=(tokens, (tokens,) * 6))

        def loss(x, w, W, ids, probe):
            out, extras = sharded(x, ids, w, W)
            return jnp.sum(out * probe), (out, extras)
        return jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True)

    fused = grads_of(fused_layer(E, capacity, recv_rows, dtype))
    packed = grads_of(packed_layer(E, capacity, dtype, n_local))
    return jax.jit(lambda *args: (fused(*args), packed(*args)))


def run_both(mesh, E, x, ids, w, W, **kw):
    probe = jnp.asarray(np.random.default_rng(0).normal(size=(x.shape[0], W.shape[-1])), jnp.float32)
    return jax.tree.map(np.asarray, both_paths(mesh, E, **kw)(x, w, W, ids, probe))


def assert_bit_equal(fused, packed, what):
    (f_loss, (f_out, f_extra)), f_grads = fused
    (p_loss, (p_out, p_extra)), p_grads = packed
    names = ("x_sorted rows", "group sizes", "row index", "received weights", "overflow")
    for name, a, b in zip(names, f_extra, p_extra):
        np.testing.assert_array_equal(a, b, err_msg=f"{what}: {name}")
    np.testing.assert_array_equal(f_out, p_out, err_msg=f"{what}: outputs")
    for name, a, b in zip(("d_x", "d_w", "d_W"), f_grads, p_grads):
        np.testing.assert_array_equal(a, b, err_msg=f"{what}: {name}")
    assert f_loss == p_loss


@pytest.mark.parametrize("ranks", [2, 4, 8])
def test_bit_equal_to_packed_dispatch_and_permute(ranks):
    E, T, k = 3 * ranks, 7, 2
    mesh = mesh_of(ranks)
    for routing in ROUTINGS:
        x, ids, w, W = problem(ranks, ranks, T, k, E, routing)
        fused, packed = run_both(mesh, E, x, ids, w, W)
        assert_bit_equal(fused, packed, f"EP={ranks} {routing}")
        out, (_, sizes, _, _, overflow, lost) = fused[0][1]
        np.testing.assert_allclose(out, reference(x, ids, w, W), rtol=1e-5, atol=1e-5, err_msg=routing)
        assert overflow.sum() == 0 and lost.sum() == 0
        sizes = sizes.reshape(ranks, E // ranks)
        if routing == "skew":  # rank 0 computes every copy, the others none
            assert sizes[0].sum() == ranks * T * k and sizes[1:].sum() == 0
        if routing == "empty_rank":  # the last rank receives nothing, and its own tokens send nothing
            assert sizes[-1].sum() == 0
            np.testing.assert_array_equal(out[(ranks - 1) * T:], 0.0)


def test_rows_are_the_default_layouts_rows():
    """The fused buffer holds the rows, in the order, that the dense layout (moe_dispatch's default at EP <= 4, here
    through all_gather) + permute gives."""
    ranks, E, T, k = 4, 8, 6, 3
    x, ids, w, _ = problem(2, ranks, T, k, E)

    def both(x, ids, w):
        xs, sizes, _, _ = fused_dispatch(x, ids, w, num_experts=E, axis_name="expert")
        rx, rids, _, _ = moe_dispatch(x, ids, w, num_experts=E, axis_name="expert", layout="dense",
                                      dense_via="all_gather")
        dense_xs, dense_sizes, _ = permute(rx, rids, E // ranks)
        return xs, sizes, dense_xs, dense_sizes

    spec = P("expert")
    got = jax.jit(jax.shard_map(both, mesh=mesh_of(ranks), in_specs=(spec,) * 3, out_specs=(spec,) * 4))(x, ids, w)
    np.testing.assert_array_equal(np.asarray(got[0]), np.asarray(got[2]))
    np.testing.assert_array_equal(np.asarray(got[1]), np.asarray(got[3]))


def test_capacity_and_data_parallel_axis_bit_equal():
    """A (data 2, expert 2) mesh, as the model runs, with half the packet slots: every source's first C tokens reach
    rank 0 (the rest counted in overflow, as moe_dispatch counts them); still bit-equal, gradients summed over data."""
    mesh = Mesh(np.array(jax.devices()[:4]).reshape(2, 2), ("data", "expert"))
    E, T, k, cap = 8, 9, 2, 5
    x, ids, w, W = problem(3, 4, T, k, E, routing="skew")  # pool E // 4: experts of expert-rank 0 only
    fused, packed = run_both(mesh, E, x, ids, w, W, capacity=cap)
    assert_bit_equal(fused, packed, "capacity")
    overflow = fused[0][1][1][4].reshape(4, 2)  # (device, destination rank)
    np.testing.assert_array_equal(overflow[:, 0], T - cap)
    keep = (np.arange(4 * T) % T < cap)[:, None] & np.ones((1, k), bool)
    np.testing.assert_allclose(fused[0][1][0], reference(x, ids, w, W, keep), rtol=1e-5, atol=1e-5)


def test_bfloat16_bit_equal():
    ranks, E, T, k = 2, 4, 8, 2
    x, ids, w, W = problem(4, ranks, T, k, E)
    fused, packed = run_both(mesh_of(ranks), E, x, ids, w, W, dtype=jnp.bfloat16)
    assert_bit_equal(fused, packed, "bfloat16")


def test_full_buffer_then_one_row_short_is_an_error():
    """Every copy of both ranks routed to rank 0: its worst-case buffer (P*T*k rows) is exactly full and loses
    nothing. One row less loses exactly the last copy of the last group: the returned count says so, and the check
    raises."""
    ranks, E, T, k = 2, 4, 5, 2
    mesh = mesh_of(ranks)
    x, ids, w, W = problem(6, ranks, T, k, E, routing="skew")
    worst = worst_case_rows(ranks, T, k)
    full = run_both(mesh, E, x, ids, w, W)[0]
    _, sizes, rows, _, _, lost = full[0][1][1]
    assert sizes[:E // ranks].sum() == worst and lost.sum() == 0
    assert (rows[:ranks * T] >= 0).all(), "every packet rank 0 received has a row for each copy"
    check_receive_buffer(lost, worst)  # nothing lost: no error

    short = run_both(mesh, E, x, ids, w, W, recv_rows=worst - 1)[0]
    out, (_, sizes, _, _, _, lost) = short[0][1]
    np.testing.assert_array_equal(lost, [1, 0])
    assert sizes[:E // ranks].sum() == worst - 1
    with pytest.raises(ReceiveBufferOverflow, match=f"recv_rows={worst - 1} rows lost 1 copies"):
        check_receive_buffer(lost, worst - 1)
    # The lost copy is the last row of the expert-sorted order: the last token (of the last source) of the last
    # expert anyone picked. It contributes nothing, and its weight gets no gradient.
    ids_np = np.asarray(ids)
    last_expert = ids_np.max()
    t, j = max(zip(*np.nonzero(ids_np == last_expert)))
    keep = np.ones(ids_np.shape, bool)
    keep[t, j] = False
    np.testing.assert_allclose(out, reference(x, ids, w, W, keep), rtol=1e-5, atol=1e-5)
    d_w = short[1][1]
    assert d_w[t, j] == 0.0 and np.count_nonzero(d_w) == d_w.size - 1


def test_bad_arguments_are_named():
    mesh = mesh_of(2)
    x, ids, w, _ = problem(1, 2, 4, 2, 6)

    def trace(fn):
        jax.eval_shape(jax.shard_map(fn, mesh=mesh, in_specs=(P("expert"),) * 3, out_specs=P("expert")), x, ids, w)

    def dispatch(**kw):
        return lambda x, ids, w: fused_dispatch(x, ids, w, axis_name="expert", **{"num_experts": 6, **kw})[0]

    with pytest.raises(ValueError, match="num_experts=5 must be divisible"):
        trace(dispatch(num_experts=5))
    with pytest.raises(ValueError, match=r"capacity must be in \[1, 4\]"):
        trace(dispatch(capacity=5))
    with pytest.raises(ValueError, match=r"recv_rows must be in \[1, 16\]"):  # 2 ranks x 4 slots x top-2
        trace(dispatch(recv_rows=17))
    with pytest.raises(ValueError, match=r"recv_rows must be in \[1, 16\]"):
        trace(dispatch(recv_rows=0))
    with pytest.raises(TypeError, match="weights must be a float array"):
        trace(lambda x, ids, w: fused_dispatch(x, ids, ids, num_experts=6, axis_name="expert")[0])
    with pytest.raises(ValueError, match="disagree"):
        trace(lambda x, ids, w: fused_dispatch(x, ids, w[:, :1], num_experts=6, axis_name="expert")[0])

    def combine(rows_off=0, handle=None):
        def fn(x, ids, w):
            xs, _, recv_w, h = fused_dispatch(x, ids, w, num_experts=6, axis_name="expert")
            return fused_combine(xs[rows_off:], recv_w, handle or h, axis_name="expert")
        return fn

    with pytest.raises(ValueError, match="y_sorted must have the dispatch's recv_rows=16 rows"):
        trace(combine(rows_off=1))
    with pytest.raises(TypeError, match="handle must be the FusedHandle"):
        trace(combine(handle=("not", "a", "handle")))
