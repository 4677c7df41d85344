"""The report: load every results table, draw the figures into ``experiments/figures/``, write a table.

``build_report`` does everything in-process; ``run_report_notebook`` executes ``notebooks/04_report``
(which calls ``load_report_data`` and ``draw`` cell by cell) through papermill. Figures whose data is
missing are skipped with a note, never an error. Outputs::

    figures/<name>.png      one file per figure (see FIGURES)
    figures/results.md      a markdown results table (the README's table)
    figures/report.json     manifest: figure -> file (relative to the figures folder) or skip note;
                            no machine paths, identical for identical results
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd
import seaborn as sns

from turbo_moe.experiments import figures, results

MIN_CURVE_STEPS = 20  # shorter runs (throughput probes) are noise on a loss plot
# Routing phases of a run, as fractions of its logged steps: the router as at init (before the warm-up
# collapse) and the last quarter (balanced once the bias has caught up; experiments/NOTES.md, issue 13).
ROUTING_PHASES = {"init": (0.0, 0.05), "late": (0.75, 1.0)}
MANIFEST = "report.json"


@dataclasses.dataclass
class ReportData:
    """Everything the figures draw from."""

    results: pd.DataFrame  # latest row per (sweep, point), with a ``path`` label column where known
    histories: pd.DataFrame  # long format: sweep, point, label, moe_path, step, loss, eval_loss, ...
    loads: dict[str, dict[str, np.ndarray]]  # sweep -> {label: (L_moe, E) final expert load}
    kernels: pd.DataFrame  # kernel benchmark tables, concatenated


@dataclasses.dataclass
class ReportSummary:
    figures_dir: Path
    entries: dict[str, str] = dataclasses.field(default_factory=dict)  # name -> file name or "skipped: why"

    def lines(self) -> list[str]:
        where = Path(self.figures_dir).resolve()
        return [f"{name}: {what if what.startswith('skipped') else where / what}"
                for name, what in self.entries.items()] + [f"figures in {where}"]

    def save(self) -> None:
        (self.figures_dir / MANIFEST).write_text(json.dumps(self.entries, indent=1) + "\n")

    @classmethod
    def load(cls, figures_dir: Path) -> ReportSummary:
        return cls(Path(figures_dir), json.loads((Path(figures_dir) / MANIFEST).read_text()))


def comparison_sweeps(frame: pd.DataFrame) -> list[str]:
    """Sweeps that compare paths at one setting (loss/load figures): each path label has one point,
    whatever its status, and at least one point has a record. A batch or dataset sweep has several."""
    frame = figures.with_path_labels(frame)
    chosen = []
    for sweep, rows in frame.groupby("sweep"):
        recorded = rows[rows["status"].isin(["ok", "nan"]) & rows["record_path"].notna()]
        if len(recorded) >= 1 and rows["path"].is_unique:
            chosen.append(str(sweep))
    return chosen


def check_parameters(results_dir: str | Path, figures_dir: str | Path) -> tuple[Path, Path]:
    """04's parameter check, before anything is drawn: ``results_dir`` must exist and hold result tables
    (``*.csv``); ``figures_dir`` is created if its parent exists. ValueError names the parameter."""
    results_path, figures_path = Path(results_dir), Path(figures_dir)
    if not results_path.is_dir():
        raise ValueError(f"parameter results_dir: {str(results_dir)!r} is not a folder "
                         f"(resolved: {results_path.resolve()})")
    if not any(results_path.glob("*.csv")):
        raise ValueError(f"parameter results_dir: {str(results_dir)!r} holds no results tables (*.csv); "
                         "run a sweep first (turbo-moe sweep experiments/sweeps/cpu_default.yaml)")
    if figures_path.exists() and not figures_path.is_dir():
        raise ValueError(f"parameter figures_dir: {str(figures_dir)!r} exists and is not a folder")
    if not figures_path.parent.is_dir():
        raise ValueError(f"parameter figures_dir: the parent folder of {str(figures_dir)!r} does not exist "
                         f"(resolved: {figures_path.parent.resolve()})")
    figures_path.mkdir(exist_ok=True)
    return results_path, figures_path


def load_report_data(results_dir: str | Path) -> ReportData:
    """Read all results tables, the comparison sweeps' records and the kernel tables."""
    frame = figures.with_path_labels(results.load_results(results_dir)) if Path(results_dir).exists() else \
        pd.DataFrame()
    histories, loads = [], {}
    for sweep in comparison_sweeps(frame) if not frame.empty else []:
        rows = frame[(frame["sweep"] == sweep) & frame["record_path"].notna()]
        for _, row in rows.iterrows():
            record = results.load_record(row["record_path"]) or {}
            history = pd.DataFrame(record.get("history") or [])
            if len(history) >= MIN_CURVE_STEPS and "step" in history:
                histories.append(history.assign(sweep=sweep, point=row["point"], label=row["path"],
                                                moe_path=row["moe_path"]))
            if record.get("expert_load"):
                loads.setdefault(sweep, {})[row["path"]] = np.asarray(record["expert_load"], dtype=float)
    kernels = results.load_kernel_tables(results_dir) if Path(results_dir).exists() else pd.DataFrame()
    histories = pd.concat(histories, ignore_index=True) if histories else pd.DataFrame()
    phases = routing_phases(histories)
    if not phases.empty:
        frame = frame.merge(phases, on=["sweep", "point"], how="left")
    return ReportData(
        results=frame,
        histories=histories,
        loads=loads,
        kernels=kernels,
    )


