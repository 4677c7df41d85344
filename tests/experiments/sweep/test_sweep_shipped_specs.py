"""Every committed sweep spec loads, names its points uniquely and only sets known notebook parameters."""

from pathlib import Path

import nbformat
import pytest

from turbo_moe.experiments.sweep.spec import RESERVED_PARAMS, load_spec

REPO = Path(__file__).resolve().parents[3]
SPECS = sorted((REPO / "experiments" / "sweeps").glob("*.yaml"))


def _notebook_parameters(path: Path) -> set[str]:
    nb = nbformat.read(path, as_version=4)
    (cell,) = [c for c in nb.cells if "parameters" in c.metadata.get("tags", [])]
    names = set()
    for line in cell.source.splitlines():
        name = line.split("=")[0].strip()
        if "=" in line and name.isidentifier() and not line.startswith((" ", "#")):
            names.add(name)
    return names


def test_there_are_specs_for_the_comparisons():
    assert {"cpu_default", "gpu_paths_x_batch", "gpu_paths_x_steps", "gpu_synthetic_vs_real"} <= {
        s.stem for s in SPECS}


@pytest.mark.parametrize("spec_path", SPECS, ids=[s.stem for s in SPECS])
def test_spec_is_valid(spec_path):
    spec = load_spec(spec_path)
    points = spec.expand()
    assert spec.name == spec_path.stem and points
    known = _notebook_parameters(spec.notebook)
    assert set(RESERVED_PARAMS) <= known, "the notebook must accept result_json and run_name"
    for point in points:
        unknown = set(point.params) - known
        assert not unknown, f"{point.name}: parameters {unknown} are not in {spec.notebook.name}"


def test_cpu_default_covers_every_path():
    points = load_spec(REPO / "experiments" / "sweeps" / "cpu_default.yaml").expand()
    assert sorted((p.params["moe_path"], p.params.get("capacity_factor"), p.params["seed"]) for p in points) == [
        ("dense_cf", 1.0, 0), ("dense_cf", 2.0, 0), ("ragged", None, 0), ("turbo", None, 0), ("turbo", None, 1)]
    assert {p.params["model"] for p in points} == {"small"}
    assert {p.params["dataset"] for p in points} == {"shakespeare"}
