"""The report's data, read from one or two results stores: the committed one and this machine's local one.

One key joins everything: a table row carries its campaign (as the report names it) and its record id
(``store_record``), and its record, history and expert load are looked up by that pair, never by position
or date order. Where two rows of one sweep point exist (an earlier run and a re-run, or a committed run and
a fresh local one), the one with the latest run date is reported.

A local campaign whose name the committed store also has is named ``<name> (local)``. A campaign with a
damaged file (``store.check_campaign``) is left out whole, and ``ReportData.problems`` says which and why;
so is every summary value flagged as not a measurement (``store.invalid_metrics``), which is masked
before drawing and shown as ``invalid (...)`` in the results table.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import pandas as pd

from turbo_moe import provenance
from turbo_moe.experiments.report import convergence, figures
from turbo_moe.experiments.store import store
from turbo_moe.model.config import get_config

MIN_CURVE_STEPS = 20  # shorter runs (throughput probes) are noise on a loss plot
# Routing phases of a run, as fractions of its logged steps: the router as at init (before the warm-up
# collapse) and the last quarter (balanced once the bias has caught up; docs/notes/routing.md).
ROUTING_PHASES = {"init": (0.0, 0.05), "late": (0.75, 1.0)}
LOCAL_SUFFIX = " (local)"


@dataclasses.dataclass
class ReportData:
    """Everything the figures draw from."""

    results: pd.DataFrame  # latest row per (sweep, point), with a ``path`` label column where known
    histories: pd.DataFrame  # long format: sweep, point, label, moe_path, step, loss, eval_loss, ...
    loads: dict[str, dict[str, np.ndarray]]  # sweep -> {label: (L_moe, E) final expert load}
    kernels: pd.DataFrame  # kernel benchmark tables, concatenated
    drop_penalty: list = dataclasses.field(default_factory=list)  # convergence.records_from_store
    problems: list[str] = dataclasses.field(default_factory=list)  # campaigns not read, values flagged
    left_out: dict[str, str] = dataclasses.field(default_factory=dict)  # campaign -> why it was not read
    load_rows: dict[str, dict[str, list[str]]] = dataclasses.field(default_factory=dict)  # as loads: row names


@dataclasses.dataclass(frozen=True)
class Campaign:
    store: Path
    name: str
    label: str  # as the report names it


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


def report_campaigns(store_dir: Path, campaigns: list[str] | None, local_store: Path | None) -> list[Campaign]:
    """The committed store's current campaigns (or ``campaigns``), then every campaign of ``local_store``."""
    chosen = []
    if store_dir.is_dir():
        names = store.current_campaigns(store_dir) if campaigns is None else list(campaigns)
        chosen = [Campaign(store_dir, name, name) for name in names]
    if local_store is not None and local_store.is_dir() and local_store.resolve() != store_dir.resolve():
        taken = {c.name for c in chosen}
        chosen += [Campaign(local_store, name, name + LOCAL_SUFFIX if name in taken else name)
                   for name in store.campaign_names(local_store)]
    return chosen


def _readable(chosen: list[Campaign], problems: list[str], left_out: dict[str, str]) -> list[Campaign]:
    out = []
    for campaign in chosen:
        try:
            store.check_campaign(campaign.store, campaign.name)
            out.append(campaign)
        except store.StoreError as exc:
            problems.append(f"campaign {campaign.label} is left out of the report: {exc}")
            left_out[campaign.label] = exc.short
    return out


def _keyed_tables(campaigns: list[Campaign], records: pd.DataFrame, sources: pd.DataFrame, keep) -> list:
    """(campaign, source, table) for every top-level table whose columns pass ``keep``, rebuilt from the
    store with a ``store_record`` column (the record id of each row, carried with the row), rows in their
    table's order (which run of a point is the latest is decided by run date, ``_latest_by_date``)."""
    by_label = {c.label: c for c in campaigns}
    out = []
    sources = sources[(sources["format"] == "csv") & ~sources["path"].str.contains("/")]
    for _, source in sources.sort_values("path").iterrows():
        columns = json.loads(source["columns"])
        if not keep(source["path"], columns):
            continue
        rows = records[(records["campaign"] == source["campaign"]) & (records["source"] == source["path"])]
        table = store.table_frame(rows, columns, key="store_record")
        if table.empty:
            continue
        out.append((by_label[source["campaign"]], source["path"], table))
    return out


def _latest_by_date(frame: pd.DataFrame, dates: dict) -> pd.DataFrame:
    """The latest run (by run date) of each (sweep, point), rows kept in their order."""
    when = pd.Series([dates.get(k, "") for k in zip(frame["campaign"], frame["store_record"])], index=frame.index)
    keep = frame.assign(_when=when).sort_values("_when", kind="stable") \
        .drop_duplicates(subset=["sweep", "point"], keep="last").index
    return frame.loc[sorted(keep)].reset_index(drop=True)


def _mask_invalid(frame: pd.DataFrame, extras: dict, problems: list[str]) -> pd.DataFrame:
    """Values flagged at ingest (``extra["_invalid"]``) become NaN (never drawn); ``invalid`` keeps their text."""
    flagged = [extras.get(k, {}).get("_invalid") or {} for k in zip(frame["campaign"], frame["store_record"])]
    frame = frame.assign(invalid=[f or None for f in flagged])
    for i, metrics in zip(frame.index, flagged):
        for metric, text in metrics.items():
            if metric in frame:
                frame.loc[i, metric] = np.nan
            problems.append(f"campaign {frame.at[i, 'campaign']} record {frame.at[i, 'store_record']}: "
                            f"{metric} = {text} is not a valid measurement; shown as invalid, not drawn")
    return frame


