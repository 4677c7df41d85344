"""router_topk (group-limited top-k with the causal sequence load penalty fused in) against a float64 numpy
loop and against the model's XLA path (`group_limited_topk` on `seq_load_penalized_selection`)."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from turbo_moe.model import get_config
from turbo_moe.model.router import group_limited_topk, seq_load_penalized_selection
from turbo_moe.ops import router_topk
from turbo_moe.ops.router_topk import SEQ_LOAD_PRIOR_TOKENS

NEAR = 1e-5  # a decision closer than this in float64 may go either way in float32


def reference(sel, bias, top_k, n_groups, topk_groups, penalty=0.0, chunk=128):
    """float64 loop: ids (B, S, k) and `near` (B, S), True where a decision of the token (the group cut, the
    order of its top k + 1) was closer than NEAR without being an exact tie."""
    sel, bias = np.asarray(sel, np.float64), np.asarray(bias, np.float64)
    B, S, E = sel.shape
    per, fair = E // n_groups, top_k / E
    ids = np.zeros((B, S, top_k), np.int32)
    near = np.zeros((B, S), bool)

    def close(gaps):
        return bool(np.any((gaps > 0) & (gaps < NEAR)))

    for b in range(B):
        counts = np.zeros(E)
        for start in range(0, S, chunk if penalty > 0 else max(S, 1)):
            share = (counts + fair * SEQ_LOAD_PRIOR_TOKENS) / ((start + SEQ_LOAD_PRIOR_TOKENS) * fair)
            for t in range(start, min(S, start + chunk) if penalty > 0 else S):
                v = sel[b, t] - penalty * np.maximum(share - 1, 0) + bias
                groups = v.reshape(n_groups, per)
                score = -np.sort(-groups, axis=1)[:, :min(2, per)].sum(1)
                order = np.argsort(-score, kind="stable")  # ties: lower group first
                kept = np.zeros(n_groups, bool)
                kept[order[:topk_groups]] = True
                ranked = np.sort(-score)
                if topk_groups < n_groups and close(ranked[topk_groups] - ranked[topk_groups - 1]):
                    near[b, t] = True
                masked = np.where(np.repeat(kept, per), v, -np.inf)
                best = np.argsort(-masked, kind="stable")
                ids[b, t] = best[:top_k]
                top = masked[best[:top_k + 1]]
                if close(-np.diff(top[np.isfinite(top)])):
                    near[b, t] = True
            if penalty > 0:
                np.add.at(counts, ids[b, start:start + chunk].ravel(), 1)
    return ids, near


def assert_matches_reference(got, sel, bias, *args, **kwargs):
    """Equal to the reference except at near-ties, which may go either way; once a near-tie went the other way,
    the later chunks of that sequence follow from different counts and are not compared."""
    expect, near = reference(sel, bias, *args, **kwargs)
    got = np.asarray(got)
    chunk = kwargs.get("chunk", 128) if kwargs.get("penalty", 0) > 0 else None
    compared = 0
    for b in range(expect.shape[0]):
        upto = expect.shape[1]
        other_way = near[b] & (np.sort(got[b], -1) != np.sort(expect[b], -1)).any(-1)
        if chunk and other_way.any():
            upto = (int(np.argmax(other_way)) // chunk + 1) * chunk
        ok = ~near[b, :upto]
        np.testing.assert_array_equal(got[b, :upto][ok], expect[b, :upto][ok], err_msg=f"sequence {b}")
        compared += int(ok.sum())
    assert compared >= 0.9 * expect.shape[0] * expect.shape[1], "too many near-ties: the test shows little"


def inputs(seed, B, S, E, skew=False):
    rng = np.random.default_rng(seed)
    sel = rng.uniform(0.0, 1.0, (B, S, E)).astype(np.float32)
    if skew:  # every token prefers expert 3, then E - 2
        sel[..., 3] += 0.6
        sel[..., E - 2] += 0.4
    return jnp.asarray(sel), jnp.asarray(rng.normal(0, 0.05, E).astype(np.float32))


SHAPES = {  # (E, top_k, n_groups, topk_groups)
    "reduced": (64, 6, 8, 4), "deepseek_v3": (256, 8, 8, 4), "one_group": (12, 3, 1, 1),
    "expert_per_group": (16, 4, 16, 8), "all_groups_kept": (8, 2, 4, 4), "k_fills_the_groups": (12, 6, 4, 2),
}


@pytest.mark.parametrize("penalty", [0.0, 0.1])
@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("S, chunk", [(200, 64), (45, 7), (1, 128), (30, 128)])  # odd, tiny, one token, one chunk
def test_matches_float64_reference(shape, penalty, S, chunk):
    E, k, G, tg = SHAPES[shape]
    if E == 256 and S == 200:
        S = 96  # keep the float64 loop quick
    sel, bias = inputs(E + S + chunk, 2, S, E, skew=True)
    got = router_topk(sel, bias, top_k=k, n_groups=G, topk_groups=tg, penalty=penalty, chunk=chunk)
    assert got.dtype == jnp.int32 and got.shape == (2, S, k)
    assert_matches_reference(got, sel, bias, k, G, tg, penalty=penalty, chunk=chunk)


@pytest.mark.parametrize("shape", ["reduced", "deepseek_v3", "one_group", "expert_per_group"])
@pytest.mark.parametrize("penalty, chunk", [(0.0, 128), (0.1, 16), (0.3, 50)])
def test_matches_the_model_xla_path(shape, penalty, chunk):
    """Bit-for-bit the same float32 steps as XLA:CPU's program: equal picks, in order, near-ties included."""
    E, k, G, tg = SHAPES[shape]
    sel, bias = inputs(E + chunk, 3, 160, E, skew=shape == "reduced")
    cfg = get_config("tiny", n_experts=E, top_k=k, n_groups=G, topk_groups=tg, max_seq_len=160)

    @jax.jit
    def xla(sel, bias):
        select = seq_load_penalized_selection(sel, bias, cfg, penalty, chunk) if penalty > 0 else sel
        return group_limited_topk(select, bias, top_k=k, n_groups=G, topk_groups=tg)

    got = router_topk(sel, bias, top_k=k, n_groups=G, topk_groups=tg, penalty=penalty, chunk=chunk)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(xla(sel, bias)))


