"""moe_dispatch / moe_combine layouts (dense, packed, ragged) on forced host devices: each equals the
one-device result and the others, forward and backward, with skewed routing, empty ranks, invalid ids,
capacities and sizes that are not multiples of 8; plus the chunked ragged exchange underneath."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, PartitionSpec as P

from turbo_moe.ops import grouped_gemm, moe_combine, moe_dispatch, permute, unpermute
from turbo_moe.ops.ragged_exchange import ragged_exchange, split_updates

H, F = 7, 5
# "dense/<via>": the dense layout with x moved by a named collective (turbo_moe.ops.dense_exchange);
# "dense" is dense_via="auto" (permute at 2 ranks, all_gather beyond)
LAYOUTS = ("dense", "dense/all_gather", "dense/all_to_all", "dense/permute", "packed", "ragged")


def mesh_of(ranks):
    if jax.device_count() < ranks:
        pytest.skip(f"needs {ranks} devices (XLA_FLAGS=--xla_force_host_platform_device_count)")
    return Mesh(np.array(jax.devices()[:ranks]), ("expert",))


def ep_layer(ranks, num_experts, layout, capacity=None, dtype=jnp.float32):
    """Token-sharded MoE layer, experts sharded over `expert`: (out, overflow, counts, layout used)."""
    layout, _, via = layout.partition("/")

    def layer(x, ids, w, W):
        rx, rids, rw, handle = moe_dispatch(x.astype(dtype), ids, w, num_experts=num_experts, axis_name="expert",
                                            capacity=capacity, layout=layout, dense_via=via or "auto")
        xs, sizes, ph = permute(rx, rids, num_experts // ranks)
        y = unpermute(grouped_gemm(xs, W.astype(dtype), sizes), ph, rw)
        return moe_combine(y, handle, axis_name="expert").astype(jnp.float32), handle.overflow, handle.counts

    spec = P("expert")
    return jax.jit(jax.shard_map(layer, mesh=mesh_of(ranks), in_specs=(spec,) * 4, out_specs=(spec,) * 3))


def reference(x, ids, w, W, keep=None):
    """float64 one-device MoE: sum_j w[t, j] * x[t] @ W[ids[t, j]] over valid (kept) copies."""
    x, w, W, ids = [np.asarray(a, np.float64) for a in (x, w, W)] + [np.asarray(ids)]
    valid = (ids >= 0) & (ids < W.shape[0]) if keep is None else keep
    per_copy = np.einsum("th,tkhf->tkf", x, W[np.clip(ids, 0, W.shape[0] - 1)])
    return np.einsum("tk,tkf->tf", np.where(valid, w, 0.0), per_copy)


def problem(seed, ranks, T, k, E, routing="uniform"):
    """routing: uniform | skew (every expert on rank 0) | empty_rank (no token reaches the last rank,
    and the last rank's own tokens have only invalid ids)."""
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(ranks * T, H)).astype(np.float32)
    pool = {"uniform": E, "skew": E // ranks, "empty_rank": E - E // ranks}[routing]
    ids = np.stack([rng.choice(pool, k, replace=False) for _ in range(ranks * T)]).astype(np.int32)
    if routing == "empty_rank":
        ids[(ranks - 1) * T:] = np.where(rng.random((T, k)) < 0.5, -1, E + 3)  # out of range: dropped
    w = rng.random((ranks * T, k)).astype(np.float32)
    W = (rng.normal(size=(E, H, F)) / np.sqrt(H)).astype(np.float32)
    return tuple(jnp.asarray(a) for a in (x, ids, w, W))


@pytest.mark.parametrize("ranks", [2, 4, 8])
@pytest.mark.parametrize("routing", ["uniform", "skew", "empty_rank"])
def test_layouts_match_one_device_and_each_other(ranks, routing):
    E, T, k = 3 * ranks, 13, 2  # T, H, F: not multiples of 8
    x, ids, w, W = problem(ranks + 10, ranks, T, k, E, routing)
    ref = reference(x, ids, w, W)
    outs = {}
    for layout in LAYOUTS:
        out, overflow, counts = ep_layer(ranks, E, layout)(x, ids, w, W)
        np.testing.assert_allclose(np.asarray(out), ref, rtol=1e-5, atol=1e-5, err_msg=layout)
        assert int(overflow.sum()) == 0, layout
        outs[layout] = (np.asarray(out), np.asarray(counts))
    for via in ("dense/all_gather", "dense/all_to_all", "dense/permute"):  # same tokens counted as sent
        np.testing.assert_array_equal(outs[via][1], outs["dense"][1])
    np.testing.assert_array_equal(outs["dense"][1], outs["packed"][1])
    np.testing.assert_array_equal(outs["ragged"][1], outs["packed"][1])
    np.testing.assert_array_equal(outs["ragged"][0], outs["packed"][0])  # same rows, same sums
    if routing == "empty_rank":  # nothing reaches the last rank, and its tokens send nothing
        counts = outs["dense"][1].reshape(ranks, ranks)
        assert counts[:, -1].sum() == 0 and counts[-1].sum() == 0
        np.testing.assert_array_equal(outs["dense"][0][(ranks - 1) * T:], 0.0)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("ranks", [2, 4])
def test_layout_gradients_match_one_device(layout, ranks):
    E, T, k = 2 * ranks, 9, 2
    x, ids, w, W = problem(3, ranks, T, k, E)
    f = ep_layer(ranks, E, layout)
    grads = jax.grad(lambda x, w, W: jnp.sum(f(x, ids, w, W)[0] ** 2), argnums=(0, 1, 2))(x, w, W)

    def ref_loss(x, w, W):
        per_copy = jnp.einsum("th,tkhf->tkf", x, W[ids])
        return jnp.sum(jnp.einsum("tk,tkf->tf", w, per_copy) ** 2)

    ref = jax.grad(ref_loss, argnums=(0, 1, 2))(x, w, W)
    for g, r in zip(grads, ref):
        np.testing.assert_allclose(np.asarray(g), np.asarray(r), rtol=1e-4, atol=1e-5)


def test_layouts_are_deterministic():
    x, ids, w, W = problem(5, 4, 11, 3, 12)
    for layout in LAYOUTS:
        f = ep_layer(4, 12, layout)
        g = jax.jit(jax.grad(lambda x, w: jnp.sum(f(x, ids, w, W)[0] ** 2), argnums=(0, 1)))
        first, second = g(x, w), g(x, w)
        for a, b in zip(first, second):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=layout)


