"""Packaging: a core install (no [train]/[notebooks]) runs ops and model; the extras name themselves;
the Hopper warning when the CUDA library lacks the sm90 grouped GEMM."""
import subprocess
import sys
import textwrap
import tomllib
import types
import warnings
from pathlib import Path

import pytest

from turbo_moe.ops import _ffi

REPO = Path(__file__).resolve().parents[1]
# What [train] and [notebooks] add on top of the core (flax itself needs optax and orbax).
EXTRA_ONLY = ("tokenizers", "pyarrow", "tqdm", "psutil", "pandas", "matplotlib", "seaborn", "papermill",
              "jupyter_client", "jupyterlab", "nbval")

BLOCKED_RUN = textwrap.dedent("""
    import importlib.abc, sys
    class Absent(importlib.abc.MetaPathFinder):  # these packages are "not installed"
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] in {blocked!r}:
                raise ModuleNotFoundError(f"No module named {{name!r}}")
    sys.meta_path.insert(0, Absent())
    import jax.numpy as jnp
    from turbo_moe import model, ops
    model.get_config("tiny")
    print(ops.grouped_gemm(jnp.ones((4, 8)), jnp.ones((2, 8, 3)), jnp.array([1, 3], jnp.int32)).shape)
    for package in ("turbo_moe.train", "turbo_moe.data", "turbo_moe.experiments"):
        try:
            __import__(package)
        except ImportError as err:
            print(err)
""")


def test_core_runs_without_the_extras():
    code = BLOCKED_RUN.format(blocked=set(EXTRA_ONLY))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    lines = out.stdout.splitlines()
    assert lines[0] == "(4, 3)"
    assert "turbo_moe.train needs the [train] extra" in lines[1] and "pip install 'turbo-moe[train]'" in lines[1]
    assert "turbo_moe.data needs the [train] extra" in lines[2]
    assert "turbo_moe.experiments needs the [notebooks] extra (missing: pandas)" in lines[3]


def test_pyproject_extras():
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    core = " ".join(project["dependencies"])
    extras = project["optional-dependencies"]
    assert not any(name in core for name in ("jupyterlab", "papermill", "nbval", "seaborn", "pandas", "optax"))
    assert "turbo-moe[train]" in extras["notebooks"]
    assert "turbo-moe[train,notebooks]" in extras["dev"] and any(d.startswith("pytest") for d in extras["dev"])
    makefile = (REPO / "Makefile").read_text()
    assert '".[dev]"' in makefile  # make setup installs everything, as before the split


def _fake_cuda(monkeypatch, capability, has_sm90):
    device = types.SimpleNamespace(compute_capability=capability, device_kind="NVIDIA H100 80GB HBM3")
    monkeypatch.setattr(_ffi.jax, "devices", lambda *a: [device])
    monkeypatch.setattr(_ffi, "_cuda_has_sm90", lambda path: has_sm90)


@pytest.mark.parametrize("capability, has_sm90, warns", [
    ("9.0", False, True), ("9.0", True, False), ("8.0", False, False), ("9.0", None, False),
])
def test_hopper_without_the_sm90_kernel_warns(monkeypatch, capability, has_sm90, warns):
    _fake_cuda(monkeypatch, capability, has_sm90)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _ffi._warn_if_hopper_without_sm90(Path("/x/libturbo_moe_cuda.so"))
    hits = [w for w in caught if "Hopper" in str(w.message)]
    assert bool(hits) is warns
    if warns:
        assert "TURBO_MOE_CUTLASS_INCLUDE" in str(hits[0].message) and "H100" in str(hits[0].message)


def test_kernel_info_on_cpu():
    info = _ffi.kernel_info()
    assert info["grouped_gemm"] == "cpu" and info["cpu"].endswith(_ffi.CPU_LIBRARY)


def test_cmake_requires_cutlass_and_a_portable_cpu_target():
    cuda = (REPO / "kernels/cuda/CMakeLists.txt").read_text()
    assert "FATAL_ERROR" in cuda and "TURBO_MOE_CUTLASS_INCLUDE" in cuda
    top = (REPO / "CMakeLists.txt").read_text()
    assert '"x86-64-v2"' in top and "-march=native)" not in top
