"""What a training run shows while it runs, and the one line it leaves behind.

In a Jupyter kernel (JupyterLab, papermill) the status is a single display output updated in place
through a display id. Unlike an ipywidget (whose state a saved notebook loses: "Error displaying widget"),
the last update is stored in the notebook itself, so a saved, papermill-executed or HTML-exported
notebook still shows where the run ended. Elsewhere each phase prints a line and the steps draw a tqdm
bar on stderr. Blocking phases (initialising, compiling) show their elapsed time from a ticker thread,
so nothing is silent for more than a second or two.
"""

from __future__ import annotations

import html
import math
import sys
import threading
import time
from typing import Any, Mapping

PHASE_TEXT = {
    "setup": "setting up (data, mesh, model)",
    "initialisation": "initialising parameters",
    "restore": "restoring the checkpoint",
    "compilation": "compiling the train step",
    "training": "training",
    "evaluation": "evaluating",
    "checkpointing": "saving a checkpoint",
    "done": "done",
}
_TICKING = ("setup", "initialisation", "restore", "compilation", "evaluation", "checkpointing")
GIB = 1024**3


def in_notebook_kernel() -> bool:
    """True inside a Jupyter kernel (where display updates reach a notebook), False in a terminal."""
    try:
        from IPython import get_ipython
    except ImportError:
        return False
    shell = get_ipython()
    return shell is not None and getattr(shell, "kernel", None) is not None


class RunProgress:
    """Phases, step count, loss/TGS of one run; ``enabled=False`` shows nothing."""

    def __init__(self, desc: str, total: int, *, enabled: bool = True, notebook: bool | None = None,
                 tick_s: float = 1.0):
        self.desc, self.total, self.enabled = desc, total, enabled
        self.notebook = in_notebook_kernel() if notebook is None else notebook
        self.phase_name, self.done, self.postfix = "setup", 0, ""
        self.t0 = self._phase_t0 = time.perf_counter()
        self.finished_phases: list[str] = []  # "compiling the train step 12.3 s", for the status line
        self._lock = threading.Lock()
        self._handle = None
        self._bar = None
        self._last_draw = 0.0
        self._stop = threading.Event()
        self._ticker = None
        if enabled and self.notebook:
            from IPython.display import display

            self._handle = display(self._bundle(), raw=True, display_id=True)
            self._ticker = threading.Thread(target=self._tick, args=(tick_s,), daemon=True)
            self._ticker.start()
        elif enabled:
            self._line(f"{PHASE_TEXT['setup']} ...")

    # ------------------------------------------------------------------ events from the loop
    def phase(self, name: str) -> None:
        """Enter phase ``name`` (a key of PHASE_TEXT); the previous one is closed with its duration."""
        with self._lock:
            now = time.perf_counter()
            previous, spent = self.phase_name, now - self._phase_t0
            if previous not in ("training", "done") and spent >= 0.05:
                self.finished_phases.append(f"{PHASE_TEXT.get(previous, previous)} {spent:.1f} s")
            self.phase_name, self._phase_t0 = name, now
        if not self.enabled:
            return
        if self.notebook:
            self._draw(force=True)
            return
        if previous not in ("training", "done"):
            self._line(f"{PHASE_TEXT.get(previous, previous)}: {spent:.1f} s")
        if name == "training" and self._bar is None:
            from tqdm import tqdm

            self._bar = tqdm(total=self.total, initial=self.done, desc=self.desc, dynamic_ncols=True,
                             file=sys.stderr)
        elif name not in ("training", "done"):
            self._line(f"{PHASE_TEXT.get(name, name)} ...")

    def step(self, done: int, ce_loss: float, tgs: float) -> None:
        """`ce_loss`: the step's train cross-entropy (comparable with the eval CE; the total loss adds MTP and
        balance terms)."""
        with self._lock:
            advance, self.done = done - self.done, done
            self.postfix = f"train CE {ce_loss:.3f} | {tgs:,.0f} tok/dev/s"
        if not self.enabled:
            return
        if self.notebook:
            self._draw(force=done >= self.total)
        elif self._bar is not None:
            self._bar.set_postfix_str(f"train CE={ce_loss:.3f}, tgs={tgs:.0f} tok/dev/s", refresh=False)
            self._bar.update(advance)

    def start_at(self, step: int) -> None:
        """A resumed run starts counting at ``step``."""
        self.done = step

    def close(self, final: str = "") -> None:
        """Stop the ticker, leave the final status, and print ``final`` (the run's summary line)."""
        self.phase("done")
        self._stop.set()
        if self._ticker is not None:
            self._ticker.join(timeout=2)
        if self._bar is not None:
            self._bar.close()
        if self.enabled and self.notebook:
            self._draw(force=True)
        if self.enabled and final:
            print(final, flush=True)  # a stream output: survives saving, papermill and HTML export

    # ------------------------------------------------------------------ drawing
    def status_text(self) -> str:
        now = time.perf_counter()
        total = f"{now - self.t0:.0f} s"
        bar = _bar(self.done, self.total)
        if self.phase_name == "done":
            return f"{self.desc}: finished {self.done}/{self.total} steps {bar} in {total}"
        phase = f"{PHASE_TEXT.get(self.phase_name, self.phase_name)}"
        if self.phase_name != "training":
            phase += f" ... {now - self._phase_t0:.0f} s"
        parts = [f"{self.desc}: {phase}", f"step {self.done}/{self.total} {bar}"]
        if self.postfix:
            parts.append(self.postfix)
        parts.append(f"elapsed {total}")
        return " | ".join(parts)

    def _bundle(self) -> dict[str, str]:
        text = self.status_text()
        done = "; ".join(self.finished_phases)
        plain = text + (f"\n  ({done})" if done else "")
        pct = 100 * self.done / max(self.total, 1)
        html_text = (
            f'<div class="turbo-moe-progress" style="font-family:monospace">{html.escape(text)}'
            f'<div style="background:#ddd;width:24em;height:6px"><div style="background:#3b7dd8;height:6px;'
            f'width:{pct:.0f}%"></div></div>'
            + (f'<small style="color:#666">{html.escape(done)}</small>' if done else "") + "</div>")
        return {"text/plain": plain, "text/html": html_text}

    def _draw(self, force: bool = False) -> None:
        now = time.perf_counter()
        if self._handle is None or (not force and now - self._last_draw < 0.5):
            return  # at most two updates a second: each one is a message to the front end
        with self._lock:
            self._last_draw = now
            self._handle.update(self._bundle(), raw=True)

    def _tick(self, every: float) -> None:
        while not self._stop.wait(every) and self.phase_name != "done":  # a run that ends stops it
            if self.phase_name in _TICKING:
                self._draw(force=True)

    def _line(self, text: str) -> None:
        if self._bar is not None:
            self._bar.write(f"{self.desc}: {text}", file=sys.stderr)  # above the bar, not through it
        else:
            print(f"{self.desc}: {text}", file=sys.stderr, flush=True)


