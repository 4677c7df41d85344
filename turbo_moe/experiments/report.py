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

from turbo_moe import provenance
from turbo_moe.experiments import convergence, figures, results, store

MIN_CURVE_STEPS = 20  # shorter runs (throughput probes) are noise on a loss plot
# Routing phases of a run, as fractions of its logged steps: the router as at init (before the warm-up
# collapse) and the last quarter (balanced once the bias has caught up; docs/notes/routing.md).
ROUTING_PHASES = {"init": (0.0, 0.05), "late": (0.75, 1.0)}
MANIFEST = "report.json"


@dataclasses.dataclass
class ReportData:
    """Everything the figures draw from."""

    results: pd.DataFrame  # latest row per (sweep, point), with a ``path`` label column where known
    histories: pd.DataFrame  # long format: sweep, point, label, moe_path, step, loss, eval_loss, ...
    loads: dict[str, dict[str, np.ndarray]]  # sweep -> {label: (L_moe, E) final expert load}
    kernels: pd.DataFrame  # kernel benchmark tables, concatenated
    drop_penalty: list = dataclasses.field(default_factory=list)  # convergence.records_from_store


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


def check_parameters(store_dir: str | Path, figures_dir: str | Path) -> tuple[Path, Path]:
    """04's parameter check, before anything is drawn: ``store_dir`` must be a results store holding records;
    ``figures_dir`` is created if its parent exists. ValueError names the parameter."""
    store_path, figures_path = Path(store_dir), Path(figures_dir)
    if not store_path.is_dir():
        raise ValueError(f"parameter store_dir: {str(store_dir)!r} is not a folder "
                         f"(resolved: {store_path.resolve()})")
    if not store.campaign_names(store_path):
        raise ValueError(f"parameter store_dir: {str(store_dir)!r} holds no records (records/campaign=*/); run a "
                         "sweep and `turbo-moe report`, or python -m turbo_moe.experiments.migrate")
    if figures_path.exists() and not figures_path.is_dir():
        raise ValueError(f"parameter figures_dir: {str(figures_dir)!r} exists and is not a folder")
    if not figures_path.parent.is_dir():
        raise ValueError(f"parameter figures_dir: the parent folder of {str(figures_dir)!r} does not exist "
                         f"(resolved: {figures_path.parent.resolve()})")
    figures_path.mkdir(exist_ok=True)
    return store_path, figures_path


def default_store(results_dir: str | Path) -> Path:
    """The store next to a results folder: experiments/results -> experiments/store."""
    return Path(results_dir).parent / "store"


def ingest_live_tables(results_dir: str | Path, store_dir: str | Path) -> dict[str, int]:
    """Bring the sweep runner's and benchmarks' tables under ``results_dir`` into the store (only files
    that changed since the last ingest)."""
    from turbo_moe.experiments import migrate

    return migrate.ingest(results_dir, store_dir, quiet=True)


def _source_tables(store_dir: Path, campaigns: list[str], keep) -> list[tuple[str, str, pd.DataFrame]]:
    """(campaign, source, table) for every top-level table of ``campaigns`` whose columns pass ``keep``,
    rebuilt as it was written, with a ``store_record`` column (the record id of each row)."""
    out = []
    sources = store.read_sources(store_dir, campaigns)
    sources = sources[(sources["format"] == "csv") & ~sources["path"].str.contains("/")]
    records = store.read_records(store_dir, campaigns)
    for _, source in sources.sort_values("path").iterrows():
        columns = json.loads(source["columns"])
        if not keep(source["path"], columns):
            continue
        rows = records[(records["campaign"] == source["campaign"]) & (records["source"] == source["path"])]
        # Rows in the order they were measured (a table ingested again after a fresh run adds rows).
        rows = rows.assign(_order=[json.loads(e).get("_row", i) for i, e in enumerate(rows["extra"])],
                           _date=rows["date"].fillna("")).sort_values(["_date", "_order"], kind="stable")
        table = store.table_frame(rows, columns)
        if not table.empty:
            out.append((source["campaign"], source["path"], table.assign(store_record=list(rows["record"]))))
    return out


