"""How a result file becomes store records: the campaign a file belongs to, a table row split into config /
provenance / summary, and a JSON document (per-step lists as history) as one ``Record``.

Shared by the migration (``migrate``) and its check (``migration_check``), which rebuilds every file from the
store and compares it with the file through the same reading.
"""

from __future__ import annotations

import gzip
import json
import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from turbo_moe import provenance as prov
from turbo_moe.experiments.store.store import Record

PROVENANCE_KEYS = {*prov.FIELDS, *prov.LEGACY_NAMES, "jaxlib_version", "python_version", "hostname", "cpu"}
CONFIG_KEYS = ("config", "train_config", "model_config", "args", "parameters", "argv", "model_overrides", "params",
               "targets", "recipes", "router")
# Names of measured values (everything else in a benchmark row is a setting of the case).
_SUMMARY_WORDS = ("ms", "s", "tgs", "tflops", "gflops", "gbps", "mfu", "loss", "ce", "bytes", "gib", "pct", "error",
                  "diff", "time", "seconds", "dropped", "load", "tokens", "flops", "ratio", "speedup", "memory")


def campaign_of(relative: str | Path) -> str:
    """The campaign a file under the results folder belongs to (its top-level entry, suffixes removed)."""
    top = Path(relative).parts[0]
    for suffix in (".json.gz", ".csv.gz", ".csv", ".jsonl", ".json", ".md", ".txt", ".log"):
        if top.endswith(suffix):
            top = top[: -len(suffix)]
            break
    return "step_breakdown" if top.startswith("step_breakdown_") else top


def is_summary(name: str) -> bool:
    words = name.lower().replace("-", "_").split("_")
    return any(w in _SUMMARY_WORDS for w in words) or name.lower().endswith(("_ms", "_s", "ms"))


def plain(value: Any) -> Any:
    """A table cell as a JSON-friendly Python value (missing -> None)."""
    if value is None:
        return None
    if hasattr(value, "item"):
        value = value.item()
    if isinstance(value, float) and math.isnan(value):
        return None
    return value


def split_row(row: Mapping[str, Any], summary_keys: set[str] | None = None) -> dict[str, dict[str, Any]]:
    """A table row's cells into config / provenance / summary (missing cells left out)."""
    parts: dict[str, dict[str, Any]] = {"config": {}, "provenance": {}, "summary": {}}
    for key, value in row.items():
        value = plain(value)
        if value is None:
            continue
        if key in PROVENANCE_KEYS:
            parts["provenance"][key] = value
        elif (key in summary_keys) if summary_keys is not None else is_summary(key):
            parts["summary"][key] = value
        else:
            parts["config"][key] = value
    return parts


def flatten_step(entry: Mapping[str, Any], prefix: str = "") -> tuple[dict[str, Any], bool]:
    """One per-step mapping as {metric: number} (lists of numbers as ``name[i]``, mappings as ``name.key``);
    True when it held something else (text, lists of mappings), which the history cannot keep."""
    out: dict[str, Any] = {}
    lost = False
    for key, value in entry.items():
        name = f"{prefix}{key}"
        if key == "step" and not prefix:
            continue
        if value is None:
            continue
        if isinstance(value, bool):
            out[name] = float(value)
        elif isinstance(value, (int, float)):
            out[name] = value
        elif isinstance(value, list) and all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in value):
            out.update({f"{name}[{i}]": v for i, v in enumerate(value)})
        elif isinstance(value, dict):
            inner, inner_lost = flatten_step(value, f"{name}.")
            out.update(inner)
            lost |= inner_lost
        else:
            lost = True
    return out, lost


def _history(entries: list[Mapping[str, Any]], prefix: str = "") -> tuple[list[dict[str, Any]], bool]:
    rows, lost = [], False
    for i, entry in enumerate(entries):
        flat, entry_lost = flatten_step(entry, prefix)
        lost |= entry_lost
        rows.append({"step": int(entry.get("step", i)), **flat})
    return rows, lost


def _is_step_list(value: Any) -> bool:
    return isinstance(value, list) and bool(value) and all(isinstance(v, dict) for v in value) and \
        any("step" in v for v in value)


def json_record(data: Any, *, record: str, table: str, source: str) -> tuple[Record, bool]:
    """A JSON document as one record; True when per-step detail was left out (see ``flatten_step``)."""
    if not isinstance(data, dict):
        return Record(record, "benchmark", table, source, extra={"value": data}), False
    rec = Record(record, "benchmark", table, source, status=data.get("status"), error=data.get("error"))
    lost = False
    for key, value in data.items():
        if key in ("status", "error"):
            continue
        if key == "provenance" and isinstance(value, dict):
            rec.provenance.update(value)
        elif key == "summary" and isinstance(value, dict):
            rec.summary.update(value)
        elif key in CONFIG_KEYS:
            rec.config[key] = value
        elif key in PROVENANCE_KEYS and not isinstance(value, (dict, list)):
            rec.provenance[key] = value
        elif _is_step_list(value):
            steps, step_lost = _history(value, "" if key == "history" else f"{key}.")
            lost |= step_lost
            rec.history = _merge_steps(rec.history, steps)
            rec.extra.setdefault("_history_keys", []).append(key)
        else:
            rec.extra[key] = value
    if rec.history:
        rec.kind = "run"
    return rec, lost


def _merge_steps(a: list[dict[str, Any]], b: list[dict[str, Any]]) -> list[dict[str, Any]]:
    merged: dict[int, dict[str, Any]] = {}
    for entry in [*a, *b]:
        merged.setdefault(entry["step"], {"step": entry["step"]}).update(entry)
    return [merged[s] for s in sorted(merged)]


def load_json(data: bytes, name: str) -> Any:
    if name.endswith(".gz"):
        data = gzip.decompress(data)
    return json.loads(data.decode())
