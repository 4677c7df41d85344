"""Fixture for notebook tests: a Jupyter kernel for this interpreter (runners are in nbhelpers.py).

Each notebook is papermill-executed once with tiny parameters (as a sweep would), then nbval re-runs
the executed copy (``--nbval-lax``: only cells marked ``# NBVAL_CHECK_OUTPUT`` are compared, through
``sanitize.cfg``).
"""

import json
import os
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
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
        # tests/conftest.py fakes 8 host devices for multi-device tests; a notebook kernel should see
        # one CPU device, like a user's session (8 devices would multiply the global batch by 8).
        # XLA's CPU optimisations off, as in this process (tests/conftest.py): compiles take about half as long.
        flags = [f for f in os.environ.get("XLA_FLAGS", "").split()
                 if not f.startswith("--xla_force_host_platform_device_count")]
        mp.setenv("XLA_FLAGS", " ".join(flags + ["--xla_backend_optimization_level=0",
                                                 "--xla_llvm_disable_expensive_passes=true"]))
        # One compilation cache for this session's kernels, empty at the start: nbval's re-run of a notebook that
        # papermill just executed loads its programs instead of compiling them again.
        mp.setenv("JAX_COMPILATION_CACHE_DIR", str(tmp_path_factory.mktemp("kernel_jax_cache")))
        mp.setenv("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
        yield TEST_KERNEL