@pytest.mark.parametrize("ranks", [2, 4])
@pytest.mark.parametrize("dense", ["dense/all_gather", "dense/all_to_all", "dense/permute"])
def test_bfloat16_dense_sums_once(ranks, dense):
    """bf16: the dense combine (reduce-scatter at 2 ranks, else a float32 sum of what all_to_all or the
    permutes bring) equals the packed one (unpermute, float32) to rounding; both near the float64 result."""
    E, T, k = 2 * ranks, 16, 3
    x, ids, w, W = problem(8, ranks, T, k, E)
    ref = reference(x.astype(jnp.bfloat16), ids, w, W.astype(jnp.bfloat16))
    dense = np.asarray(ep_layer(ranks, E, dense, dtype=jnp.bfloat16)(x, ids, w, W)[0])
    packed = np.asarray(ep_layer(ranks, E, "packed", dtype=jnp.bfloat16)(x, ids, w, W)[0])
    np.testing.assert_allclose(dense, packed, rtol=1e-2, atol=1e-2)
    scale = np.linalg.norm(ref)
    assert np.linalg.norm(dense - ref) / scale < 1e-2 and np.linalg.norm(packed - ref) / scale < 1e-2


def test_ragged_capacity_overflow_matches_packed():
    ranks, E, T, k, cap = 2, 4, 9, 2, 5
    x, ids, w, W = problem(3, ranks, T, k, E, routing="skew")  # every token of both ranks -> rank 0
    got = {layout: ep_layer(ranks, E, layout, capacity=cap)(x, ids, w, W) for layout in ("packed", "ragged")}
    for a, b in zip(got["packed"], got["ragged"]):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    np.testing.assert_array_equal(np.asarray(got["ragged"][1]).reshape(ranks, ranks)[:, 0], T - cap)
    keep = np.zeros((ranks * T, k), bool)
    for r in range(ranks):
        keep[r * T: r * T + cap] = True  # the first `cap` tokens of each source rank fit
    np.testing.assert_allclose(np.asarray(got["ragged"][0]), reference(x, ids, w, W, keep), rtol=1e-5, atol=1e-5)


