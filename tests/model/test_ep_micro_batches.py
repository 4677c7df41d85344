"""ModelConfig.ep_micro_batches: each rank's tokens in micro-batches, one's exchange beside another's experts.

The results equal one batch's (loss, outputs, stats, gradients) on CPU host devices, and the traced program has the
order `ep_exchange.micro_batched` promises: micro-batch 1's dispatch after micro-batch 0's (two collectives XLA
cannot merge) and independent of micro-batch 0's experts (so they can run side by side), and so on.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.extend.core import Var

from tests.model.conftest import requires_turbo
from tests.model.test_expert_parallel import assert_close, loss_and_grads, make_mesh, problem
from turbo_moe.model import get_config
from turbo_moe.model.ep_exchange import PHASE_NAMES
from turbo_moe.model.expert_parallel import ep_moe_path
from turbo_moe.model.moe_layer import MoELayer

CF = 1.25
# (path, ep_exchange): turbo's two exchanges run phased; dense_cf's all_to_all runs its micro-batches in turn
CASES = [pytest.param("turbo", "deepep", marks=requires_turbo),
         pytest.param("turbo", "ragged_all_to_all", marks=requires_turbo),
         ("ragged", "ragged_all_to_all"), pytest.param("dense_cf", "deepep", marks=requires_turbo)]


@pytest.mark.parametrize("expert", [2, 4])
@pytest.mark.parametrize("path,exchange", CASES)
def test_micro_batches_equal_one_batch(path, exchange, expert):
    x, routing, experts = problem(seed=expert)
    mesh = make_mesh(1, expert)
    ref = loss_and_grads(ep_moe_path(path, mesh=mesh, capacity_factor=CF, ep_exchange=exchange), x, routing, experts)
    for n in (2,) if path == "dense_cf" else (2, 4):  # dense_cf: whole sequences, 2 a rank at EP=4
        path_fn = ep_moe_path(path, mesh=mesh, capacity_factor=CF, ep_exchange=exchange, ep_micro_batches=n)
        got = loss_and_grads(path_fn, x, routing, experts)
        for name, a, e in zip(("loss", "y", "stats", "grads"), got, ref):
            assert_close(a, e, f"{path}/{exchange} EP={expert}, {n} micro-batches: {name}")


@requires_turbo
def test_moe_layer_with_micro_batches_equals_one_batch():
    """The model's MoE layer (router, shared expert, turbo over deepep) under an EP=2 mesh: same output and gradients
    of every parameter."""
    mesh = make_mesh(2, 2)
    x = jnp.asarray(np.random.default_rng(0).normal(size=(4, 16, 64)), jnp.float32)
    probe = jnp.asarray(np.random.default_rng(1).normal(size=x.shape), jnp.float32)

    def run(n):
        layer = MoELayer(get_config("tiny", dtype="float32", ep_micro_batches=n), nnx.Rngs(0))
        graphdef, params, rest = nnx.split(layer, nnx.Param, ...)

        def loss(params, x):
            y, stats = nnx.merge(graphdef, params, rest)(x)
            return jnp.sum(y * probe), (y, stats)

        with jax.set_mesh(mesh):
            return jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))(params, x)

    (loss1, (y1, stats1)), grads1 = run(1)
    (loss2, (y2, stats2)), grads2 = run(2)
    assert_close((loss2, y2, stats2), (loss1, y1, stats1), "MoE layer, 2 micro-batches")
    assert_close(grads2, grads1, "MoE layer gradients, 2 micro-batches")


def _collectives_and_scopes(jaxpr):
    """Per equation of a shard_map body: (its name-stack scope, whether it runs a collective, anywhere inside)."""
    names = {"all_gather", "ppermute", "psum_scatter", "reduce_scatter", "all_to_all", "ragged_all_to_all"}

    def has_collective(eqn):
        if eqn.primitive.name in names:
            return True
        for value in eqn.params.values():
            inner = getattr(value, "jaxpr", value)
            inner = getattr(inner, "jaxpr", inner)
            if hasattr(inner, "eqns") and any(has_collective(e) for e in inner.eqns):
                return True
        return False

    return [(str(e.source_info.name_stack), has_collective(e)) for e in jaxpr.eqns]


def _dependencies(jaxpr):
    """deps[i]: the indices of the equations that equation i reads from, transitively."""
    producer, deps = {}, []
    for i, eqn in enumerate(jaxpr.eqns):
        mine = set()
        for v in eqn.invars:
            if isinstance(v, Var) and v in producer:
                j = producer[v]
                mine |= {j} | deps[j]
        deps.append(mine)
        for v in eqn.outvars:
            producer[v] = i
    return deps


def _check_pipeline_order(body, starts, computes, ends, what):
    """In a shard_map body: starts[i] / computes[i] / ends[i] the scopes of micro-batch i's first collective, its
    experts and its last collective, in pipeline order (the backward pass runs them mirrored)."""
    info, deps = _collectives_and_scopes(body), _dependencies(body)

    def group(scope, collectives_only):
        found = {j for j, (s, coll) in enumerate(info) if scope in s and (coll or not collectives_only)}
        assert found, f"{what}: no equation in scope {scope}"
        return found

    first = [group(s, True) for s in starts]
    experts = [group(s, False) for s in computes]
    last = [group(s, True) for s in ends]

    def after(a, b):  # some equation of a reads (transitively) from one of b
        return any(deps[i] & b for i in a)

    assert after(first[1], first[0]), f"{what}: the second micro-batch's first collective must follow the first's"
    assert not after(experts[0], first[1]) and not after(first[1], experts[0]), \
        f"{what}: the first micro-batch's experts and the second's first collective must be free to overlap"
    assert after(last[0], first[1]), f"{what}: the first micro-batch's last collective must follow the second's first"
    assert not after(experts[1], last[0]) and not after(last[0], experts[1]), \
        f"{what}: the second micro-batch's experts and the first's last collective must be free to overlap"
    assert after(last[1], last[0]), f"{what}: the last collectives in micro-batch order"


@requires_turbo
@pytest.mark.parametrize("exchange", ["deepep", "ragged_all_to_all"])
def test_phases_are_ordered_and_overlappable(exchange):
    """Forward: dispatch 0, then dispatch 1 beside experts 0, then combine 0 beside experts 1, then combine 1. The
    backward pass mirrors it: combine 1's transpose first, ..., dispatch 0's last."""
    x, routing, experts = problem(seed=1)
    path = ep_moe_path("turbo", mesh=make_mesh(1, 2), ep_exchange=exchange, ep_micro_batches=2)
    grad = jax.grad(lambda x, e: jnp.sum(path(x, routing, e)[0] ** 2), argnums=(0, 1))
    forward, backward = (e.params["jaxpr"] for e in jax.make_jaxpr(grad)(x, experts).jaxpr.eqns
                         if e.primitive.name == "shard_map")
    dispatch, compute, combine = ([f"ep_micro_batch{i}/{phase}" for i in (0, 1)] for phase in PHASE_NAMES)
    _check_pipeline_order(forward, dispatch, compute, combine, f"{exchange} forward")
    _check_pipeline_order(backward, combine[::-1], compute[::-1], dispatch[::-1], f"{exchange} backward")


def test_micro_batches_are_checked():
    x, routing, experts = problem(seed=2)  # 8 x 4 tokens: 16 a rank at EP=2
    with pytest.raises(ValueError, match="ep_micro_batches=3: each device's 16 tokens"):
        ep_moe_path("ragged", mesh=make_mesh(1, 2), ep_micro_batches=3)(x, routing, experts)
    with pytest.raises(ValueError, match="ep_micro_batches=8: each device's 4 sequences"):  # whole sequences
        ep_moe_path("dense_cf", mesh=make_mesh(1, 2), ep_micro_batches=8)(x, routing, experts)
    with pytest.raises(ValueError, match="ep_micro_batches: must be an int >= 1"):
        ep_moe_path("ragged", mesh=make_mesh(1, 2), ep_micro_batches=0)
    for bad in (0, 1.5, True):
        with pytest.raises((ValueError, TypeError), match="ep_micro_batches"):
            get_config("tiny", ep_micro_batches=bad)


def test_gpu_programs_compile_with_the_latency_hiding_scheduler(monkeypatch):
    from turbo_moe.train import step

    assert step.compiler_options(None, 2) is None  # the CPU: no GPU option
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    assert step.compiler_options(None, 1) is None
    assert step.compiler_options(None, 2) == {"xla_gpu_enable_latency_hiding_scheduler": True}
    assert step.compiler_options(0, 2) == {"xla_gpu_autotune_level": 0, "xla_gpu_enable_latency_hiding_scheduler": True}