def routing_phases(histories: pd.DataFrame) -> pd.DataFrame:
    """Per (sweep, point): mean dropped fraction and max/mean expert load in each ROUTING_PHASES window
    (columns dropped_<phase>, load_<phase>). The first window is at least one step."""
    if histories.empty or "load_max_over_mean" not in histories:
        return pd.DataFrame()
    rows = []
    for (sweep, point), run in histories.groupby(["sweep", "point"], sort=False):
        run = run.sort_values("step").reset_index(drop=True)
        row = {"sweep": sweep, "point": point}
        for phase, (lo, hi) in ROUTING_PHASES.items():
            part = run.iloc[int(lo * len(run)):max(int(hi * len(run)), int(lo * len(run)) + 1)]
            for column, name in (("dropped_fraction", "dropped"), ("load_max_over_mean", "load")):
                values = pd.to_numeric(part.get(column, pd.Series(dtype=float)), errors="coerce")
                row[f"{name}_{phase}"] = float(values.mean()) if values.notna().any() else np.nan
        rows.append(row)
    return pd.DataFrame(rows)


def figure_builders(data: ReportData) -> dict[str, object]:
    """name -> zero-argument callable drawing that figure (None when its data is missing)."""
    builders = {
        "tgs_vs_batch": lambda: figures.tgs_vs_batch(data.results),
        "peak_memory": lambda: figures.peak_memory(data.results),
        "loss_curves": lambda: figures.loss_curves(data.histories, data.results),
        "dropped_fraction": lambda: figures.dropped_fraction(data.histories, data.results),
        "expert_load_over_steps": lambda: figures.load_over_steps(data.histories, data.results, ROUTING_PHASES),
        "synthetic_vs_real": lambda: figures.synthetic_vs_real(data.results),
    }
    for sweep, loads in data.loads.items():
        rows = data.results[data.results["sweep"] == sweep]
        builders[f"expert_load_{sweep}"] = lambda loads=loads, rows=rows: figures.expert_load_heatmaps(loads, rows)
    if data.loads == {}:
        builders["expert_load"] = lambda: None
    tables = data.kernels.groupby("table") if not data.kernels.empty else []
    for table, rows in tables:
        # One figure per routing (the first keeps the plain name the README links to).
        for i, routing in enumerate(figures.kernel_routings(rows) or [None]):
            name = str(table).replace("kernels_", "kernel_tflops_") + (f"_{routing}" if i else "")
            builders[name] = lambda rows=rows, routing=routing: figures.kernel_tflops(rows, routing)
    if data.kernels.empty:
        builders["kernel_tflops"] = lambda: None
    return builders


_WHY_MISSING = {
    "tgs_vs_batch": "no sweep varies per_device_batch (e.g. experiments/sweeps/gpu_paths_x_batch.yaml)",
    "peak_memory": "no ok rows with peak_memory_bytes",
    "loss_curves": f"no sweep with one ok point per path and >= {MIN_CURVE_STEPS} logged steps",
    "dropped_fraction": "no dense_cf history in a path-comparison sweep",
    "expert_load_over_steps": "no history with load_max_over_mean in a path-comparison sweep",
    "synthetic_vs_real": "no sweep varies dataset (e.g. experiments/sweeps/gpu_synthetic_vs_real.yaml)",
    "expert_load": "no record with expert_load in a path-comparison sweep",
    "kernel_tflops": "no experiments/results/kernels_<device>.csv table with shape, impl, tflops",
}