def test_auto_layout_and_bad_layouts_are_named():
    mesh = mesh_of(2)

    def handle_of(mesh=mesh, **kw):  # the handle's static fields: what the dispatch picked while tracing
        seen = []
        x, ids, w, _ = problem(1, mesh.size, 4, 2, 6)

        def f(x, ids, w):
            handle = moe_dispatch(x, ids, w, num_experts=6, axis_name="expert", **kw)[3]
            seen.append((handle.layout, handle.dense_via))
            return x

        jax.shard_map(f, mesh=mesh, in_specs=(P("expert"),) * 3, out_specs=P("expert"))(x, ids, w)
        return seen[0]

    def layout_of(**kw):
        return handle_of(**kw)[0]

    # the faster exchange and layer on four H200s at EP 2 and 4 (module doc): dense, by permutes at 2 ranks
    assert handle_of() == ("dense", "permute")
    assert handle_of(mesh=mesh_of(3), dense_via="auto") == ("dense", "all_gather")
    assert handle_of(dense_via="all_to_all") == ("dense", "all_to_all")
    assert layout_of(capacity=2) == "packed"  # capped slots: only the packed layout has them
    assert layout_of(layout="dense") == "dense"
    with pytest.raises(ValueError, match="layout='dense'.*capacity must be T=4"):
        layout_of(capacity=2, layout="dense")
    with pytest.raises(ValueError, match="layout must be one of"):
        layout_of(layout="sparse")
    with pytest.raises(ValueError, match="dense_via must be one of"):
        layout_of(layout="dense", dense_via="broadcast")


@pytest.mark.parametrize("n_chunks", [1, 3, 8])
def test_split_updates_cover_each_block_once(n_chunks):
    sizes = jnp.array([0, 1, 7, 13, 8], jnp.int32)
    offsets_in = jnp.array([0, 2, 10, 20, 40], jnp.int32)
    offsets_out = offsets_in + 100
    a, s, o = (np.asarray(v).reshape(5, n_chunks) for v in split_updates(offsets_in, sizes, offsets_out, n_chunks))
    for p in range(5):
        rows = np.concatenate([np.arange(a[p, j], a[p, j] + s[p, j]) for j in range(n_chunks)])
        np.testing.assert_array_equal(rows, np.arange(offsets_in[p], offsets_in[p] + sizes[p]))
        np.testing.assert_array_equal(o[p] - a[p], 100)
        assert (s[p] >= 0).all()


@pytest.mark.parametrize("chunks", [1, 3, None])
def test_ragged_exchange_is_the_same_for_any_chunking(monkeypatch, chunks):
    """The slot plan of the ragged layout through the emulated collective, chunked 1, 3 or the default
    (`chunks_per_peer`) ways: every real row lands in its slot, the rest stay zero; the backward is the reverse."""
    import importlib

    from turbo_moe.ops.moe_dispatch import slot_plan

    ragged_exchange_module = importlib.import_module("turbo_moe.ops.ragged_exchange")  # the package's name: the op

    assert ragged_exchange_module.chunks_per_peer(4) == ragged_exchange_module.UPDATES_IN_FLIGHT // 4
    assert ragged_exchange_module.chunks_per_peer(4 * ragged_exchange_module.UPDATES_IN_FLIGHT) == 1
    if chunks is not None:
        monkeypatch.setattr(ragged_exchange_module, "chunks_per_peer", lambda n_ranks: chunks)
    ranks, C = 4, 6
    counts = jnp.asarray(np.random.default_rng(0).integers(0, C + 1, (ranks, ranks)), jnp.int32)  # (src, dst)
    x = jnp.asarray(np.random.default_rng(1).normal(size=(ranks * ranks * C, 3)), jnp.float32)

    def f(x, counts):
        plan = slot_plan(counts[0], C, "expert")
        return ragged_exchange(x, plan, ranks * C, "expert", "emulated")

    g = jax.jit(jax.shard_map(f, mesh=mesh_of(ranks), in_specs=(P("expert"),) * 2, out_specs=P("expert")))
    got = np.asarray(g(x, counts)).reshape(ranks, ranks, C, 3)  # (dst, src, slot, H)
    sent = np.asarray(x).reshape(ranks, ranks, C, 3)  # (src, dst, slot, H)
    for d in range(ranks):
        for s in range(ranks):
            n = int(counts[s, d])
            np.testing.assert_array_equal(got[d, s, :n], sent[s, d, :n])
            np.testing.assert_array_equal(got[d, s, n:], 0.0)
    d_x = jax.grad(lambda x: jnp.sum(g(x, counts) * jnp.arange(3.0)))(x)
    mask = (np.arange(C)[None, None, :] < np.asarray(counts)[:, :, None])[..., None]  # (src, dst, slot, 1)
    np.testing.assert_array_equal(np.asarray(d_x).reshape(ranks, ranks, C, 3), mask * np.arange(3.0))