def test_the_penalty_spreads_a_sequence_that_prefers_one_expert():
    E, k, G, tg = SHAPES["reduced"]
    sel, bias = inputs(7, 2, 512, E)
    sel = sel.at[..., 3].add(1.0).at[..., 2].add(0.8)  # group 0 and its experts 3 and 2 first, every token
    plain = np.asarray(router_topk(sel, bias, top_k=k, n_groups=G, topk_groups=tg))
    spread = router_topk(sel, bias, top_k=k, n_groups=G, topk_groups=tg, penalty=0.5, chunk=32)
    assert (plain == 3).any(-1).all()  # without the penalty every token takes expert 3
    busiest = np.bincount(np.asarray(spread).ravel(), minlength=E).max()
    assert busiest < 0.5 * np.bincount(plain.ravel(), minlength=E).max()
    assert (np.asarray(spread)[:, :32] == plain[:, :32]).all()  # the first chunk has no past
    assert_matches_reference(spread, sel, bias, k, G, tg, penalty=0.5, chunk=32)


@pytest.mark.parametrize("shape", ["reduced", "one_group", "expert_per_group", "k_fills_the_groups"])
def test_exact_ties_go_to_the_lower_index(shape):
    """Values on a coarse grid (exact in float32): many tied experts and tied groups."""
    E, k, G, tg = SHAPES[shape]
    rng = np.random.default_rng(E)
    sel = jnp.asarray(rng.integers(0, 4, (2, 64, E)) / 4, jnp.float32)
    bias = jnp.asarray(rng.integers(-1, 2, E) / 8, jnp.float32)
    got = router_topk(sel, bias, top_k=k, n_groups=G, topk_groups=tg)
    expect, near = reference(sel, bias, k, G, tg)
    assert not near.any()
    np.testing.assert_array_equal(np.asarray(got), expect)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(
        group_limited_topk(sel, bias, top_k=k, n_groups=G, topk_groups=tg)))
    tied = jnp.zeros((1, 3, E), jnp.float32)  # everything tied: the first k experts of the first groups
    np.testing.assert_array_equal(np.asarray(router_topk(tied, jnp.zeros(E), top_k=k, n_groups=G,
                                                         topk_groups=tg))[0, 0], np.arange(k))


