"""Expert parallelism on forced CPU host devices: every path at EP=2/4/8 equals the one-device path.

XLA:CPU has no ragged-all-to-all thunk, so the ragged exchange runs its emulation here (same plan,
same offsets, a padded all_to_all underneath); the GPU runs `jax.lax.ragged_all_to_all`.
"""

import os
import re
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh

from tests.model.conftest import requires_turbo
from tests.model.path_cases import fake_pallas, needs  # noqa: F401  (fake_pallas: a fixture)
from turbo_moe.model.expert_parallel import ep_moe_path, expert_axis_size
from turbo_moe.model.experts import ExpertWeights
from turbo_moe.model.moe_layer import moe_path_fn
from turbo_moe.model.paths import ONE_DEVICE, PATHS
from turbo_moe.model.router import Routing
from turbo_moe.ops.fp8_scaling import fp8_weights

B, S, D, F, E, K = 8, 4, 8, 6, 16, 3
CF = 1.25


def _ep_cases():
    """One case per distinct expert-parallel row of the table (dense_cf and ragged ignore ep_exchange). The FP8 GEMM
    set needs 128-wide experts, past these cases' sizes; its exchanges are turbo's rows, tested here."""
    rows = {}
    for (path, exchange), row in PATHS.items():
        if exchange != ONE_DEVICE and row not in rows.values() and row.gemm != "fp8":
            rows[(path, exchange)] = row
    return [pytest.param(path, exchange, marks=needs(row)) for (path, exchange), row in rows.items()]


CASES = _ep_cases()  # (path, ep_exchange)
TOLERANCE = dict(rtol=2e-5, atol=2e-5)
BF16_TOLERANCE = dict(rtol=2e-2, atol=2e-2)  # pallas computes in bfloat16: sums over ranks round differently
# Expert ids (int32) crossing devices in the lowered program: every EP exchange sends them (all_to_all,
# or all_gather in deepep's dense layout); a data-parallel fallback never does.
EP_IDS_EXCHANGE = r"stablehlo\.(all_to_all|all_gather)[^\n]*\(tensor<[0-9x]*xi32>"
MESHES = [(2, 2), (2, 4), (1, 8)]  # (data, expert): EP=2/4/8 with data parallelism beside EP=2/4


def make_mesh(data: int, expert: int) -> Mesh:
    if jax.device_count() < data * expert:
        pytest.skip(f"needs {data * expert} devices (XLA_FLAGS=--xla_force_host_platform_device_count)")
    return Mesh(np.array(jax.devices()[: data * expert]).reshape(data, expert), ("data", "expert"))


def problem(seed: int, skew_to: int | None = None):
    """Random tokens, distinct top-k experts per token (all within `skew_to` experts when given)."""
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.normal(size=(B, S, D)), jnp.float32)
    scores = jnp.asarray(rng.random((B, S, E)), jnp.float32)
    if skew_to is not None:
        scores = scores.at[..., skew_to:].set(-1.0)  # only the first experts are ever picked
    ids = jax.lax.top_k(scores, K)[1].astype(jnp.int32)  # (B, S, K) distinct
    weights = jnp.asarray(rng.random((B, S, K)), jnp.float32)
    experts = ExpertWeights(jnp.asarray(rng.normal(size=(E, D, 2 * F)) / np.sqrt(D), jnp.float32),
                            jnp.asarray(rng.normal(size=(E, F, D)) / np.sqrt(F), jnp.float32))
    return x, Routing(ids, weights, scores), experts


def loss_and_grads(path_fn, x, routing, experts):
    """Loss sum(y * r) and its gradients wrt x, the routing weights and both expert weights."""
    probe = jnp.asarray(np.random.default_rng(99).normal(size=x.shape), jnp.float32)

    def loss(x, w, experts):
        y, stats = path_fn(x, routing._replace(weights=w), experts)
        return jnp.sum(y * probe), (y, stats)

    (value, (y, stats)), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))(
        x, routing.weights, experts)
    return value, y, stats, grads


def assert_close(actual, expected, what, tolerance=TOLERANCE):
    for a, e in zip(jax.tree.leaves(actual), jax.tree.leaves(expected)):
        np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(e, np.float32), err_msg=what, **tolerance)