def draw(name: str, builder, figures_dir: str | Path, summary: ReportSummary | None = None):
    """Draw one figure, save it as ``<figures_dir>/<name>.png``; print a note and return None if skipped."""
    sns.set_theme(style="whitegrid", context="notebook")
    fig = builder()
    if fig is None:
        why = _WHY_MISSING.get(name, "no data")
        print(f"skipped {name}: {why}")
        if summary is not None:
            summary.entries[name] = f"skipped: {why}"
        return None
    figures_dir = Path(figures_dir)
    figures_dir.mkdir(parents=True, exist_ok=True)
    out = figures_dir / f"{name}.png"
    fig.savefig(out, dpi=110, bbox_inches="tight")
    if summary is not None:
        summary.entries[name] = out.name  # relative: the manifest must not hold this machine's paths
    return fig


def results_markdown(frame: pd.DataFrame) -> str:
    """The README results table: one line per point, key numbers with units."""
    if frame.empty:
        return "_no results yet_\n"
    columns = {
        "sweep": "sweep", "path": "path", "per_device_batch": "batch/device", "dataset": "data",
        "steps": "steps", "status": "status", "tgs": "TGS (tok/dev/s)", "peak_gib": "peak mem (GiB)",
        "final_loss": "final loss", "final_eval_loss": "eval loss", "dropped_fraction_mean": "dropped",
        "dropped_init": "dropped, first 5% of steps", "dropped_late": "dropped, last 25%",
        "load_init": "load max/mean, first 5%", "load_late": "load max/mean, last 25%",
        "device_kind": "device",
    }
    frame = frame.copy()
    if "peak_memory_bytes" in frame:
        frame["peak_gib"] = pd.to_numeric(frame["peak_memory_bytes"], errors="coerce") / figures.GIB
    present = [c for c in columns if c in frame]
    lines = ["| " + " | ".join(columns[c] for c in present) + " |", "|" + "---|" * len(present)]
    for _, row in frame[present].iterrows():
        lines.append("| " + " | ".join(_fmt(row[c]) for c in present) + " |")
    return "\n".join(lines) + "\n"


def _fmt(value: object) -> str:
    if value is None or (isinstance(value, float) and np.isnan(value)):
        return ""
    if isinstance(value, float):
        return f"{value:.4g}" if abs(value) < 1e4 else f"{value:,.0f}"
    return str(value)


def build_report(results_dir: str | Path, figures_dir: str | Path, *, close: bool = True) -> ReportSummary:
    """Draw every figure and the results table from ``results_dir`` into ``figures_dir``."""
    data = load_report_data(results_dir)
    summary = ReportSummary(Path(figures_dir))
    Path(figures_dir).mkdir(parents=True, exist_ok=True)
    for name, builder in figure_builders(data).items():
        fig = draw(name, builder, figures_dir, summary)
        if fig is not None and close:
            plt.close(fig)
    write_results_table(data, figures_dir, summary)
    summary.save()
    return summary


def write_results_table(data: ReportData, figures_dir: str | Path, summary: ReportSummary) -> Path:
    out = Path(figures_dir) / "results.md"
    out.write_text(results_markdown(data.results))
    summary.entries["results_table"] = out.name
    return out


def run_report_notebook(
    notebook: str | Path, out: str | Path, results_dir: str | Path, figures_dir: str | Path, *,
    kernel: str = "turbo-moe",
) -> ReportSummary:
    """Execute the report notebook through papermill and return the manifest it wrote."""
    import papermill

    from turbo_moe.experiments.runner import check_kernel

    notebook = Path(notebook)
    if not notebook.is_file():
        raise ValueError(f"report notebook {str(notebook)!r} does not exist (run from the repository root)")
    check_kernel(kernel)
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    papermill.execute_notebook(
        str(notebook), str(out), kernel_name=kernel, cwd=str(notebook.parent), progress_bar=False,
        parameters={"results_dir": str(Path(results_dir).resolve()),
                    "figures_dir": str(Path(figures_dir).resolve())},
    )
    return ReportSummary.load(Path(figures_dir))
