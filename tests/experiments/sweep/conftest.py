"""Fixtures for sweep tests: a Jupyter kernel for this interpreter and a throwaway notebook."""

import json
import sys

import nbformat
import pytest

TEST_KERNEL = "turbo-moe-test"


def install_test_kernel(jupyter_dir, monkeypatch, name=TEST_KERNEL):
    """A kernel spec running this interpreter, visible through JUPYTER_PATH only for this test."""
    kernel_dir = jupyter_dir / "kernels" / name
    kernel_dir.mkdir(parents=True, exist_ok=True)
    spec = {
        "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
        "display_name": f"Python ({name})",
        "language": "python",
    }
    (kernel_dir / "kernel.json").write_text(json.dumps(spec))
    monkeypatch.setenv("JUPYTER_PATH", str(jupyter_dir))
    return name


@pytest.fixture
def test_kernel(tmp_path, monkeypatch):
    return install_test_kernel(tmp_path / "jupyter", monkeypatch)


TOY_SOURCE = [
    # Every name a test spec sets must be assigned here: specs are checked against this cell.
    "x = 1\nmode = 'ok'\ncfg = batch = steps = model = moe_path = capacity_factor = per_device_batch = None\n"
    "dataset = model_overrides = None\nresult_json = None\nrun_name = None",
    "import json\n"
    "if mode == 'fail':\n    raise RuntimeError(f'point failed on purpose, x={x}')\n"
    "if mode == 'oom':\n    raise RuntimeError('RESOURCE_EXHAUSTED: Out of memory while trying to allocate 123 bytes')",
    "record = {'status': 'nan' if mode == 'nan' else 'ok', 'error': None,\n"
    "          'summary': {'tgs': 10.0 * x, 'final_loss': 1.0 / x},\n"
    "          'provenance': {'device_kind': 'toy', 'device_count': 1}}\n"
    "if result_json:\n    json.dump(record, open(result_json, 'w'))",
]


@pytest.fixture
def toy_notebook(tmp_path):
    """A three-cell notebook: parameters (x, mode), an optional failure, a JSON record."""
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell(src) for src in TOY_SOURCE]
    nb.cells[0].metadata["tags"] = ["parameters"]
    nb.metadata["kernelspec"] = {"name": TEST_KERNEL, "display_name": "toy", "language": "python"}
    path = tmp_path / "toy.ipynb"
    nbformat.write(nb, path)
    return path