def for_path(path, request, x, experts):
    """(x, experts, tolerance) for `path`: the pallas GEMM runs through CPU fakes, in bfloat16."""
    if PATHS[(path, ONE_DEVICE)].gemm != "pallas":
        return x, experts, TOLERANCE
    request.getfixturevalue("fake_pallas")
    return x.astype(jnp.bfloat16), jax.tree.map(lambda a: a.astype(jnp.bfloat16), experts), BF16_TOLERANCE


@requires_turbo
@pytest.mark.parametrize("exchange", ["deepep", "ragged_all_to_all"])
def test_expert_block_and_autodiff_agree_under_expert_parallelism(exchange):
    """Each rank's local experts run the expert block (the model's only setting) or, as a reference, the ops' own VJPs
    (`expert_backward="autodiff"`): the same loss, outputs and gradients under EP as on one device."""
    x, routing, experts = problem(seed=5)
    ref = loss_and_grads(moe_path_fn("turbo", CF, expert_backward="autodiff"), x, routing, experts)
    for expert_backward in ("autodiff", "block"):
        path = ep_moe_path("turbo", mesh=make_mesh(2, 2), capacity_factor=CF, ep_exchange=exchange,
                           expert_backward=expert_backward)
        got = loss_and_grads(path, x, routing, experts)
        for name, a, e in zip(("loss", "y", "stats", "grads"), got, ref):
            assert_close(a, e, f"turbo/{exchange} EP=2 {expert_backward}: {name}")
        # the block's backward rebuilds the local experts' rows with permute_rows; autodiff never calls it
        grad = jax.grad(lambda x: jnp.sum(path(x, routing, experts)[0]))
        assert ("turbo_moe_permute_rows" in jax.jit(grad).lower(x).as_text()) == (expert_backward == "block")
    # the default is the block
    default = ep_moe_path("turbo", mesh=make_mesh(2, 2), capacity_factor=CF, ep_exchange=exchange)
    grad = jax.grad(lambda x: jnp.sum(default(x, routing, experts)[0]))
    assert "turbo_moe_permute_rows" in jax.jit(grad).lower(x).as_text()


@pytest.mark.parametrize("data,expert", MESHES)
@pytest.mark.parametrize("path,exchange", CASES)
def test_loss_grads_and_stats_match_one_device(path, exchange, data, expert, request):
    if path == "pallas" and (data, expert) != (2, 2):
        pytest.skip("the pallas rows share turbo's exchanges: one mesh checks their plumbing")
    x, routing, experts = problem(seed=data * 10 + expert)
    x, experts, tolerance = for_path(path, request, x, experts)
    ref = loss_and_grads(moe_path_fn(path, CF), x, routing, experts)
    got = loss_and_grads(ep_moe_path(path, mesh=make_mesh(data, expert), capacity_factor=CF, ep_exchange=exchange),
                         x, routing, experts)
    for name, a, e in zip(("loss", "y", "stats", "grads"), got, ref):
        assert_close(a, e, f"{path}/{exchange} EP={expert}: {name}", tolerance)
    if path != "dense_cf":
        assert float(got[2].dropped_fraction) == 0.0, "dropless paths drop nothing"