def load_report_data(store_dir: str | Path = store.DEFAULT_STORE, campaigns: list[str] | None = None, *,
                     local_store: str | Path | None = None) -> ReportData:
    """Sweep results, the comparison sweeps' histories and expert loads, and the kernel tables, from the
    store (``campaigns``: default every campaign whose status is current) and every campaign of
    ``local_store`` (this machine's runs, not committed)."""
    problems: list[str] = []
    left_out: dict[str, str] = {}
    chosen = _readable(report_campaigns(Path(store_dir), campaigns, Path(local_store) if local_store else None),
                       problems, left_out)
    records = _concat([store.read_records(c.store, [c.name]).assign(campaign=c.label) for c in chosen])
    sources = _concat([store.read_sources(c.store, [c.name]).assign(campaign=c.label) for c in chosen])
    keys = list(zip(records.get("campaign", []), records.get("record", [])))
    extras = dict(zip(keys, [json.loads(e) for e in records.get("extra", [])]))
    dates = dict(zip(keys, records.get("date", pd.Series(dtype=object)).fillna("")))
    loads_at_run = dict(zip(keys, [json.loads(p).get("load_per_core") for p in records.get("provenance", [])]))

    sweeps = _keyed_tables(chosen, records, sources, lambda path, cols: not Path(path).name.startswith("kernels_")
                           and "point" in cols) if len(sources) else []
    frames = []
    for campaign, path, table in sweeps:
        if "sweep" not in table:
            table["sweep"] = Path(path).stem
        frames.append(table.assign(campaign=campaign.label))
    frame = _latest_by_date(pd.concat(frames, ignore_index=True), dates) if frames else pd.DataFrame()
    if not frame.empty:
        row_keys = list(zip(frame["campaign"], frame["store_record"]))
        frame["record_path"] = [k[1] if "_record_file" in extras.get(k, {}) else None for k in row_keys]
        frame["load_per_core"] = [loads_at_run.get(k) for k in row_keys]
        frame = _mask_invalid(figures.with_path_labels(frame), extras, problems)
    histories, loads, load_rows = _histories_and_loads(frame, chosen, extras)

    kernel_tables = _keyed_tables(chosen, records, sources, lambda path, cols: Path(path).name.startswith("kernels_")
                                  and {"shape", "impl", "tflops"} <= set(cols)) if len(sources) else []
    kernels = [_schema_columns(t.assign(campaign=c.label)).assign(table=Path(p).stem) for c, p, t in kernel_tables]
    kernels = pd.concat(kernels, ignore_index=True) if kernels else pd.DataFrame()
    if not kernels.empty:
        kernels = _mask_invalid(kernels, extras, problems).drop(columns=["store_record", "invalid"])
    phases = routing_phases(histories)
    if not phases.empty:
        frame = frame.merge(phases, on=["sweep", "point"], how="left")
    drop_penalty = []
    for where in dict.fromkeys(c.store for c in chosen):
        names = [c.name for c in chosen if c.store == where]
        labels = {c.name: c.label for c in chosen if c.store == where}
        drop_penalty += [{**r, "campaign": labels.get(r.get("campaign"), r.get("campaign"))}
                         for r in convergence.records_from_store(where, names)]
    return ReportData(results=frame, histories=histories, loads=loads, kernels=kernels, drop_penalty=drop_penalty,
                      problems=problems, left_out=left_out, load_rows=load_rows)


def _concat(frames: list[pd.DataFrame]) -> pd.DataFrame:
    return pd.concat(frames, ignore_index=True) if frames else pd.DataFrame()


def _histories_and_loads(frame: pd.DataFrame, chosen: list[Campaign], extras: dict):
    """The per-step histories (>= MIN_CURVE_STEPS) and final expert loads of the comparison sweeps' runs,
    each looked up by its row's (campaign, record)."""
    histories, loads, load_rows = [], {}, {}
    chosen_sweeps = comparison_sweeps(frame) if not frame.empty else []
    wanted = frame[frame["sweep"].isin(chosen_sweeps) & frame["record_path"].notna()] if chosen_sweeps \
        else frame.iloc[0:0]
    by_label = {c.label: c for c in chosen}
    steps = {}
    for label in sorted(set(wanted["campaign"])) if len(wanted) else []:
        campaign = by_label[label]
        ids = wanted.loc[wanted["campaign"] == label, "record_path"]
        steps[label] = store.read_history(campaign.store, [campaign.name], records=ids)
    for _, row in wanted.iterrows():
        part = steps[row["campaign"]]
        history = part[part["record"] == row["record_path"]].drop(columns=["campaign", "record"]) \
            .dropna(axis=1, how="all").reset_index(drop=True)
        if len(history) >= MIN_CURVE_STEPS and "step" in history:
            histories.append(history.assign(sweep=row["sweep"], point=row["point"], label=row["path"],
                                            moe_path=row["moe_path"]))
        load = extras[(row["campaign"], row["record_path"])].get("document", {}).get("expert_load")
        if load:
            loads.setdefault(row["sweep"], {})[row["path"]] = np.asarray(load, dtype=float)
            names = _load_row_names(row)
            if names is not None:
                load_rows.setdefault(row["sweep"], {})[row["path"]] = names
    return (pd.concat(histories, ignore_index=True) if histories else pd.DataFrame()), loads, load_rows


def _load_row_names(row: pd.Series) -> list[str] | None:
    """The expert load's row names from the run's model (its preset and overrides); None if unknown."""
    overrides = row.get("model_overrides")
    try:
        overrides = json.loads(overrides) if isinstance(overrides, str) else overrides
        cfg = get_config(str(row.get("model")), **(overrides if isinstance(overrides, dict) else {}))
    except (ValueError, TypeError):
        return None
    return figures.moe_row_labels(cfg)


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