def load_report_data(store_dir: str | Path = store.DEFAULT_STORE, campaigns: list[str] | None = None) -> ReportData:
    """Sweep results, the comparison sweeps' histories and expert loads, and the kernel tables, from the
    store (``campaigns``: default every campaign whose status is current)."""
    store_dir = Path(store_dir)
    if campaigns is None:
        campaigns = store.current_campaigns(store_dir) if store_dir.is_dir() else []
    sweeps = _source_tables(store_dir, campaigns, lambda path, cols: not Path(path).name.startswith("kernels_")
                            and "point" in cols)
    frames = []
    for campaign, path, table in sweeps:
        if "sweep" not in table:
            table["sweep"] = Path(path).stem
        frames.append(table.assign(campaign=campaign))
    frame = results.latest_rows(pd.concat(frames, ignore_index=True)) if frames else pd.DataFrame()
    records = store.read_records(store_dir, campaigns) if campaigns else pd.DataFrame(columns=["record", "extra"])
    documents = {r: json.loads(e) for r, e in zip(records["record"], records["extra"])}
    if not frame.empty:
        frame["record_path"] = [r if "_record_file" in documents.get(r, {}) else None for r in frame["store_record"]]
        loads_at_run = dict(zip(records["record"], [json.loads(p).get("load_per_core") for p in records["provenance"]]))
        frame["load_per_core"] = [loads_at_run.get(r) for r in frame["store_record"]]
        frame = figures.with_path_labels(frame)
    histories, loads = [], {}
    chosen = comparison_sweeps(frame) if not frame.empty else []
    wanted = frame[frame["sweep"].isin(chosen) & frame["record_path"].notna()] if chosen else frame.iloc[0:0]
    steps = store.read_history(store_dir, sorted(set(wanted["campaign"])), records=wanted["record_path"]) \
        if len(wanted) else pd.DataFrame()
    for _, row in wanted.iterrows():
        history = steps[steps["record"] == row["record_path"]].drop(columns=["campaign", "record"]) \
            .dropna(axis=1, how="all").reset_index(drop=True)
        if len(history) >= MIN_CURVE_STEPS and "step" in history:
            histories.append(history.assign(sweep=row["sweep"], point=row["point"], label=row["path"],
                                            moe_path=row["moe_path"]))
        load = documents[row["record_path"]].get("document", {}).get("expert_load")
        if load:
            loads.setdefault(row["sweep"], {})[row["path"]] = np.asarray(load, dtype=float)
    kernel_tables = _source_tables(store_dir, campaigns, lambda path, cols: Path(path).name.startswith("kernels_")
                                   and {"shape", "impl", "tflops"} <= set(cols))
    kernels = [_schema_columns(t.drop(columns="store_record")).assign(table=Path(p).stem, campaign=c)
               for c, p, t in kernel_tables]
    kernels = pd.concat(kernels, ignore_index=True) if kernels else pd.DataFrame()
    histories = pd.concat(histories, ignore_index=True) if histories else pd.DataFrame()
    phases = routing_phases(histories)
    if not phases.empty:
        frame = frame.merge(phases, on=["sweep", "point"], how="left")
    return ReportData(results=frame, histories=histories, loads=loads, kernels=kernels,
                      drop_penalty=convergence.records_from_store(store_dir, campaigns))


def _schema_columns(table: pd.DataFrame) -> pd.DataFrame:
    """Old benchmark tables spelled provenance ``device``/``jax``/``commit``: the schema's names instead."""
    renames = {old: new for old, new in provenance.LEGACY_NAMES.items() if old in table and new not in table}
    return table.rename(columns=renames)


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


def _drop_penalty(records: list[dict]):
    """The drop-penalty figure with the report's provenance footer (its runs' devices, dates, commits, campaign)."""
    if not records:
        return None
    fig = convergence.plot_drop_penalty(records, None)
    keys = ("device_kind", "date", "git_commit", "campaign", "load_per_core")
    return figures.add_provenance(fig, pd.DataFrame([{k: r.get(k) for k in keys} for r in records]))


