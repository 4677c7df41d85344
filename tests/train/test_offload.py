"""TrainConfig.optimizer_state_memory="host": the optimizer's state (AdamW moments; with master_weights="split", the low
16 bits) in the devices' pinned host memory between steps (turbo_moe/train/offload.py). Its steps equal the on-device
state's bit for bit (the same arithmetic, only copies between memories added): on 4 CPU devices with EP=2 and split
masters, and through run() on 8 with FSDP. The state lives on pinned_host after init, after each step and after a
restore; a run saves and resumes with it; the field is checked, recorded and read from older records; the accounting
counts the moments as host memory."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from turbo_moe.experiments import accounting
from turbo_moe.model import get_config
from turbo_moe.train import TrainConfig, run
from turbo_moe.train.checkpoint import Checkpointer
from turbo_moe.train.offload import HOST, check_host_memory
from turbo_moe.train.step import build_program, make_mesh, make_optimizer

MICRO = {"n_layers": 2, "mtp_depth": 0}  # fast compiles


def _base(**changes) -> TrainConfig:
    return TrainConfig(model="tiny", model_overrides=MICRO, dataset="synthetic", per_device_batch=1, seq_len=16,
                       steps=4, lr_schedule_steps=4, warmup_steps=1, eval_batches=0, progress=False,
                       moments_dtype="bfloat16").replace(**changes)


def _leaves(tree) -> list:
    return jax.tree.leaves(tree)


def _memory_kinds(tree) -> set:
    return {x.sharding.memory_kind for x in _leaves(tree) if x.ndim}


def _steps(tc: TrainConfig, mesh, n: int = 3):
    """`n` train steps of `tc`'s program on `mesh` from its init: (final state, losses, each step's state kinds)."""
    cfg = tc.model_config()
    program = build_program(cfg, make_optimizer(tc), mesh, True, None, False, False, tc.master_weights == "split",
                            tc.optimizer_state_memory == "host")
    state = program.init(jax.random.key(0))
    kinds = [(_memory_kinds(state.opt_state), _memory_kinds(state.master_low), _memory_kinds(state.params))]
    tokens = jax.random.randint(jax.random.key(1), (n, mesh.size, 17), 0, cfg.vocab_size)
    losses = []
    for i in range(n):
        state, metrics = program.train(state, {"inputs": tokens[i, :, :-1], "targets": tokens[i, :, 1:]})
        losses.append(float(metrics["loss"]))
        kinds.append((_memory_kinds(state.opt_state), _memory_kinds(state.master_low), _memory_kinds(state.params)))
    return state, losses, kinds


def _assert_same(a, b, what: str) -> None:
    for x, y in zip(_leaves(a), _leaves(b), strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y), err_msg=what)


@pytest.mark.parametrize("devices, expert_parallel, master_weights", [(4, 2, "split")], ids=["ep2-split-masters"])
def test_steps_equal_the_on_device_state_and_it_stays_on_the_host(devices, expert_parallel, master_weights):
    """4 CPU devices, EP=2, split masters (their low bits offloaded too); float32 masters on 8 devices: the run test."""
    mesh = make_mesh(jax.devices()[:devices], expert_parallel=expert_parallel)
    tc = _base(master_weights=master_weights, expert_parallel=expert_parallel)
    ref, ref_losses, ref_kinds = _steps(tc, mesh)
    off, losses, kinds = _steps(tc.replace(optimizer_state_memory="host"), mesh)
    assert losses == ref_losses  # bit for bit
    _assert_same((off.step, off.params, off.extra, off.opt_state, off.master_low),
                 (ref.step, ref.params, ref.extra, ref.opt_state, ref.master_low), "the states after 3 steps")
    low = {HOST} if master_weights == "split" else set()
    assert kinds == [({HOST}, low, {"device"})] * 4  # after init and after every step
    assert ref_kinds == [({"device"}, low and {"device"}, {"device"})] * 4
    moments = [x for x in _leaves(off.opt_state) if x.ndim]
    assert moments and {x.dtype for x in moments} == {jnp.dtype(jnp.bfloat16)}
    assert all(x.sharding.memory_kind == "device" for x in _leaves(off.opt_state) if not x.ndim)  # step counts
    for x, y in zip(_leaves(off.opt_state), _leaves(ref.opt_state)):  # the same layout, another memory
        assert x.sharding.spec == y.sharding.spec


def test_a_run_saves_and_resumes_with_the_state_on_the_host(tmp_path):
    whole = run(_base(eval_batches=1, eval_every=2))
    assert whole.status == "ok", whole.error
    tc = _base(eval_batches=1, eval_every=2, optimizer_state_memory="host", checkpoint_dir=str(tmp_path / "ckpt"))
    first = run(tc.replace(steps=2, checkpoint_every=2))
    assert first.status == "ok", first.error
    resumed = run(tc.replace(resume=True))
    assert resumed.status == "ok", resumed.error
    assert resumed.summary["resumed_from_step"] == 2
    assert resumed.losses() == whole.losses()  # bit for bit across the save, the restore and the memories
    evals = [[row["eval_loss"] for row in result.history] for result in (resumed, whole)]
    np.testing.assert_array_equal(*evals)  # NaN where not evaluated
    assert np.isfinite(evals[0]).sum() == 2
    assert resumed.provenance["config"]["optimizer_state_memory"] == "host"
    assert whole.provenance["config"]["optimizer_state_memory"] == "device"
    # a restore puts the state where the program keeps it; a checkpoint is the same whatever the memory
    resolved = tc.resolved()
    for memory in ("host", "device"):
        program = build_program(resolved.model_config(), make_optimizer(resolved), make_mesh(), True, None, False,
                                False, False, memory == "host")
        ckpt = Checkpointer(tmp_path / "ckpt")
        try:
            state, record = ckpt.restore(program.abstract_state,
                                         config=resolved.replace(optimizer_state_memory=memory).to_dict())
        finally:
            ckpt.finish()
        assert record["step"] == 4 and int(state.step) == 4
        assert _memory_kinds(state.opt_state) == {HOST if memory == "host" else "device"}
        assert _memory_kinds(state.params) == {"device"}


@pytest.mark.parametrize("value", ["hots", "pinned_host", True, None, 1])
def test_bad_values_are_named(value):
    with pytest.raises(ValueError, match=r"TrainConfig.optimizer_state_memory: got .*; expected one of "
                                         r"\('device', 'host'\)"):
        TrainConfig(model="tiny", optimizer_state_memory=value)


def test_the_field_is_set_flat_or_nested_recorded_and_read_from_older_records():
    flat = TrainConfig(model="tiny", optimizer_state_memory="host")
    nested = TrainConfig.from_dict({"model": "tiny", "optimizer": {"optimizer_state_memory": "host"}})
    assert flat == nested and flat.optimizer.optimizer_state_memory == "host"
    assert flat.to_dict()["optimizer_state_memory"] == "host"
    assert TrainConfig.from_dict(flat.to_dict()) == flat
    assert TrainConfig().optimizer_state_memory == "device"
    older = {k: v for k, v in TrainConfig(model="tiny").to_dict().items() if k != "optimizer_state_memory"}
    assert TrainConfig.from_record(older).optimizer_state_memory == "device"
    with pytest.raises(ValueError, match="TrainConfig.optimizer_state_memory: given both flat and in the optimizer"):
        TrainConfig.from_dict({"optimizer_state_memory": "host", "optimizer": {"optimizer_state_memory": "host"}})


class _NoHostMemory:
    platform = "tpu"
    process_index = 0

    def addressable_memories(self):
        return [type("Memory", (), {"kind": "device"})()]


def test_a_backend_without_pinned_host_memory_is_refused_by_name():
    check_host_memory(make_mesh())  # the CPU lists pinned_host
    mesh = type("Mesh", (), {"devices": np.array([_NoHostMemory()])})()
    with pytest.raises(ValueError, match=r"TrainConfig.optimizer_state_memory='host' .* the tpu devices have none "
                                         r"\(their memory kinds: \['device'\]\); set it to 'device'"):
        check_host_memory(mesh)


def test_the_accounting_counts_the_moments_in_host_memory():
    cfg, mesh = get_config("reduced"), accounting.MeshShape(data=4, expert=2)
    everything = accounting.state_bytes_per_device(cfg, mesh, "bfloat16", "bfloat16")
    device = accounting.state_bytes_per_device(cfg, mesh, "bfloat16", "bfloat16", "host")
    host = accounting.host_state_bytes_per_device(cfg, mesh, "bfloat16", "bfloat16", "host")
    assert device + host == pytest.approx(everything)
    assert host == pytest.approx(everything * 4 / 12)  # 2 + 2 moment bytes of 4 + 4 (params, grads) + 4
    assert accounting.host_state_bytes_per_device(cfg, mesh, "bfloat16", "bfloat16") == 0
    predicted = accounting.memory_prediction(cfg, 8, 2048, mesh, "bfloat16", "bfloat16", optimizer_state_memory="host")
    assert predicted["states"] == device
    with pytest.raises(ValueError, match="optimizer_state_memory must be one of"):
        accounting.state_bytes_per_device(cfg, mesh, optimizer_state_memory="pinned_host")
