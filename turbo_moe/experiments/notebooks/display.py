"""Tables for people: memory in GiB, fixed decimals, units in the row names, no raw dicts/None/nan.

The records keep every raw field (``RunResult.summary``); these tables are what a notebook shows.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from typing import Any

import pandas as pd

from turbo_moe.model.paths import DROPLESS_PATHS

GIB = 1024**3
PHASE_NAMES = {"setup": "setup", "initialisation": "init", "restore": "restore", "compilation": "compile",
               "training": "train", "evaluation": "eval", "checkpointing": "checkpoint"}


def finite(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def gib(value: Any, decimals: int = 2) -> str:
    """Bytes as GiB text ("" when unknown)."""
    return f"{value / GIB:.{decimals}f} GiB" if finite(value) else ""


def phases_text(phases: Mapping[str, float] | None) -> str:
    """``{"compilation": 33.8, ...}`` -> "compile 33.8 s, train 6.3 s" (run order, zero phases left out)."""
    parts = [f"{PHASE_NAMES.get(k, k)} {v:.1f} s" for k, v in (phases or {}).items()
             if finite(v) and v >= 0.05 and k != "done"]
    return ", ".join(parts)


def _peak_memory(v, s) -> str:
    source = str(s.get("memory_source") or "").split(" (")[0]
    return gib(v) + (f" ({source})" if source else "")


# (summary key, row name, the value's text from (value, summary)): the row shows when the value is a finite number.
_TIMING_ROWS = (
    ("final_loss", "final train loss (nats/token)", lambda v, s: f"{v:.4f}"),
    ("final_eval_loss", "final eval cross-entropy (nats/token)", lambda v, s: f"{v:.4f}"),
    ("tgs", "TGS (tokens/device/s)",
     lambda v, s: f"{v:,.0f}" + (f" (last {s['tgs_steps']} steps)" if finite(s.get("tgs_steps")) else "")),
    ("step_time_s", "step time", lambda v, s: f"{1e3 * v:.1f} ms"),
    ("mfu", "MFU", lambda v, s: f"{100 * v:.1f} %"),
    ("peak_memory_bytes", "peak memory", _peak_memory),
    ("compiled_temp_bytes", "compiled step: temporaries / total",
     lambda v, s: f"{gib(v, 3)} / {gib(s.get('compiled_total_bytes'), 3)}"),
)
_MODEL_ROWS = (
    ("load_max_over_mean_mean", "expert load max / mean", lambda v, s: f"{v:.2f} (mean over all steps; 1 = balanced)"),
    ("params_total", "parameters total / active", lambda v, s: f"{v / 1e6:,.2f} M / {s['params_active'] / 1e6:,.2f} M"),
    ("flops_per_token", "training GFLOP/token", lambda v, s: f"{v / 1e9:.4f}"),
)


def _number_rows(rows: dict[str, str], table, s: Mapping[str, Any]) -> None:
    for key, name, text in table:
        if finite(s.get(key)):
            rows[name] = text(s[key], s)


def run_summary(status: str, error: str | None, summary: Mapping[str, Any]) -> pd.DataFrame:
    """One-column table of a run: what a person asks first, with units; unknown values are left out."""
    s = summary
    path = s.get("moe_path")
    rows: dict[str, str] = {"status": status}
    if error:
        rows["error"] = error.strip().splitlines()[0][:200]
    rows["steps"] = str(s.get("steps_done", 0))
    phases = s.get("phase_seconds") or {}
    if phases:
        rows["wall time"] = f"{sum(v for v in phases.values() if finite(v)):.1f} s ({phases_text(phases)})"
    _number_rows(rows, _TIMING_ROWS, s)
    if path in DROPLESS_PATHS:
        rows["dropped token copies"] = "none (dropless path)"
    elif finite(s.get("dropped_fraction_mean")):
        rows["dropped token copies"] = f"{100 * s['dropped_fraction_mean']:.1f} % (mean over steps)"
    _number_rows(rows, _MODEL_ROWS, s)
    if finite(s.get("per_device_batch")) and finite(s.get("seq_len")):
        rows["batch x sequence (per device)"] = f"{s['per_device_batch']} x {s['seq_len']}"
    if s.get("resumed_from_step"):
        rows["resumed from step"] = str(s["resumed_from_step"])
    return pd.DataFrame({"value": list(rows.values())}, index=list(rows))


def slice_results(rows: Iterable[Mapping[str, Any]]) -> pd.DataFrame:
    """03's per-path table: TGS, measured and predicted memory as text with units; errors only where any."""
    out = []
    for r in rows:
        line = {"path": r["path"], "status": r["status"],
                "TGS (tok/dev/s)": f"{r['tgs']:,.0f}" if finite(r.get("tgs")) else "",
                "measured peak": gib(r.get("measured_bytes")),
                "memory measured as": str(r.get("memory_source") or "").split(" (")[0],
                "predicted (states + activations)": gib(r.get("predicted_bytes"), 3)}
        if r.get("error"):
            line["error"] = str(r["error"]).strip().splitlines()[0][:160]
        out.append(line)
    frame = pd.DataFrame(out).set_index("path") if out else pd.DataFrame()
    if "error" in frame:
        frame["error"] = frame["error"].fillna("")
    return frame