def figure_builders(data: ReportData) -> dict[str, object]:
    """name -> zero-argument callable drawing that figure (None when its data is missing)."""
    builders = {
        "tgs_vs_batch": lambda: figures.tgs_vs_batch(data.results),
        "peak_memory": lambda: figures.peak_memory(data.results),
        "loss_curves": lambda: figures.loss_curves(data.histories, data.results),
        "dropped_fraction": lambda: figures.dropped_fraction(data.histories, data.results),
        "expert_load_over_steps": lambda: figures.load_over_steps(data.histories, data.results, ROUTING_PHASES),
        "synthetic_vs_real": lambda: figures.synthetic_vs_real(data.results),
        "drop_penalty": lambda: _drop_penalty(data.drop_penalty),
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
    "drop_penalty": "no drop_penalty* campaign (benchmarks/convergence_gpu.py --analyze-only into experiments/results)",
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
        "device_kind": "device", "campaign": "campaign", "git_commit": "commit", "date": "run date",
    }
    frame = frame.copy()
    if "peak_memory_bytes" in frame:
        frame["peak_gib"] = pd.to_numeric(frame["peak_memory_bytes"], errors="coerce") / figures.GIB
    present = [c for c in columns if c in frame]
    lines = ["| " + " | ".join(columns[c] for c in present) + " |", "|" + "---|" * len(present)]
    if "git_commit" in frame:
        frame["git_commit"] = [figures.short_commit(str(c)) if isinstance(c, str) else c for c in frame["git_commit"]]
    if "date" in frame:
        frame["date"] = [d[:10] if isinstance(d, str) else d for d in frame["date"]]
    for _, row in frame[present].iterrows():
        lines.append("| " + " | ".join(_fmt(row[c]) for c in present) + " |")
    note = figures.load_note(frame)
    return "\n".join(lines) + "\n" + (f"\n_{note}._\n" if note else "")


def _fmt(value: object) -> str:
    if value is None or (isinstance(value, float) and np.isnan(value)):
        return ""
    if isinstance(value, float):
        return f"{value:.4g}" if abs(value) < 1e4 else f"{value:,.0f}"
    return str(value)


def build_report(results_dir: str | Path, figures_dir: str | Path, *, store_dir: str | Path | None = None,
                 close: bool = True) -> ReportSummary:
    """Ingest the live tables of ``results_dir`` into the store (default: its sibling ``store``), then draw
    every figure and the results table from the store into ``figures_dir``."""
    store_dir = Path(store_dir) if store_dir is not None else default_store(results_dir)
    ingest_live_tables(results_dir, store_dir)
    data = load_report_data(store_dir)
    summary = draw_report(data, figures_dir, close=close)
    write_results_page(data, store_dir, figures_dir)
    return summary


def write_results_page(data: ReportData, store_dir: str | Path, figures_dir: str | Path) -> Path | None:
    """Write docs/results.md when the figures go to the repository's experiments/figures (not elsewhere)."""
    docs = Path(figures_dir).resolve().parent.parent / "docs"
    if Path(figures_dir).resolve().parent.name != "experiments" or not docs.is_dir() or not Path(store_dir).is_dir():
        return None
    out = docs / "results.md"
    out.write_text(results_page(data, store_dir))
    return out


def draw_report(data: ReportData, figures_dir: str | Path, *, close: bool = True) -> ReportSummary:
    summary = ReportSummary(Path(figures_dir))
    Path(figures_dir).mkdir(parents=True, exist_ok=True)
    for name, builder in figure_builders(data).items():
        fig = draw(name, builder, figures_dir, summary)
        if fig is not None and close:
            plt.close(fig)
    write_results_table(data, figures_dir, summary)
    summary.save()
    return summary


