"""Helpers for notebook tests: papermill and nbval runners (imported by the test modules)."""

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
NOTEBOOKS = REPO / "notebooks"
SANITIZE = Path(__file__).parent / "sanitize.cfg"


def execute(notebook: str, out_dir: Path, kernel: str, **parameters) -> Path:
    """papermill-execute ``notebooks/<notebook>`` with ``parameters``; returns the executed copy."""
    import papermill

    out = out_dir / notebook
    papermill.execute_notebook(str(NOTEBOOKS / notebook), str(out), parameters=parameters,
                               kernel_name=kernel, cwd=str(NOTEBOOKS), progress_bar=False)
    return out


def nbval(executed: Path) -> subprocess.CompletedProcess:
    """Re-run an executed notebook under nbval (lax mode) in a fresh pytest process."""
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--nbval-lax", "--nbval-current-env",
         "--nbval-sanitize-with", str(SANITIZE), str(executed)],
        cwd=executed.parent, capture_output=True, text=True, timeout=600,
    )
