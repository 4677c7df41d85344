"""What a sweep prints: a line when a point starts, a heartbeat while it runs, a result line when it ends,
and a summary table at the end.

The heartbeat reads the executed notebook that papermill saves while the point runs (every
``AUTOSAVE_S`` seconds while outputs arrive, and at every cell boundary): which cell is running and the
last line of text it showed (the training's progress line), so a long point is never silent for more
than ``HEARTBEAT_S`` seconds.
"""

from __future__ import annotations

import json
import math
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

HEARTBEAT_S = 20.0
AUTOSAVE_S = 10  # papermill's autosave period while a cell runs (its default is 30 s)
_LINE_CHARS = 160


def notebook_progress(path: Path) -> str | None:
    """``cell 3/5: <last text line of the running cell>`` from a notebook being executed (None if unknown)."""
    try:
        nb = json.loads(Path(path).read_text())
    except (OSError, ValueError):  # not written yet, or caught mid-write
        return None
    code = [c for c in nb.get("cells", []) if isinstance(c, dict) and c.get("cell_type") == "code"]
    running = [i for i, c in enumerate(code) if (c.get("metadata", {}).get("papermill") or {}).get("status")
               == "running"]
    if not running:
        return None
    cell = code[running[0]]
    return f"cell {running[0] + 1}/{len(code)}" + (f": {text}" if (text := _last_text(cell)) else "")


def _last_text(cell: dict) -> str | None:
    """The newest status the cell shows: a stream's last line (a tqdm bar's last redraw after "\r"), or a
    display's first line (the training's status display puts its status first, finished phases after)."""
    for output in reversed(cell.get("outputs") or []):
        stream = output.get("output_type") == "stream"
        text = output.get("text", "") if stream else (output.get("data") or {}).get("text/plain", "")
        text = "".join(text) if isinstance(text, list) else str(text)
        lines = [part.strip() for line in text.splitlines() for part in line.split("\r") if part.strip()]
        if lines:
            return (lines[-1] if stream else lines[0])[:_LINE_CHARS]
    return None


class Heartbeat:
    """Context manager: logs ``<label>: running N s[; cell i/n: ...]`` every ``interval_s`` until it exits."""

    def __init__(self, label: str, notebook_out: Path | None, log: Callable[[str], None],
                 interval_s: float | None = None, enabled: bool = True):
        self.label, self.notebook_out, self.log = label, notebook_out, log
        self.interval_s, self.enabled = interval_s or HEARTBEAT_S, enabled
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._start = time.perf_counter()

    def _beat(self) -> None:
        while not self._stop.wait(self.interval_s):
            where = notebook_progress(self.notebook_out) if self.notebook_out is not None else None
            self.log(f"{self.label}: running {time.perf_counter() - self._start:.0f} s"
                     + (f"; {where}" if where else ""))

    def __enter__(self) -> "Heartbeat":
        if self.enabled:
            self._thread = threading.Thread(target=self._beat, name="sweep-heartbeat", daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()


def _number(value: Any, fmt: str) -> str:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or math.isnan(value):
        return "-"
    return format(value, fmt)


def result_line(row: dict[str, Any]) -> str:
    """``ok  TGS 1,234  loss 5.123  dropped 0.012  (85 s)``, or the status and the start of the error."""
    status = row.get("status")
    elapsed = f"({_number(row.get('elapsed_s'), '.0f')} s)"
    if status in ("ok", "nan"):
        return (f"{status}  TGS {_number(row.get('tgs'), ',.0f')}  loss {_number(row.get('final_loss'), '.4f')}  "
                f"dropped {_number(row.get('dropped_fraction_mean'), '.3f')}  {elapsed}")
    error = " ".join(str(row.get("error") or "").split())
    return f"{status}  {error[:200]}{'...' if len(error) > 200 else ''}  {elapsed}"


def summary_table(rows: Sequence[dict[str, Any]]) -> list[str]:
    """A fixed-width table of this run's points: point, status, TGS, loss, dropped, seconds."""
    if not rows:
        return []
    width = min(max(len(str(r["point"])) for r in rows), 60)
    head = f"  {'point':<{width}}  {'status':<7}  {'TGS':>9}  {'loss':>8}  {'dropped':>7}  {'s':>6}"
    lines = [head, "  " + "-" * (len(head) - 2)]
    for r in rows:
        name = str(r["point"])
        name = name if len(name) <= width else name[:width - 3] + "..."
        lines.append(f"  {name:<{width}}  {r['status']:<7}  {_number(r.get('tgs'), ',.0f'):>9}  "
                     f"{_number(r.get('final_loss'), '.4f'):>8}  {_number(r.get('dropped_fraction_mean'), '.3f'):>7}  "
                     f"{_number(r.get('elapsed_s'), '.0f'):>6}")
    return lines
