"""benchmarks/hlo_schedule.py reads collective windows from scheduled HLO; benchmarks/overlap_probe.py runs on CPU
host devices and records every case of every flag set (a failure is a row)."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.benchmark_script import BENCHMARKS, load

# Both ways XLA writes an async collective: `<kind>-start` / `-done`, and `async-start` calling a computation that
# holds the collective (XLA:GPU's form in the while bodies of a training step). The first window holds a GEMM and a
# fusion, the second nothing (synchronous), the third (async-start form) the turbo permute.
SCHEDULED = """HloModule jit_train_step, is_scheduled=true

%async_computation.3 (p: bf16[8,4]) -> bf16[8,4] {
  %p = bf16[8,4]{1,0} parameter(0)
  ROOT %collective-permute.1 = bf16[8,4]{1,0} collective-permute(%p), source_target_pairs={{0,1},{1,0}}
}

ENTRY %main.1 (a: bf16[8,4], w: bf16[4,4]) -> bf16[8,4] {
  %a = bf16[8,4]{1,0} parameter(0)
  %w = bf16[4,4]{1,0} parameter(1)
  %all-gather-start = (bf16[8,4]{1,0}, bf16[16,4]{1,0}) all-gather-start(%a), dimensions={0}, metadata={op_name="jit(f)/moe/routed_experts/all_gather"}, backend_config={"collective_backend_config":{"is_sync":false}}
  %gemm.1 = bf16[8,4]{1,0} custom-call(%a, %w), custom_call_target="__cublas$lt$matmul", metadata={op_name="jit(f)/dense"}
  %fusion.1 = bf16[8,4]{1,0} fusion(%gemm.1), kind=kLoop, calls=%fused, metadata={op_name="jit(f)/add"}
  %all-gather-done = bf16[16,4]{1,0} all-gather-done(%all-gather-start)
  %all-reduce-start = bf16[8,4]{1,0} all-reduce-start(%fusion.1), to_apply=%add, backend_config={"collective_backend_config":{"is_sync":true}}
  %all-reduce-done = bf16[8,4]{1,0} all-reduce-done(%all-reduce-start)
  %collective-permute-start = ((bf16[8,4]{1,0}), bf16[8,4]{1,0}) async-start(%fusion.1), calls=%async_computation.3, metadata={op_name="jit(f)/moe/routed_experts/shard_map/ep_micro_batch1/ep_dispatch/ppermute"}
  %permute.1 = bf16[8,4]{1,0} custom-call(%a), custom_call_target="turbo_moe_permute", metadata={op_name="jit(f)/moe/routed_experts/shard_map/ep_micro_batch0/ep_experts/permute"}
  %collective-permute-done = bf16[8,4]{1,0} async-done(%collective-permute-start)
  ROOT %out = bf16[8,4]{1,0} add(%collective-permute-done, %permute.1)
}
"""


def test_windows_finds_both_async_forms():
    hlo = load("hlo_schedule")
    found = {e["kind"]: e for e in hlo.windows(hlo.parse(SCHEDULED))}
    assert set(found) == {"all-gather", "all-reduce", "collective-permute"}  # the wrapped permute counted once
    assert [k for k, _ in found["all-gather"]["inside"]] == ["__cublas$lt$matmul", "fusion:kLoop"]
    assert not found["all-gather"]["sync"]
    assert found["all-reduce"]["sync"] and found["all-reduce"]["inside"] == []
    assert found["collective-permute"]["inside"] == [("turbo_moe_permute", "mb0/experts")]
    assert found["collective-permute"]["label"] == "mb1/dispatch"
    summary = hlo.summarize(hlo.windows(hlo.parse(SCHEDULED)), show_all=True)
    assert "MoE exchange: 2 collectives, 2 with kernels inside their window, 0 synchronous" in summary
    assert "other collectives: 1 collectives, 0 with kernels inside their window, 1 synchronous" in summary


@pytest.mark.slow
def test_probe_runs_every_case_on_cpu_host_devices(tmp_path):
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="--xla_force_host_platform_device_count=2")
    proc = subprocess.run([sys.executable, str(BENCHMARKS / "overlap_probe.py"), "--out", str(tmp_path), "--small",
                           "--reps", "2", "--flag-sets", "default,group", "--cases", "ppermute,two_chains"],
                          env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    record = json.loads((tmp_path / "overlap_probe.json").read_text())
    rows = {(r["flag_set"], r["case"]): r for r in record["rows"]}
    assert set(rows) == {(f, c) for f in ("default", "group") for c in ("ppermute", "two_chains")}
    for row in rows.values():
        assert row["status"] == "ok", row
        assert row["devices"] == 2 and row["both_ms"] > 0
    assert rows[("default", "two_chains")]["collectives"] == 4  # two all_to_all a micro-batch
    assert record["provenance"]["jax_version"]


def test_probe_refuses_unknown_cases(tmp_path):
    proc = subprocess.run([sys.executable, str(BENCHMARKS / "overlap_probe.py"), "--out", str(tmp_path),
                           "--cases", "ppermute,bogus"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "--cases: unknown ['bogus']" in proc.stderr
