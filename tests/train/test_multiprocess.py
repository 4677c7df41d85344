"""Two processes x two CPU devices (`turbo-moe launch`) train as one process x four (`turbo-moe train`).

Same init, same global batches, so the same losses: at expert_parallel=2 (experts split over pairs of devices,
each pair inside one process) and 1 (data parallel only). Both sides run the same SPMD program over a mesh of four
devices; they differ in how the collectives reach the other devices (gloo between the processes, in-process
copies in one), so sums may come in another order. Step 0 sees the same parameters and tokens: equal to float32
rounding (rtol 1e-6). Later steps follow Adam updates of gradients equal to rounding, which can move a loss by
more: measured up to 3e-5 over 12 steps (`tiny`, loss ~7.2). The test allows 5e-4 (rtol ~1e-4), ten times that,
and still fails where the processes draw other tokens than one process: with process 1's half of each batch drawn
differently (the fault this test was written against) the losses of this config differed by 8e-3 at step 0 and by
up to 1e-2 later.

Each side is a separate process tree (a fresh `jax.distributed` coordinator, 2 CPU devices a process); both
compile with XLA's CPU backend optimisations off, which halves the compile time and changes both sides alike.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from turbo_moe.data import BatchIterator, SyntheticSequences

ROOT = Path(__file__).resolve().parents[2]
STEPS = 6
CONFIG = f"""model: tiny
model_overrides: {{moe_path: ragged, n_layers: 2, mtp_depth: 0}}
dataset: synthetic
per_device_batch: 2
seq_len: 32
steps: {STEPS}
warmup_steps: 2
learning_rate: 3.0e-3
eval_batches: 0
progress: false
seed: 0
"""
FAST_COMPILE = "--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"


def _env() -> dict:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("TURBO_MOE_COORDINATOR", "TURBO_MOE_NUM_PROCESSES", "TURBO_MOE_PROCESS_ID"))}
    env.update(XLA_FLAGS=FAST_COMPILE, JAX_PLATFORMS="cpu", PYTHONPATH=os.pathsep.join(
        p for p in (str(ROOT), env.get("PYTHONPATH")) if p))
    return env


def _cli(*args) -> list[str]:
    return [sys.executable, "-m", "turbo_moe.cli", *args]


@pytest.mark.parametrize("shares", [2, 4])
def test_process_shares_of_synthetic_batches_make_the_whole_batch(shares):
    """Each process draws only its rows; a row's tokens do not depend on which rows are drawn with it."""
    source = SyntheticSequences(vocab_size=300, seq_len=16)
    for step in (0, 5):
        whole = BatchIterator(source, 8, seed=3).batch_at(step)
        parts = [BatchIterator(source, 8, seed=3, process_index=i, process_count=shares).batch_at(step)
                 for i in range(shares)]
        for key in ("inputs", "targets"):
            np.testing.assert_array_equal(np.concatenate([p[key] for p in parts]), whole[key])


@pytest.fixture(scope="module")
def records(tmp_path_factory):
    """{(processes, expert_parallel): (record, output)}: for each EP, one process x 4 devices and two x 2, side by
    side (three processes on the CPU at a time)."""
    tmp = tmp_path_factory.mktemp("multiprocess")
    config = tmp / "tiny.yaml"
    config.write_text(CONFIG)
    one_process = {**_env(), "XLA_FLAGS": f"{FAST_COMPILE} --xla_force_host_platform_device_count=4"}
    out = {}
    for ep in (2, 1):
        runs = {
            1: subprocess.Popen(_cli("train", str(config), "--set", f"expert_parallel={ep}", "--record",
                                     str(tmp / f"one_ep{ep}.json")), env=one_process, cwd=tmp,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True),
            2: subprocess.Popen(_cli("launch", "--cpu-devices", "2", "--processes", "2", str(config), "--set",
                                     f"expert_parallel={ep}", "--record", str(tmp / f"two_ep{ep}.json"),
                                     "--log-dir", str(tmp / f"logs_ep{ep}")), env=_env(), cwd=tmp,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True),
        }
        for processes, proc in runs.items():
            text = proc.communicate(timeout=600)[0]
            assert proc.returncode == 0, text[-4000:]
            name = "one" if processes == 1 else "two"
            if processes == 2:  # the other process's output too
                text += "".join(p.read_text() for p in sorted((tmp / f"logs_ep{ep}").glob("*.log")))
            out[processes, ep] = json.loads((tmp / f"{name}_ep{ep}.json").read_text()), text
    return out


@pytest.mark.parametrize("ep", [2, 1])
def test_two_processes_train_as_one(records, ep):
    one, two = records[1, ep][0], records[2, ep][0]
    assert one["status"] == two["status"] == "ok"
    losses_one = np.array([row["loss"] for row in one["history"]])
    losses_two = np.array([row["loss"] for row in two["history"]])
    assert len(losses_one) == len(losses_two) == STEPS
    np.testing.assert_allclose(losses_two[0], losses_one[0], rtol=1e-6)
    np.testing.assert_allclose(losses_two, losses_one, rtol=0, atol=5e-4)
    # the same routing: every step's expert loads agree to the token
    loads = [row["load_max_over_mean"] for row in one["history"]], [row["load_max_over_mean"] for row in two["history"]]
    assert loads[0][0] == pytest.approx(loads[1][0], rel=1e-6)


@pytest.mark.parametrize("ep", [2, 1])
def test_record_names_the_processes_and_shutdown_is_clean(records, ep):
    (one, _), (two, text) = records[1, ep], records[2, ep]
    assert one["provenance"]["process_count"] == one["summary"]["process_count"] == 1
    assert two["provenance"]["process_count"] == two["summary"]["process_count"] == 2
    assert one["summary"]["n_devices"] == two["summary"]["n_devices"] == 4
    assert two["summary"]["tokens_per_step"] == one["summary"]["tokens_per_step"] == 4 * 2 * 32
    assert "status ok: 6 steps" in text
    for fault in ("Connection refused", "Traceback", "Error", "error:"):
        assert fault not in text, text[-4000:]
