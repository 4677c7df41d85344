"""The report: read the results stores, draw the figures, write the results table.

Where results live (``ReportPlaces``, from one experiments folder):

    results/          live tables that sweeps and benchmarks write (git-ignored)
    store/            the committed results store: curated campaigns, changed only by ``--publish``
    runs/store/       this machine's store: ``turbo-moe report`` ingests results/ here (git-ignored)
    runs/report/      the report drawn from both stores: figures, results.md, report.json, 04_report.ipynb
    figures/          the committed report, drawn by ``turbo-moe report --publish`` from store/ alone
                      (which also ingests results/ into store/ and writes docs/results.md)

So a fresh clone's ``make main`` leaves ``git status`` clean, and its fresh runs are reported beside the
committed ones (a local campaign whose name the committed store has is shown as ``<name> (local)``).

``build_report`` does everything in-process; ``run_report_notebook`` executes ``notebooks/04_report``
(which calls ``load_report_data`` and ``draw`` cell by cell) through papermill. Figures whose data is
missing are skipped with a note, never an error; a campaign with a damaged store file is left out and
named. Outputs in the figures folder::

    <name>.png      one file per figure (see ``figure_builders``)
    results.md      a markdown results table (the README's table)
    report.json     manifest: figure -> file (relative to the figures folder) or skip note;
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

import turbo_moe
from turbo_moe.experiments.report import convergence, figures
from turbo_moe.experiments.report.data import (LOCAL_SUFFIX, MIN_CURVE_STEPS, ROUTING_PHASES,  # noqa: F401
                                               ReportData, comparison_sweeps, load_report_data, routing_phases)
from turbo_moe.experiments.store import migrate, store
from turbo_moe.experiments.store.results import scan_results
from turbo_moe.experiments.sweep.kernel_check import check_kernel

MANIFEST = "report.json"
# The report notebook of this clone (the package is installed editable from it).
REPORT_NOTEBOOK = Path(turbo_moe.__file__).resolve().parents[1] / "notebooks" / "04_report.ipynb"


@dataclasses.dataclass(frozen=True)
class ReportPlaces:
    """Where the report reads and writes, from one experiments folder (see the module docstring)."""

    experiments: Path
    publish: bool = False

    @property
    def results(self) -> Path:
        return self.experiments / "results"

    @property
    def committed_store(self) -> Path:
        return self.experiments / "store"

    @property
    def ingest_store(self) -> Path:
        """Where results/ is ingested: the committed store when publishing, else this machine's."""
        return self.committed_store if self.publish else self.experiments / "runs" / "store"

    @property
    def figures(self) -> Path:
        return self.experiments / ("figures" if self.publish else "runs/report")

    @property
    def notebook_out(self) -> Path:
        return self.experiments / "runs" / "report" / "04_report.ipynb"


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


def check_parameters(store_dir: str | Path, figures_dir: str | Path,
                     local_store_dir: str | Path | None = None) -> tuple[Path, Path]:
    """04's parameter check, before anything is drawn: ``store_dir`` must be a results store holding records;
    ``local_store_dir`` None or a folder; ``figures_dir`` is created if its parent exists. ValueError names
    the parameter."""
    store_path, figures_path = Path(store_dir), Path(figures_dir)
    if local_store_dir is not None and not Path(local_store_dir).is_dir():
        raise ValueError(f"parameter local_store_dir: {str(local_store_dir)!r} is not a folder (None: no local store)")
    if not store_path.is_dir():
        raise ValueError(f"parameter store_dir: {str(store_dir)!r} is not a folder "
                         f"(resolved: {store_path.resolve()})")
    if not store.campaign_names(store_path):
        raise ValueError(f"parameter store_dir: {str(store_dir)!r} holds no records (records/campaign=*/); run a "
                         "sweep and `turbo-moe report`, or python -m turbo_moe.experiments.store.migrate")
    if figures_path.exists() and not figures_path.is_dir():
        raise ValueError(f"parameter figures_dir: {str(figures_dir)!r} exists and is not a folder")
    if not figures_path.parent.is_dir():
        raise ValueError(f"parameter figures_dir: the parent folder of {str(figures_dir)!r} does not exist "
                         f"(resolved: {figures_path.parent.resolve()})")
    figures_path.mkdir(exist_ok=True)
    return store_path, figures_path


def stores_to_read(committed: Path, ingest: Path) -> tuple[Path, Path | None]:
    """(main store, local store or None): the committed store and the one results/ went into; the latter alone
    when the committed store does not exist or is the same folder."""
    if committed.is_dir() and (not ingest.is_dir() or committed.resolve() != ingest.resolve()):
        return committed, ingest if ingest.is_dir() else None
    return ingest, None