@pytest.mark.parametrize("path,exchange", CASES)
def test_skewed_routing_neither_loses_nor_duplicates(path, exchange, request):
    """Every copy goes to rank 0's experts: the output, load and drops equal the one-device path."""
    mesh = make_mesh(1, 4)
    x, routing, experts = problem(seed=3, skew_to=E // 4)
    x, experts, tolerance = for_path(path, request, x, experts)
    y_ref, stats_ref = jax.jit(moe_path_fn(path, CF))(x, routing, experts)
    y, stats = jax.jit(ep_moe_path(path, mesh=mesh, capacity_factor=CF, ep_exchange=exchange))(x, routing, experts)
    assert_close((y, stats), (y_ref, stats_ref), f"{path}/{exchange} skewed", tolerance)
    np.testing.assert_array_equal(np.asarray(stats.expert_load)[E // 4:], 0.0)
    assert float(stats.expert_load.sum()) == B * S * K


@requires_turbo
def test_dense_cf_without_capacity_matches_dense():
    mesh = make_mesh(2, 4)
    x, routing, experts = problem(seed=5)
    y_ref, _ = jax.jit(moe_path_fn("dense_cf", 0.0))(x, routing, experts)
    y, stats = jax.jit(ep_moe_path("dense_cf", mesh=mesh, capacity_factor=0.0))(x, routing, experts)
    assert_close(y, y_ref, "dense_cf cf=0")
    assert float(stats.dropped_fraction) == 0.0


@requires_turbo
def test_deepep_capacity_overflow_is_counted():
    """Skewed to rank 0 with half the slots: each source keeps its first ceil(T/2) tokens; the rest count."""
    data, expert, cap_factor = 2, 2, 0.5
    mesh = make_mesh(data, expert)
    x, routing, experts = problem(seed=4, skew_to=E // expert)
    path = ep_moe_path("turbo", mesh=mesh, ep_exchange="deepep", ep_capacity_factor=cap_factor)
    y, stats = jax.jit(path)(x, routing, experts)

    tokens_per_rank = B * S // (data * expert)
    slots = int(np.ceil(cap_factor * tokens_per_rank))
    expected_drop = (tokens_per_rank - slots) / tokens_per_rank
    assert float(stats.dropped_fraction) == pytest.approx(expected_drop)
    assert float(stats.expert_load.sum()) == B * S * K, "load counts copies before dropping"
    keep = (np.arange(B * S) % tokens_per_rank < slots).reshape(B, S, 1)  # first slots tokens of each rank
    kept_routing = routing._replace(weights=routing.weights * keep)
    y_ref, _ = jax.jit(moe_path_fn("ragged", CF))(x, kept_routing, experts)
    assert_close(y, y_ref, "overflowed tokens contribute nothing, the others everything")


def test_ambient_mesh_and_axis_size():
    mesh = make_mesh(2, 2)
    x, routing, experts = problem(seed=6)
    y_ref, _ = jax.jit(moe_path_fn("ragged", CF))(x, routing, experts)
    assert expert_axis_size() == 1
    with jax.set_mesh(mesh):
        assert expert_axis_size() == 2
        y, _ = jax.jit(ep_moe_path("ragged"))(x, routing, experts)
    assert_close(y, y_ref, "ambient mesh")


HOST_TRANSFER_MARKERS = ("is_host_transfer=true", "outfeed", "infeed", "send(", "recv(", "host-offload")


@pytest.mark.parametrize("path,exchange", [("ragged", "deepep"), pytest.param("turbo", "deepep", marks=requires_turbo),
                                           pytest.param("turbo", "ragged_all_to_all", marks=requires_turbo)])
def test_compiled_step_has_no_host_synchronisation(path, exchange):
    """Counts stay on the device: no host callback in the jaxpr, no host transfer in the compiled HLO,
    and the only custom calls are turbo_moe's kernels."""
    mesh = make_mesh(2, 2)
    x, routing, experts = problem(seed=7)
    ep = ep_moe_path(path, mesh=mesh, ep_exchange=exchange)

    def step(x, w, experts):
        return jax.grad(lambda x, w, e: jnp.sum(ep(x, routing._replace(weights=w), e)[0] ** 2),
                        argnums=(0, 1, 2))(x, w, experts)

    jaxpr = str(jax.make_jaxpr(step)(x, routing.weights, experts))
    assert "callback" not in jaxpr
    hlo = jax.jit(step).lower(x, routing.weights, experts).compile().as_text()
    for marker in HOST_TRANSFER_MARKERS:
        assert marker not in hlo, f"compiled HLO contains {marker!r}"
    targets = set(re.findall(r'custom_call_target="([^"]+)"', hlo))
    assert all(t.startswith("turbo_moe_") for t in targets), targets
    assert any(op in hlo for op in ("all-to-all", "all-gather", "reduce-scatter"))  # deepep dense: no all-to-all
    if exchange == "ragged_all_to_all" or path == "ragged":  # the GPU's native collective: lowered only here
        native = ep_moe_path(path, mesh=mesh, ep_exchange=exchange, exchange_impl="native")
        text = jax.jit(lambda x, w, e: native(x, routing._replace(weights=w), e)[0]).lower(
            x, routing.weights, experts).as_text()
        assert "ragged_all_to_all" in text and "callback" not in text and "host" not in text.lower()


def test_bad_arguments_are_named():
    mesh = make_mesh(2, 2)
    x, routing, experts = problem(seed=8)
    with pytest.raises(ValueError, match="path: unknown MoE path"):
        ep_moe_path("megablox", mesh=mesh)
    with pytest.raises(ValueError, match="ep_exchange"):
        ep_moe_path("turbo", mesh=mesh, ep_exchange="nccl")
    with pytest.raises(ValueError, match="no expert axis"):
        ep_moe_path("ragged", mesh=Mesh(np.array(jax.devices()[:2]), ("data",)))
    with pytest.raises(ValueError, match="batch 6 must be divisible"):
        ep_moe_path("ragged", mesh=mesh)(x[:6], Routing(*(a[:6] for a in routing)), experts)
    odd = ExpertWeights(experts.w_gate_up[:15], experts.w_down[:15])
    with pytest.raises(ValueError, match="n_experts=15 must be divisible"):
        ep_moe_path("ragged", mesh=mesh)(x, routing._replace(expert_ids=routing.expert_ids % 15), odd)


MULTIPROCESS_WORKER = textwrap.dedent("""
    import os, sys
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=2"
    os.environ["JAX_PLATFORMS"] = "cpu"
    import jax
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    process_id, port, path = int(sys.argv[1]), sys.argv[2], sys.argv[3]
    jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=2, process_id=process_id)
    import numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    from tests.model.test_expert_parallel import problem
    from turbo_moe.model.expert_parallel import ep_moe_path
    from turbo_moe.model.experts import ExpertWeights
    from turbo_moe.model.moe_layer import moe_path_fn
    from turbo_moe.model.router import Routing

    x, routing, experts = problem(seed=11)
    with jax.default_device(jax.local_devices()[0]):
        y_ref, stats_ref = jax.jit(moe_path_fn(path, 1.25))(x, routing, experts)
    mesh = Mesh(np.array(jax.devices()).reshape(2, 2), ("data", "expert"))  # one data row per process
    def shard(a, spec):
        a = np.asarray(a)
        return jax.make_array_from_callback(a.shape, NamedSharding(mesh, spec), lambda idx: a[idx])
    tokens = P(("data", "expert"))
    args = (shard(x, tokens), Routing(*(shard(a, tokens) for a in routing)),
            ExpertWeights(*(shard(a, P("expert")) for a in experts)))
    y, stats = jax.jit(ep_moe_path(path, mesh=mesh))(*args)
    for piece in y.addressable_shards:
        np.testing.assert_allclose(np.asarray(piece.data), np.asarray(y_ref)[piece.index], rtol=2e-5, atol=2e-5)
    load = np.asarray(stats.expert_load.addressable_shards[0].data)
    np.testing.assert_array_equal(load, np.asarray(stats_ref.expert_load))
    print("MULTIPROCESS_OK", process_id, jax.process_count(), len(jax.devices()))
""")


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.mark.parametrize("path", ["ragged", pytest.param("turbo", marks=requires_turbo)])
def test_multiprocess_under_jax_distributed(path, tmp_path):
    """Two processes x two CPU devices under jax.distributed.initialize (gloo) equal one device."""
    worker = tmp_path / "worker.py"
    worker.write_text(MULTIPROCESS_WORKER)
    port = str(_free_port())
    root = str(Path(__file__).resolve().parents[2])
    env = {**os.environ, "PYTHONPATH": root}
    env.pop("XLA_FLAGS", None)
    procs = [subprocess.Popen([sys.executable, str(worker), str(i), port, path], cwd=root, env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for i in range(2)]
    outputs = [proc.communicate(timeout=240)[0] for proc in procs]
    for i, (proc, out) in enumerate(zip(procs, outputs)):
        assert proc.returncode == 0 and f"MULTIPROCESS_OK {i} 2 4" in out, out[-3000:]


def test_exchange_plan_is_consistent_between_senders_and_receivers():
    """What the native ragged_all_to_all reads: every receiver's recv sizes/offsets must be what the
    senders send/address, in both directions (CPU cannot run the collective itself)."""
    from jax.sharding import PartitionSpec as P

    from turbo_moe.ops.ragged_exchange import exchange_plan

    mesh = Mesh(np.array(jax.devices()[:4]), ("expert",))
    counts = jnp.asarray(np.random.default_rng(0).integers(0, 5, size=(4, E)), jnp.int32)

    def check(counts):
        plan, recv_counts = exchange_plan(counts.reshape(-1), "expert")
        mismatches = []
        for p in (plan, plan.reversed()):
            sent_sizes = jax.lax.all_to_all(p.send_sizes, "expert", 0, 0)
            sent_offsets = jax.lax.all_to_all(p.output_offsets, "expert", 0, 0)
            mismatches.append(jnp.sum(sent_sizes != p.recv_sizes) + jnp.sum(sent_offsets != p.recv_offsets))
        return jnp.stack(mismatches)[None], recv_counts.sum(0)[None]

    mismatches, local_sizes = jax.jit(jax.shard_map(check, mesh=mesh, in_specs=P("expert"),
                                                    out_specs=P("expert")))(counts)
    np.testing.assert_array_equal(np.asarray(mismatches), 0)
    np.testing.assert_array_equal(np.asarray(local_sizes).reshape(-1), np.asarray(counts).sum(0))


@pytest.mark.parametrize("path", ["ragged", pytest.param("turbo", marks=requires_turbo)])
def test_tiny_model_lm_loss_and_grads_match_one_device(path):
    """The model's MoE layers switch to EP under a mesh with an expert axis; loss, metrics and every
    gradient equal the one-device run (data=2 x expert=2)."""
    from flax import nnx

    from tests.model.conftest import micro_config
    from turbo_moe.model import DeepSeekModel, lm_loss
    from turbo_moe.train.step import batch_sharding, make_mesh, state_shardings

    mesh = make_mesh(jax.devices()[:4], expert_parallel=2)
    cfg = micro_config(moe_path=path, dtype="float32", ep_exchange="deepep")
    graphdef, params, extra = nnx.split(DeepSeekModel(cfg, rngs=nnx.Rngs(0)), nnx.Param, ...)
    rng = np.random.default_rng(0)
    batch = {name: jnp.asarray(rng.integers(0, cfg.vocab_size, (8, cfg.max_seq_len)), jnp.int32)
             for name in ("inputs", "targets")}

    def loss_and_grads(params, extra, batch):
        def loss(params):
            return lm_loss(nnx.merge(graphdef, params, extra), batch)
        return jax.value_and_grad(loss, has_aux=True)(params)

    (ref_loss, ref_metrics), ref_grads = jax.jit(loss_and_grads)(params, extra, batch)
    sharded = jax.device_put((params, extra), state_shardings((params, extra), mesh))
    batch = jax.device_put(batch, batch_sharding(mesh))
    with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
        lowered = jax.jit(loss_and_grads).lower(*sharded, batch)
    assert re.search(EP_IDS_EXCHANGE, lowered.as_text()), "the MoE layers did not run expert-parallel"
    (loss, metrics), grads = lowered.compile()(*sharded, batch)
    assert_close((loss, metrics, grads), (ref_loss, ref_metrics, ref_grads), f"{path} tiny model EP=2")


@requires_turbo
def test_train_step_with_expert_parallel_matches_data_parallel():
    """build_program on a (2, 2) ("data", "expert") mesh: expert weights and their AdamW moments split
    over "expert" (and "data", FSDP), one optimizer step equal to the (4, 1) data-parallel one."""
    from tests.model.conftest import micro_config
    from turbo_moe.train import TrainConfig
    from turbo_moe.train.step import build_program, device_batch, make_mesh, make_optimizer

    cfg = micro_config(moe_path="turbo", dtype="float32")
    tx = make_optimizer(TrainConfig(model=cfg, dataset="synthetic", expert_parallel=2))
    rng = np.random.default_rng(1)
    batch = {name: rng.integers(0, cfg.vocab_size, (8, cfg.max_seq_len)).astype(np.int32)
             for name in ("inputs", "targets")}
    results = []
    for ep in (1, 2):
        mesh = make_mesh(jax.devices()[:4], expert_parallel=ep)
        program = build_program(cfg, tx, mesh)
        state = program.init(jax.random.key(0))
        experts = state.params["moe_layers"]["blocks"]["ffn"]["experts"]["w_gate_up"][...]  # (L, E, D, 2F)
        spec = experts.sharding.spec
        assert spec[0] is None, "the layer axis is never split"
        assert (spec[1] == "expert") == (ep > 1)
        assert "data" in jax.tree.leaves(tuple(spec)), f"expert states are also split over data: {spec}"
        shard = experts.addressable_shards[0].data.shape
        assert shard[1] == cfg.n_experts // ep and np.prod(shard) == experts.size // 4
        moments = [m for m in jax.tree.leaves(state.opt_state) if m.shape == experts.shape]
        assert moments and all(m.sharding == experts.sharding for m in moments), "moments not sharded alike"
        sharded_batch = device_batch(batch, mesh)
        if ep > 1:
            assert re.search(EP_IDS_EXCHANGE, program.train.lower(state, sharded_batch).as_text()), \
                "MoE layers ran without EP"
        state, metrics = program.train(state, sharded_batch)
        results.append((metrics, state.params))
    assert_close(results[1], results[0], "one AdamW step, EP=2 vs EP=1")


@requires_turbo
def test_policy_saves_what_the_dispatch_received(monkeypatch):
    """Under remat_policy "dots_experts_attention" the backward pass reads the rows, ids and weights deepep's
    dispatch delivered (saved) instead of running the dispatch's collectives again; the gradients are the same
    as with the dispatch run again (the received values left unnamed: `ep_exchange.saved` an identity)."""
    from flax import nnx

    from tests.model.conftest import micro_config
    from turbo_moe.model import DeepSeekModel, ep_exchange, lm_loss
    from turbo_moe.train.step import batch_sharding, make_mesh, state_shardings

    mesh = make_mesh(jax.devices()[:4], expert_parallel=2)
    cfg = micro_config(moe_path="turbo", dtype="float32", ep_exchange="deepep", remat_policy="dots_experts_attention")
    graphdef, params, extra = nnx.split(DeepSeekModel(cfg, rngs=nnx.Rngs(0)), nnx.Param, ...)
    rng = np.random.default_rng(0)
    batch = {name: jnp.asarray(rng.integers(0, cfg.vocab_size, (8, cfg.max_seq_len)), jnp.int32)
             for name in ("inputs", "targets")}
    sharded = jax.device_put((params, extra), state_shardings((params, extra), mesh))
    batch = jax.device_put(batch, batch_sharding(mesh))

    def run():
        def grads(params, extra, batch):
            return jax.grad(lambda p: lm_loss(nnx.merge(graphdef, p, extra), batch)[0])(params)
        with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
            compiled = jax.jit(grads).lower(*sharded, batch).compile()
        remat_collectives = re.findall(r"= [^\n]*(?:collective-permute|all-gather|all-to-all)(?:-start)?\([^\n]*"
                                       r"rematted_computation[^\n]*shard_map", compiled.as_text())
        return len(remat_collectives), compiled(*sharded, batch)

    saved_count, saved_grads = run()  # the model as it runs
    monkeypatch.setattr(ep_exchange, "saved", lambda value, name: value)
    rebuilt_count, rebuilt_grads = run()
    assert rebuilt_count > 0, "the dispatch was not run again without the save: the test shows nothing"
    assert saved_count == 0, f"{saved_count} of the dispatch's collectives run again in the backward pass"
    assert_close(saved_grads, rebuilt_grads, "saved vs rebuilt dispatch", tolerance=dict(rtol=1e-6, atol=1e-7))


@requires_turbo
@pytest.mark.parametrize("layout", ["dense", "packed", "ragged"])
@pytest.mark.parametrize("expert", [2, 4])
def test_expert_block_kernels_leave_the_worst_case_tail_unread(layout, expert):
    """With the SwiGLU kernels (what GPUs run; `swiglu_impl="kernel"` here) the expert block lets its (P*T*k)-row
    buffers keep their rows past the groups unwritten (`zero_tail=False`, always); the CPU handlers fill those rows
    with NaN. Under EP most of a rank's rows are such tail, so any reader of them would show here as NaN against the
    one-device result."""
    x, routing, experts = problem(seed=40 + expert)
    ref = loss_and_grads(moe_path_fn("turbo", CF, swiglu_impl="xla"), x, routing, experts)
    path = ep_moe_path("turbo", mesh=make_mesh(8 // expert, expert), capacity_factor=CF, ep_exchange="deepep",
                       ep_layout=layout, swiglu_impl="kernel")
    lowered = jax.jit(jax.grad(lambda x: jnp.sum(path(x, routing, experts)[0]))).lower(x).as_text()
    assert "turbo_moe_grouped_gemm_swiglu" in lowered and "zero_tail = false" in lowered, "the kernels did not run"
    assert "zero_tail = true" not in lowered, "a call of the block writes its tail"
    got = loss_and_grads(path, x, routing, experts)
    for name, a, e in zip(("loss", "y", "stats", "grads"), got, ref):
        assert_close(a, e, f"turbo/deepep[{layout}] EP={expert} with the SwiGLU kernels: {name}")


@requires_turbo
@pytest.mark.parametrize("layout", ["auto", "dense", "packed", "ragged"])
def test_ep_layout_reaches_moe_dispatch(layout, monkeypatch):
    """ModelConfig.ep_layout is the layout every deepep dispatch of the model asks moe_dispatch for (a recorded field,
    no environment variable)."""
    from flax import nnx

    from tests.model.conftest import micro_config
    from turbo_moe import ops
    from turbo_moe.model import DeepSeekModel, lm_loss
    from turbo_moe.train.step import batch_sharding, make_mesh, state_shardings

    layouts = []
    dispatch = ops.moe_dispatch

    def recording(*args, layout, **kwargs):
        layouts.append(layout)
        return dispatch(*args, layout=layout, **kwargs)

    monkeypatch.setattr(ops, "moe_dispatch", recording)
    mesh = make_mesh(jax.devices()[:4], expert_parallel=2)
    cfg = micro_config(moe_path="turbo", dtype="float32", ep_exchange="deepep", ep_layout=layout)
    graphdef, params, extra = nnx.split(DeepSeekModel(cfg, rngs=nnx.Rngs(0)), nnx.Param, ...)
    batch = {name: jnp.zeros((8, cfg.max_seq_len), jnp.int32) for name in ("inputs", "targets")}
    args = (*jax.device_put((params, extra), state_shardings((params, extra), mesh)),
            jax.device_put(batch, batch_sharding(mesh)))
    with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
        jax.jit(lambda p, e, b: lm_loss(nnx.merge(graphdef, p, e), b)[0]).lower(*args)
    assert layouts == [layout] * cfg.n_router_layers  # the MoE layer and the MTP block


@pytest.mark.parametrize("exchange", ["deepep", "ragged_all_to_all"])
def test_turbo_fp8_on_weights_quantised_once_under_expert_parallelism(exchange):
    """The FP8 path at EP=2 on `fp8_weights` made outside the shard_map (as the layer stack makes them, once a step):
    the same loss, output, loads and gradients, bit for bit, as on the weights themselves (quantised at each use)."""
    mesh = make_mesh(1, 2)
    rng = np.random.default_rng(7)
    d = f = 128
    x = jnp.asarray(rng.normal(size=(B, S, d)), jnp.float32)
    scores = jnp.asarray(rng.random((B, S, E)), jnp.float32)
    routing = Routing(jax.lax.top_k(scores, K)[1].astype(jnp.int32), jnp.asarray(rng.random((B, S, K)), jnp.float32),
                      scores)
    experts = ExpertWeights(jnp.asarray(rng.normal(size=(E, d, 2 * f)) / np.sqrt(d), jnp.float32),
                            jnp.asarray(rng.normal(size=(E, f, d)) / np.sqrt(f), jnp.float32))
    path = ep_moe_path("turbo_fp8", mesh=mesh, capacity_factor=CF, ep_exchange=exchange)

    def on_fp8_weights(x, routing, experts):
        return path(x, routing, ExpertWeights(fp8_weights(experts.w_gate_up), fp8_weights(experts.w_down)))

    got = loss_and_grads(on_fp8_weights, x, routing, experts)
    want = loss_and_grads(path, x, routing, experts)
    for a, e in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(e), err_msg=f"turbo_fp8/{exchange}")
    assert float(jnp.abs(got[3][2].w_down).max()) > 0
