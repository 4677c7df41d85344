"""Fixtures for notebook tests: a Jupyter kernel for this interpreter, papermill and nbval runners.

Each notebook is papermill-executed once with tiny parameters (as a sweep would), then nbval re-runs
the executed copy (``--nbval-lax``: only cells marked ``# NBVAL_CHECK_OUTPUT`` are compared, through
``sanitize.cfg``).
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
NOTEBOOKS = REPO / "notebooks"
SANITIZE = Path(__file__).parent / "sanitize.cfg"
TEST_KERNEL = "turbo-moe-test"


@pytest.fixture(scope="session")
def kernel(tmp_path_factory):
    """A kernel spec running this interpreter, found through JUPYTER_PATH, for the whole session."""
    jupyter_dir = tmp_path_factory.mktemp("jupyter")
    kernel_dir = jupyter_dir / "kernels" / TEST_KERNEL
    kernel_dir.mkdir(parents=True)
    (kernel_dir / "kernel.json").write_text(json.dumps({
        "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
        "display_name": "Python (turbo-moe tests)", "language": "python",
    }))
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("JUPYTER_PATH", str(jupyter_dir))
        # The kernel must import this checkout of turbo_moe and draw without a display.
        mp.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
        mp.setenv("MPLBACKEND", "module://matplotlib_inline.backend_inline")
        yield TEST_KERNEL


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