def results_page(data: ReportData, store_dir: str | Path) -> str:
    """docs/results.md: the campaigns drawn (with commit, dates, device), the per-point table, the kernel
    tables' best TFLOP/s, and the campaigns kept for history. Every table says where its rows come from."""
    campaigns = store.read_campaigns(store_dir)
    records = store.read_records(store_dir)
    lines = ["# Results", "", "<!-- generated by `turbo-moe report` from experiments/store; do not edit -->", "",
             "Every number below comes from the results store (`experiments/store/`, one folder per campaign; "
             "`pd.read_parquet(\"experiments/store/records\")` reads it). Figures: `experiments/figures/`.", ""]
    drawn = sorted(set(data.results.get("campaign", pd.Series(dtype=str))) |
                   set(data.kernels.get("campaign", pd.Series(dtype=str))))
    lines += ["## Campaigns the report draws", "", "| campaign | what | device | run dates | commits | records |",
              "|---|---|---|---|---|---|"]
    for name in drawn:
        rows = records[records["campaign"] == name]
        meta = campaigns.set_index("campaign").loc[name] if name in set(campaigns["campaign"]) else {}
        days = sorted({d[:10] for d in rows["date"].dropna()})
        span = f"{days[0]} .. {days[-1]}" if len(days) > 1 else "".join(days)
        commits = ", ".join(sorted({figures.short_commit(c) for c in rows["git_commit"].dropna()}))
        devices = ", ".join(sorted(set(rows["device"].dropna())))
        lines.append(f"| {name} | {_fmt(meta.get('title'))} | {devices} | {span} | {commits} | {len(rows)} |")
    lines += ["", "## Sweep points", "", results_markdown(data.results)]
    if not data.kernels.empty and {"shape", "impl", "tflops", "op"} <= set(data.kernels):
        best = data.kernels[pd.to_numeric(data.kernels["tflops"], errors="coerce").notna()]
        best = best.assign(tflops=best["tflops"].astype(float))
        best = best.groupby(["campaign", "op", "shape", "impl"])["tflops"].max()
        lines += ["## Grouped GEMM, best TFLOP/s per shape (any routing)", "",
                  "| campaign | op | shape | impl | TFLOP/s |", "|---|---|---|---|---|"]
        lines += [f"| {c} | {o} | {s} | {i} | {v:.0f} |" for (c, o, s, i), v in best.items()]
        lines.append("")
    old = campaigns[campaigns["status"] != "current"]
    if len(old):
        lines += ["## Kept for history (not drawn)", "", "| campaign | status | superseded by | why |",
                  "|---|---|---|---|"]
        for r in old.itertuples():
            why = _fmt(r.note).splitlines()[0] if _fmt(r.note) else ""
            lines.append(f"| {r.campaign} | {r.status} | {_fmt(r.superseded_by)} | {why} |")
        lines.append("")
    lines.append(f"{len(campaigns)} campaigns and {len(records)} records in the store in all; the others "
                 "(benchmarks and probes behind docs/performance.md and docs/notes/) are read with "
                 "`turbo_moe.experiments.store`.")
    return "\n".join(lines) + "\n"


def write_results_table(data: ReportData, figures_dir: str | Path, summary: ReportSummary) -> Path:
    out = Path(figures_dir) / "results.md"
    out.write_text(results_markdown(data.results))
    summary.entries["results_table"] = out.name
    return out


def run_report_notebook(
    notebook: str | Path, out: str | Path, results_dir: str | Path, figures_dir: str | Path, *,
    kernel: str = "turbo-moe", store_dir: str | Path | None = None,
) -> ReportSummary:
    """Ingest the live tables of ``results_dir`` into the store, then execute the report notebook on the
    store through papermill; returns the manifest it wrote."""
    import papermill

    from turbo_moe.experiments.runner import check_kernel

    notebook = Path(notebook)
    if not notebook.is_file():
        raise ValueError(f"report notebook {str(notebook)!r} does not exist (run from the repository root)")
    check_kernel(kernel)
    store_dir = Path(store_dir) if store_dir is not None else default_store(results_dir)
    ingest_live_tables(results_dir, store_dir)
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    papermill.execute_notebook(
        str(notebook), str(out), kernel_name=kernel, cwd=str(notebook.parent), progress_bar=False,
        parameters={"store_dir": str(store_dir.resolve()), "figures_dir": str(Path(figures_dir).resolve())},
    )
    return ReportSummary.load(Path(figures_dir))
