"""One provenance schema (runs, sweeps, benchmarks), one status list, one OOM detector."""
import importlib.util
import subprocess
import sys
from pathlib import Path

import jax
import pandas as pd
import pytest

from turbo_moe import provenance as P
from turbo_moe import status
from turbo_moe.experiments.store import results
from turbo_moe.experiments.sweep import runner
from turbo_moe.train import STATUSES as RUN_STATUSES
from turbo_moe.train import metrics

REPO = Path(__file__).resolve().parents[1]


def test_collect_fills_every_field():
    prov = P.collect()
    assert set(prov) == set(P.FIELDS)
    assert prov["device_kind"] == jax.devices()[0].device_kind and prov["device_count"] == jax.device_count()
    assert prov["jax_version"] == jax.__version__ and prov["grouped_gemm"] == "cpu"
    assert "libturbo_moe_cpu" in prov["kernel_library"] and "sha256:" in prov["kernel_library"]
    assert prov["git_commit"] and prov["date"].endswith("+00:00")


def test_collect_without_devices_leaves_device_fields_empty():
    prov = P.collect(devices=False)
    assert all(prov[k] is None for k in P.DEVICE_FIELDS) and prov["jax_version"] == jax.__version__


def test_env_names_the_commit(monkeypatch, tmp_path):
    monkeypatch.setenv("TURBO_MOE_GIT_COMMIT", "abc1234+copied tree")
    assert P.git_info(tmp_path) == {"git_commit": "abc1234+copied tree", "git_dirty": None}
    monkeypatch.delenv("TURBO_MOE_GIT_COMMIT")
    assert P.git_info(tmp_path)["git_commit"] == P.UNKNOWN_COMMIT  # not a checkout


def test_run_sweep_and_benchmark_share_the_schema(monkeypatch):
    monkeypatch.setenv("TURBO_MOE_GIT_COMMIT", "deadbeef")
    run = metrics.provenance({"steps": 1}, {}, {})
    assert set(P.FIELDS) <= set(run) and run["config"] == {"steps": 1}
    row = runner.provenance({})  # a point that failed before writing its record
    assert list(row) == list(P.TABLE_COLUMNS) and row["git_commit"] == "deadbeef" and row["device_kind"] is None
    spec = importlib.util.spec_from_file_location("_bench_prov", REPO / "benchmarks" / "_provenance.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    assert set(bench.provenance()) == set(P.FIELDS) and bench.git_commit() == "deadbeef"


def test_old_spellings_are_read():
    row = runner.provenance({"device": "NVIDIA H200", "jax": "0.10.2", "commit": "abc", "date": "2026-11-20"})
    assert row["device_kind"] == "NVIDIA H200" and row["jax_version"] == "0.10.2" and row["git_commit"] == "abc"
    assert P.normalize({"device": "old", "device_kind": "new"}) == {"device_kind": "new"}


def test_old_kernel_tables_load_with_schema_columns(tmp_path):
    pd.DataFrame([{"device": "NVIDIA H200", "jax": "0.10.2", "commit": "abc", "date": "d", "impl": "turbo",
                   "tflops": 1.0}]).to_csv(tmp_path / "kernels_h200.csv", index=False)
    table = results.load_kernel_tables(tmp_path)
    assert {"device_kind", "jax_version", "git_commit"} <= set(table) and "device" not in table


def test_committed_kernel_tables_load():
    """The committed kernel benchmark records (results store), old spellings of provenance included."""
    from turbo_moe.experiments.report import report

    table = report.load_report_data(REPO / "experiments" / "store", ["kernels_h100_80gb_hbm3", "kernels_h200"]).kernels
    assert set(table["campaign"]) == {"kernels_h100_80gb_hbm3", "kernels_h200"}
    assert table["device_kind"].notna().all() and table["git_commit"].notna().all()


def test_one_status_list():
    assert RUN_STATUSES == status.RUN_STATUSES and results.STATUSES == status.STATUSES
    assert set(status.FINAL_STATUSES) < set(status.RUN_STATUSES) < set(status.STATUSES)


@pytest.mark.parametrize("message, oom", [
    ("RESOURCE_EXHAUSTED: Out of memory while trying to allocate 17179869184 bytes.", True),
    ("RESOURCE_EXHAUSTED: Failed to allocate request for 4.00GiB (4294967296B) on device ordinal 0", True),
    ("CUDA error: out of memory", True),
    ("XlaRuntimeError: OOM when allocating tensor", True),
    ("RESOURCE_EXHAUSTED: Error writing local file: No space left on device [OS error: 28]", False),
    ("OSError: [Errno 122] Disk quota exceeded: '/ckpt/2'", False),
    ("ValueError: oom_frontier must name a parameter", False),
    ("DeadKernelError: Kernel died (the kernel died; a host out-of-memory kill is a common cause)", False),
])
def test_one_oom_detector_for_runs_and_sweeps(message, oom):
    assert status.is_oom(message) is oom
    assert metrics.is_oom(RuntimeError(message)) is oom  # a training run's exception
    assert (runner.classify_error(RuntimeError(message))[0] == "oom") is oom  # a sweep point's message


def test_oom_detector_follows_the_cause():
    try:
        try:
            raise OSError(28, "No space left on device")
        except OSError as disk:
            raise RuntimeError("RESOURCE_EXHAUSTED: checkpoint write failed") from disk
    except RuntimeError as err:
        assert not status.is_oom(err)
    assert status.is_oom(MemoryError())


def test_provenance_imports_no_jax():
    code = "import sys, turbo_moe.provenance, turbo_moe.status; print('jax' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_sweep_outputs_do_not_make_the_tree_dirty(monkeypatch, tmp_path):
    monkeypatch.delenv("TURBO_MOE_GIT_COMMIT", raising=False)
    git = lambda *args: subprocess.run(["git", "-C", str(tmp_path), *args], check=True, capture_output=True)
    (tmp_path / "experiments" / "results").mkdir(parents=True)
    (tmp_path / "experiments" / "results" / "t.csv").write_text("a\n1\n")
    (tmp_path / "code.py").write_text("x = 1\n")
    git("init", "-q")
    git("add", ".")
    git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "init")
    assert P.git_info(tmp_path)["git_dirty"] is False
    (tmp_path / "experiments" / "results" / "t.csv").write_text("a\n1\n2\n")  # a sweep appended a row
    assert P.git_info(tmp_path)["git_dirty"] is False
    (tmp_path / "code.py").write_text("x = 2\n")
    info = P.git_info(tmp_path)
    assert info["git_dirty"] is True and info["git_commit"].endswith("-dirty")