def _bar(done: int, total: int, width: int = 20) -> str:
    filled = int(width * done / max(total, 1))
    return "[" + "#" * filled + "." * (width - filled) + f"] {100 * done / max(total, 1):.0f}%"


def loss_text(summary: Mapping[str, Any]) -> str:
    """'final train CE 5.57, eval CE 5.59 (total loss incl. MTP and balance 7.24)': the cross-entropies side by side
    (the same quantity), the total loss named as such; '' when the run logged no step."""
    ce, total, evaluated = (summary.get(k) for k in ("final_ce_loss", "final_loss", "final_eval_loss"))
    if not _finite(ce):
        return f"final total loss {total:.4f}" if _finite(total) else ""
    text = f"final train CE {ce:.4f}" + (f", eval CE {evaluated:.4f}" if _finite(evaluated) else "")
    if _finite(total) and abs(total - ce) > 5e-5:
        text += f" (total loss incl. MTP and balance {total:.4f})"
    return text


def summary_line(status: str, error: str | None, summary: Mapping[str, Any], desc: str) -> str:
    """One line: steps, wall time, final train/eval cross-entropy and total loss, TGS, peak memory (or the
    failure)."""
    phases = summary.get("phase_seconds") or {}
    wall = sum(v for v in phases.values() if isinstance(v, (int, float)))
    compile_s = summary.get("compile_time_s")
    head = f"{desc}: {status}"
    if status != "ok":
        reason = (error or "").strip().splitlines()[0][:300] if error else "no error text"
        head += f" ({reason})"
    parts = [head, f"{summary.get('steps_done', 0)} steps in {wall:.1f} s"
             + (f" (compile {compile_s:.1f} s)" if _finite(compile_s) else "")]
    if loss_text(summary):
        parts.append(loss_text(summary))
    if _finite(summary.get("tgs")):
        parts.append(f"TGS {summary['tgs']:,.0f} tok/dev/s")
    peak = summary.get("peak_memory_bytes")
    if _finite(peak):
        source = str(summary.get("memory_source") or "").split(" (")[0]
        parts.append(f"peak memory {peak / GIB:.2f} GiB" + (f" ({source})" if source else ""))
    return " | ".join(parts)


def _finite(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