def ingest_live_tables(results_dir: str | Path, store_dir: str | Path) -> dict[str, int]:
    """Bring the sweep runner's and benchmarks' tables under ``results_dir`` into the store (only files
    that changed since the last ingest)."""
    return migrate.ingest(results_dir, store_dir, quiet=True)


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
        names = data.load_rows.get(sweep)
        builders[f"expert_load_{sweep}"] = lambda loads=loads, rows=rows, names=names: \
            figures.expert_load_heatmaps(loads, rows, names)
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
    invalid = frame["invalid"] if "invalid" in frame else pd.Series(None, index=frame.index)
    for (_, row), flagged in zip(frame[present].iterrows(), invalid):
        flagged = flagged if isinstance(flagged, dict) else {}
        lines.append("| " + " | ".join(f"invalid ({flagged[c]})" if c in flagged else _fmt(row[c])
                                       for c in present) + " |")
    note = figures.load_note(frame)
    return "\n".join(lines) + "\n" + (f"\n_{note}._\n" if note else "")


def left_out_markdown(data: ReportData) -> str:
    """A line naming each campaign the report could not read (empty when there is none)."""
    if not data.left_out:
        return ""
    return "\n_Not drawn (a damaged results store file): " + "; ".join(
        f"campaign {label}: {why}" for label, why in data.left_out.items()) + "._\n"


def _fmt(value: object) -> str:
    if value is None or (isinstance(value, float) and np.isnan(value)):
        return ""
    if isinstance(value, float):
        return f"{value:.4g}" if abs(value) < 1e4 else f"{value:,.0f}"
    return str(value)


def build_report(results_dir: str | Path, figures_dir: str | Path, *, store_dir: str | Path | None = None,
                 committed_store: str | Path | None = None, close: bool = True) -> ReportSummary:
    """Ingest the live tables of ``results_dir`` into ``store_dir`` (default: this machine's store,
    ``<experiments>/runs/store``), then draw every figure and the results table from the committed store
    (default: ``<experiments>/store``) and ``store_dir`` into ``figures_dir``."""
    places = ReportPlaces(Path(results_dir).parent)
    store_dir = Path(store_dir) if store_dir is not None else places.ingest_store
    ingest_live_tables(results_dir, store_dir)
    main, local = stores_to_read(Path(committed_store) if committed_store else places.committed_store, store_dir)
    data = load_report_data(main, local_store=local)
    summary = draw_report(data, figures_dir, close=close)
    write_results_page(data, main, figures_dir)
    return summary


def write_results_page(data: ReportData, store_dir: str | Path, figures_dir: str | Path) -> Path | None:
    """Write docs/results.md when the figures go to the repository's experiments/figures (not elsewhere)."""
    docs = Path(figures_dir).resolve().parent.parent / "docs"
    if Path(figures_dir).resolve().parent.name != "experiments" or not docs.is_dir() or not Path(store_dir).is_dir():
        return None
    out = docs / "results.md"
    out.write_text(results_page(data, store_dir))
    return out


def note_problems(data: ReportData, summary: ReportSummary | None = None) -> None:
    """Print every problem met while reading (a campaign left out, a value flagged as invalid); each campaign
    left out gets a skip note in the manifest."""
    for line in data.problems:
        print(f"warning: {line}")
    if summary is not None:
        for label, why in data.left_out.items():
            summary.entries[f"campaign {label}"] = f"skipped: {why}"


def draw_report(data: ReportData, figures_dir: str | Path, *, close: bool = True) -> ReportSummary:
    summary = ReportSummary(Path(figures_dir))
    Path(figures_dir).mkdir(parents=True, exist_ok=True)
    note_problems(data, summary)
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
    lines = ["# Results", "", "<!-- generated by `turbo-moe report --publish` from experiments/store; do not edit -->",
             "", "Every number below comes from the results store (`experiments/store/`, one folder per campaign; "
             "`pd.read_parquet(\"experiments/store/records\")` reads it; `SHA256SUMS` lists every file's checksum). "
             "Figures: `experiments/figures/`. Your own runs (`make main`, `turbo-moe sweep`) are reported beside "
             "these in `experiments/runs/report/` by `turbo-moe report`.", ""]
    drawn = sorted(set(data.results.get("campaign", pd.Series(dtype=str))) |
                   set(data.kernels.get("campaign", pd.Series(dtype=str))) |
                   {r["campaign"] for r in data.drop_penalty if r.get("campaign")})
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
    lines += ["", "## Sweep points", "", results_markdown(data.results) + left_out_markdown(data)]
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
                 "`turbo_moe.experiments.store.store`.")
    return "\n".join(lines) + "\n"


