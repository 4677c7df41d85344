"""Check a migration's report: drawn from the result files (as the report read them before the store) and from
the store with the same drawing code, the figures and ``results.md`` must be the same.

``compare_figures`` compares two folders of drawn figures pixel by pixel.
"""

from __future__ import annotations

from pathlib import Path

import matplotlib
import matplotlib.image as mpimg
import numpy as np
import pandas as pd

from turbo_moe.experiments.report import figures, report
from turbo_moe.experiments.store import results, store
from turbo_moe.experiments.store.result_records import campaign_of


def compare_figures(before: str | Path, after: str | Path) -> dict[str, str]:
    """name -> "same" / "differs (n pixels)" / "only before" / "only after", for every PNG and .md file."""
    before, after = Path(before), Path(after)
    names = sorted({p.name for p in before.glob("*") if p.suffix in (".png", ".md")} |
                   {p.name for p in after.glob("*") if p.suffix in (".png", ".md")})
    out = {}
    for name in names:
        a, b = before / name, after / name
        if not a.exists() or not b.exists():
            out[name] = "only before" if a.exists() else "only after"
        elif name.endswith(".md"):
            out[name] = "same" if a.read_text() == b.read_text() else "differs"
        else:
            x, y = mpimg.imread(a), mpimg.imread(b)
            if x.shape != y.shape:
                out[name] = f"differs (size {x.shape[:2]} vs {y.shape[:2]})"
            else:
                n = int(np.any(x != y, axis=-1).sum())
                out[name] = "same" if n == 0 else f"differs ({n} pixels)"
    return out


def report_data_from_files(results_dir: str | Path):
    """The report's data read the way the report read it before the store (tables and JSON records under
    ``results_dir``): the 'before' side of the migration's figure comparison."""
    frame = figures.with_path_labels(results.load_results(results_dir))
    histories, loads = [], {}
    for sweep in report.comparison_sweeps(frame) if not frame.empty else []:
        for _, row in frame[(frame["sweep"] == sweep) & frame["record_path"].notna()].iterrows():
            record = results.load_record(row["record_path"]) or {}
            history = pd.DataFrame(record.get("history") or [])
            if len(history) >= report.MIN_CURVE_STEPS and "step" in history:
                histories.append(history.assign(sweep=sweep, point=row["point"], label=row["path"],
                                                moe_path=row["moe_path"]))
            if record.get("expert_load"):
                loads.setdefault(sweep, {})[row["path"]] = np.asarray(record["expert_load"], dtype=float)
    kernels = results.load_kernel_tables(results_dir)
    # The campaign each row belongs to, as the store names it (the figures' footers and results.md say it).
    if not frame.empty:
        frame["campaign"] = [campaign_of(f"{s}.csv") for s in frame["sweep"]]
    if not kernels.empty:
        kernels["campaign"] = [campaign_of(f"{t}.csv") for t in kernels["table"]]
    histories = pd.concat(histories, ignore_index=True) if histories else pd.DataFrame()
    phases = report.routing_phases(histories)
    if not phases.empty:
        frame = frame.merge(phases, on=["sweep", "point"], how="left")
    return report.ReportData(results=frame, histories=histories, loads=loads, kernels=kernels)


def compare_report(results_dir: str | Path, store_dir: str | Path, out_dir: str | Path) -> dict[str, str]:
    """Draw the report from the files (``out_dir/before``) and from the store (``out_dir/after``, every
    campaign, as the files held them all) with the same drawing code; compare the figures and results.md."""
    matplotlib.use("Agg")  # files only, also on a machine with a display
    out_dir = Path(out_dir)
    report.draw_report(report_data_from_files(results_dir), out_dir / "before")
    report.draw_report(report.load_report_data(store_dir, store.campaign_names(store_dir)), out_dir / "after")
    return compare_figures(out_dir / "before", out_dir / "after")