@pytest.mark.parametrize("B, S", [(2, 0), (0, 5)])
def test_empty(B, S):
    out = router_topk(jnp.zeros((B, S, 64)), jnp.zeros(64), top_k=6, n_groups=8, topk_groups=4, penalty=0.1)
    assert out.shape == (B, S, 6) and out.dtype == jnp.int32


def test_vmap_and_jit():
    E, k, G, tg = SHAPES["reduced"]
    sel, _ = inputs(3, 6, 40, E, skew=True)
    sel = sel.reshape(3, 2, 40, E)
    biases = jnp.asarray(np.random.default_rng(4).normal(0, 0.3, (3, E)), jnp.float32)
    fn = functools.partial(router_topk, top_k=k, n_groups=G, topk_groups=tg, penalty=0.2, chunk=16)
    loop = np.stack([np.asarray(fn(sel[i], biases[i])) for i in range(3)])
    np.testing.assert_array_equal(np.asarray(jax.jit(jax.vmap(fn))(sel, biases)), loop)
    shared = np.stack([np.asarray(fn(sel[i], biases[0])) for i in range(3)])  # bias not batched: broadcast
    np.testing.assert_array_equal(np.asarray(jax.vmap(fn, in_axes=(0, None))(sel, biases[0])), shared)
    np.testing.assert_array_equal(np.asarray(jax.jit(fn)(sel[1], biases[1])), loop[1])


def test_safe_under_grad():
    """Integer ids of stop-gradient inputs: a surrounding gradient flows through the gathered scores only."""
    E, k, G, tg = SHAPES["reduced"]
    sel, bias = inputs(5, 2, 24, E)

    def loss(s, ids=None):
        ids = router_topk(s, bias, top_k=k, n_groups=G, topk_groups=tg, penalty=0.1, chunk=8) if ids is None else ids
        return jnp.sum(jnp.take_along_axis(s, ids, axis=-1) ** 2)

    ids = router_topk(sel, bias, top_k=k, n_groups=G, topk_groups=tg, penalty=0.1, chunk=8)
    np.testing.assert_allclose(np.asarray(jax.jit(jax.grad(loss))(sel)), np.asarray(jax.grad(loss)(sel, ids)))


@pytest.mark.parametrize("args, kwargs, error, match", [
    ((jnp.zeros((1, 4, 8), jnp.bfloat16), jnp.zeros(8)), {}, TypeError, "selection must be float32"),
    ((jnp.zeros((1, 4, 8)), jnp.zeros(8, jnp.int32)), {}, TypeError, "bias must be float32"),
    ((jnp.zeros((4, 8)), jnp.zeros(8)), {}, ValueError, r"selection must have rank 3 \(B, S, E\)"),
    ((jnp.zeros((1, 4, 8)), jnp.zeros(7)), {}, ValueError, r"bias must have shape \(E,\)"),
    ((jnp.zeros((1, 4, 8)), jnp.zeros(8)), {"n_groups": 3}, ValueError, "n_groups=3 must divide"),
    ((jnp.zeros((1, 4, 8)), jnp.zeros(8)), {"topk_groups": 5}, ValueError, "topk_groups must be in"),
    ((jnp.zeros((1, 4, 8)), jnp.zeros(8)), {"top_k": 5}, ValueError, r"top_k must be in \[1, 4\]"),
    ((jnp.zeros((1, 4, 8)), jnp.zeros(8)), {"top_k": 2.0}, TypeError, "top_k must be a Python int"),
    ((jnp.zeros((1, 4, 8)), jnp.zeros(8)), {"penalty": -0.1}, ValueError, "penalty must be"),
    ((jnp.zeros((1, 4, 8)), jnp.zeros(8)), {"penalty": float("nan")}, ValueError, "penalty must be"),
    ((jnp.zeros((1, 4, 8)), jnp.zeros(8)), {"chunk": 0}, ValueError, "chunk must be in"),
    ((jnp.zeros((1, 4, 128)), jnp.zeros(128)), {"top_k": 33, "n_groups": 1, "topk_groups": 1}, ValueError,
     r"top_k must be in \[1, 32\]"),
])
def test_bad_arguments_name_themselves(args, kwargs, error, match):
    kwargs = {"top_k": 2, "n_groups": 4, "topk_groups": 2, **kwargs}
    with pytest.raises(error, match=match):
        router_topk(*args, **kwargs)