def write_results_table(data: ReportData, figures_dir: str | Path, summary: ReportSummary) -> Path:
    out = Path(figures_dir) / "results.md"
    out.write_text(results_markdown(data.results) + left_out_markdown(data))
    summary.entries["results_table"] = out.name
    return out


def run_report_notebook(
    notebook: str | Path | None, out: str | Path, results_dir: str | Path, figures_dir: str | Path, *,
    kernel: str = "turbo-moe", store_dir: str | Path | None = None, committed_store: str | Path | None = None,
) -> ReportSummary:
    """Ingest the live tables of ``results_dir`` into ``store_dir`` (as ``build_report``), then execute the
    report notebook (default: this clone's ``REPORT_NOTEBOOK``) on the stores through papermill; returns the
    manifest it wrote."""
    import papermill  # an optional dependency (the notebooks extra); drawing in-process does not need it

    notebook = Path(notebook) if notebook is not None else REPORT_NOTEBOOK
    if not notebook.is_file():
        raise ValueError(f"report notebook {str(notebook)!r} does not exist (resolved: {notebook.resolve()}); "
                         "pass --notebook PATH, or --no-notebook to draw in this process")
    check_kernel(kernel)
    places = ReportPlaces(Path(results_dir).parent)
    store_dir = Path(store_dir) if store_dir is not None else places.ingest_store
    ingest_live_tables(results_dir, store_dir)
    main, local = stores_to_read(Path(committed_store) if committed_store else places.committed_store, store_dir)
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    papermill.execute_notebook(
        str(notebook), str(out), kernel_name=kernel, cwd=str(notebook.parent), progress_bar=False,
        extra_arguments=["--IPKernelApp.log_level=ERROR"],  # as the sweeps: no transport warning at start-up
        parameters={"store_dir": str(main.resolve()), "figures_dir": str(Path(figures_dir).resolve()),
                    "local_store_dir": str(local.resolve()) if local is not None else None},
    )
    return ReportSummary.load(Path(figures_dir))


def report_command(experiments_dir: Path | None, *, notebook: Path | None = None, kernel: str = "turbo-moe",
                   in_process: bool = False, publish: bool = False) -> int:
    """``turbo-moe report``: ingest, draw, print where everything is (see ``ReportPlaces``). ValueError for a
    bad argument, naming it. Runs from any folder: the defaults are this clone's experiments/ and notebook."""
    if experiments_dir is None:  # this clone's; a package installed outside a clone: the working folder's
        experiments_dir = REPORT_NOTEBOOK.parents[1] / "experiments" if REPORT_NOTEBOOK.is_file() else "experiments"
    experiments = Path(experiments_dir)
    if not experiments.is_dir():
        raise ValueError(f"--experiments-dir {str(experiments)!r} is not a folder (resolved: {experiments.resolve()}); "
                         "give the folder that holds results/")
    places = ReportPlaces(experiments, publish=publish)
    if not any(places.results.glob("*.csv")) and not places.committed_store.is_dir() \
            and not places.ingest_store.is_dir():
        raise ValueError(f"--experiments-dir {str(experiments)!r}: {places.results} holds no results tables (*.csv); "
                         "run a sweep first (turbo-moe sweep experiments/sweeps/cpu_default.yaml)")
    problems = scan_results(places.results)  # the report leaves these out: say so here, where it is seen
    for line in problems:
        print(f"warning: {line}")
    if in_process:
        built = build_report(places.results, places.figures, store_dir=places.ingest_store)
    else:
        try:
            built = run_report_notebook(notebook, places.notebook_out, places.results, places.figures, kernel=kernel,
                                        store_dir=places.ingest_store)
        except Exception as exc:  # a failed cell: its one-line error and where the full notebook is
            if type(exc).__name__ != "PapermillExecutionError":
                raise
            raise ValueError(f"the report notebook failed: {exc.ename}: {' '.join(str(exc.evalue).split())[:500]} "
                             f"(the executed notebook with the traceback: {places.notebook_out})") from None
    for line in built.lines():
        print(line)
    if problems:
        print(f"{len(problems)} problem(s) in {places.results} were left out of the report (warnings above)")
    if not publish:
        print(f"this machine's results: store {places.ingest_store}, report {places.figures} (both git-ignored); "
              "--publish draws the committed report from experiments/store")
    return 0
