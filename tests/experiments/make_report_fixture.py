"""Regenerate tests/experiments/fixtures/results/: a small, made-up but well-formed results tree.

Run: PYTHONPATH=. python tests/experiments/make_report_fixture.py
It holds a batch sweep with an OOM point, a path-comparison sweep with records (history, expert load),
a synthetic-vs-real sweep and a kernel table, so every report figure has something to draw.
Numbers are synthetic; only their layout matters to the tests.
"""

import json
import math
import shutil
from pathlib import Path

import numpy as np

from turbo_moe.experiments.store.results import append_row

OUT = Path(__file__).parent / "fixtures" / "results"
PROV = {"device_kind": "NVIDIA H100 80GB HBM3", "device_count": 1, "platform": "gpu",
        "jax_version": "0.10.2", "git_commit": "abc1234567", "date": "2026-11-21T20:00:00+00:00"}
PATHS = [("dense_cf", 1.0), ("dense_cf", 2.0), ("ragged", None), ("turbo", None)]


def _row(sweep, point, status, params, **summary):
    return {"sweep": sweep, "point": point, "point_key": "0" * 12, "status": status, "error": None,
            **params, **summary, **PROV, "elapsed_s": 10.0, "record": None, "notebook_out": "runs/x.ipynb"}


def batch_sweep():
    for path, cf in PATHS:
        for batch in (1, 2, 4, 8):
            params = {"moe_path": path, "capacity_factor": cf, "per_device_batch": batch, "model": "reduced"}
            name = f"{path}_{cf}_{batch}"
            if path == "dense_cf" and cf == 2.0 and batch == 8:
                append_row(OUT / "paths_x_batch.csv", {**_row("paths_x_batch", name, "oom", params),
                                                       "error": "RESOURCE_EXHAUSTED: 80.1GiB"})
                continue
            speed = {"dense_cf": 0.8 if cf == 1.0 else 0.6, "ragged": 0.7, "turbo": 1.0}[path]
            append_row(OUT / "paths_x_batch.csv", _row(
                "paths_x_batch", name, "ok", params, tgs=4000 * speed * math.log2(2 * batch),
                peak_memory_bytes=int(batch * (8 + 4 * (cf or 1)) * 2**30)))


def loss_sweep(rng):
    for i, (path, cf) in enumerate(PATHS):
        name = f"moe_path-{path}" + (f"__capacity_factor-{cf}" if cf else "")
        steps = np.arange(1, 41)
        loss = 5.5 * np.exp(-steps / (15 + 3 * i)) + 1.5 + 0.02 * rng.standard_normal(40)
        history = [{"step": int(s), "loss": float(l) + 0.3, "ce_loss": float(l), "eval_loss": float(l + 0.1) if s % 10 == 0 else float("nan"),
                    "tgs": 1000.0, "dropped_fraction": (0.2 / cf) * math.exp(-s / 30) if cf else 0.0,
                    "load_max_over_mean": 1.3 + 3 * math.exp(-s / 10)}
                   for s, l in zip(steps, loss)]
        record = {"status": "ok", "error": None, "history": history,
                  "summary": {"tgs": 1000.0 + 100 * i, "final_loss": float(loss[-1])},
                  "expert_load": rng.integers(50, 150, size=(2, 8)).tolist(), "provenance": PROV}
        rel = f"cpu_loss/{name}.json"
        (OUT / rel).parent.mkdir(parents=True, exist_ok=True)
        (OUT / rel).write_text(json.dumps(record))
        params = {"moe_path": path, "capacity_factor": cf, "steps": 40, "dataset": "shakespeare"}
        append_row(OUT / "cpu_loss.csv", {**_row("cpu_loss", name, "ok", params, tgs=1000.0 + 100 * i,
                                                 final_loss=float(loss[-1]), dropped_fraction_mean=0.1),
                                          "record": rel})


def data_sweep():
    for path, cf in PATHS[1:]:
        for dataset, factor in (("synthetic", 1.05), ("shakespeare", 1.0)):
            params = {"moe_path": path, "capacity_factor": cf, "dataset": dataset, "per_device_batch": 4}
            append_row(OUT / "synthetic_vs_real.csv", _row(
                "synthetic_vs_real", f"{path}_{dataset}", "ok", params, tgs=3000 * factor))


def kernel_table():
    """Layout of benchmarks/grouped_gemm.py: dense rows have routing "-"; a skipped baseline has no ms."""
    lines = ["shape,M,K,N,G,routing,op,impl,ms,tflops,status,device,commit,date"]
    for shape in ("dsv3_gate_up_G32_M32768", "dsv3_down_G32_M32768"):
        for op in ("fwd", "dgrad", "wgrad"):
            lines.append(f"{shape},32768,7168,4096,32,-,{op},dense,1.0,700,ok,NVIDIA H100 80GB HBM3,abc1234,2026-11-21T20:00Z")
            for routing, factor in (("balanced", 1.0), ("skewed", 0.9)):
                lines.append(f"{shape},32768,7168,4096,32,{routing},{op},turbo,1.0,{550 * factor},ok,"
                             "NVIDIA H100 80GB HBM3,abc1234,2026-11-21T20:00Z")
                lines.append(f"{shape},32768,7168,4096,32,{routing},{op},pallas,1.0,{300 * factor},ok,"
                             "NVIDIA H100 80GB HBM3,abc1234,2026-11-21T20:00Z")
        lines.append(f"{shape},32768,7168,4096,32,balanced,fwd,ragged_dot,,,skipped: dense expansion,"
                     "NVIDIA H100 80GB HBM3,abc1234,2026-11-21T20:00Z")
    lines.append("T4096_H7168_k8_E256,32768,7168,8,256,uniform,permute,turbo,0.5,,ok,NVIDIA H100 80GB HBM3,abc1234,"
                 "2026-11-21T20:00Z")
    (OUT / "kernels_h100.csv").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    shutil.rmtree(OUT, ignore_errors=True)
    OUT.mkdir(parents=True)
    batch_sweep()
    loss_sweep(np.random.default_rng(0))
    data_sweep()
    kernel_table()
    print(f"wrote {sorted(p.name for p in OUT.iterdir())}")
