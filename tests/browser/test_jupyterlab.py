"""02_train and 03_full_deepseek as a user meets them: JupyterLab in a real headless Chromium, Run All, read the
page, save, and read the saved notebook's text outputs.

Needs Chromium and its driver (Debian: ``apt-get install chromium chromium-driver``; ``.ci/run`` installs
them) and selenium (the ``dev`` extra); skipped with the reason where they are missing. The parameters
are set through JupyterLab's own cell model (as typing them would), the cells run through its Run All
command, and the assertions read what the page shows.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from browser_helpers import chromium_paths

REPO = Path(__file__).resolve().parents[2]
CHROMIUM, CHROMEDRIVER = chromium_paths()
pytestmark = [
    pytest.mark.skipif(CHROMIUM is None or CHROMEDRIVER is None,
                       reason="browser test: no Chromium/chromedriver found (Debian: apt-get install chromium "
                              "chromium-driver; .ci/run installs them)"),
    pytest.mark.timeout(420),
]
selenium = pytest.importorskip("selenium", reason="browser test: selenium is not installed (pip install -e '.[dev]')")

TINY = """model = "tiny"
model_overrides = {}
moe_path = "auto"
capacity_factor = None
per_device_batch = 2
seq_len = 32
steps = 3
learning_rate = 3e-3
warmup_steps = 1
eval_every = 0
eval_batches = 0
dataset = "synthetic"
seed = 0
train_overrides = {}
output_dir = "records"
result_json = None
run_name = None"""
# 03's Part 2 as a CPU user gets it (no model_overrides: the planner's shrunk slice), made short.
SLICE = """mesh_data = 32
mesh_expert = 8
mesh_tensor = 1
mesh_pipeline = 1
fsdp = True
accounting_batch = 1
accounting_seq_len = 4096
capacity_factor = 1.25
n_layers = 2
n_dense_layers = 1
n_experts = None
width_divisor = None
model_overrides = {}
max_step_tflop = None
paths = ["turbo"]
per_device_batch = 1
seq_len = 64
steps = 3
dataset = "synthetic"
train_overrides = {}
table = "full_deepseek"
results_dir = "slice_results\""""
TOKEN = "turbo-moe-browser-test"
# What a saved notebook must never show as text: an object's default repr (e.g. a pandas Styler's).
OBJECT_REPR = re.compile(r"<[\w.]+ (?:object )?at 0x[0-9a-fA-F]+>")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def lab(tmp_path_factory):
    """A JupyterLab server on copies of 02_train and 03_full_deepseek, with a `turbo-moe` kernel running this
    interpreter."""
    root = tmp_path_factory.mktemp("lab")
    for name in ("02_train.ipynb", "03_full_deepseek.ipynb"):
        shutil.copy(REPO / "notebooks" / name, root / name)
    jupyter = tmp_path_factory.mktemp("jupyter")
    kernel_dir = jupyter / "data" / "kernels" / "turbo-moe"
    kernel_dir.mkdir(parents=True)
    (kernel_dir / "kernel.json").write_text(json.dumps({
        "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
        "display_name": "Python (turbo-moe)", "language": "python"}))
    flags = [f for f in os.environ.get("XLA_FLAGS", "").split()
             if not f.startswith("--xla_force_host_platform_device_count")]  # one device, like a user's
    env = {**os.environ, "JUPYTER_PATH": str(jupyter / "data"), "JUPYTER_CONFIG_DIR": str(jupyter / "config"),
           "JUPYTER_DATA_DIR": str(jupyter / "data"), "JUPYTER_RUNTIME_DIR": str(jupyter / "runtime"),
           "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
           "XLA_FLAGS": " ".join(flags), "JAX_PLATFORMS": "cpu"}
    port = _free_port()
    log = open(jupyter / "lab.log", "w")
    server = subprocess.Popen(
        [sys.executable, "-m", "jupyter", "lab", "--no-browser", f"--port={port}", "--ip=127.0.0.1",
         f"--IdentityProvider.token={TOKEN}", "--allow-root", f"--ServerApp.root_dir={root}",
         "--LabApp.expose_app_in_browser=True",  # window.jupyterapp: its commands and cell models
         "--LabApp.news_url=", "--LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate"],
        env=env, stdout=log, stderr=subprocess.STDOUT, cwd=root)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + 90
        while True:
            try:
                urllib.request.urlopen(f"{url}/api/status?token={TOKEN}", timeout=2)
                break
            except OSError:
                if server.poll() is not None or time.time() > deadline:
                    raise RuntimeError("JupyterLab did not start:\n" + (jupyter / "lab.log").read_text()[-3000:])
                time.sleep(0.5)
        yield url, root
    finally:
        server.terminate()
        try:
            server.wait(timeout=20)
        except subprocess.TimeoutExpired:
            server.kill()
        log.close()


@pytest.fixture(scope="module")
def browser(tmp_path_factory):
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync",
                 "--disable-dev-shm-usage", "--window-size=1400,1000",
                 f"--user-data-dir={tmp_path_factory.mktemp('chromium')}"):
        options.add_argument(flag)
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)
    driver.set_script_timeout(30)
    try:
        yield driver
    finally:
        driver.quit()


def _wait(driver, script: str, timeout: float, what: str):
    deadline = time.time() + timeout
    while time.time() < deadline:
        value = driver.execute_script(script)
        if value:
            return value
        time.sleep(1)
    text = driver.execute_script("return document.body.innerText")
    raise AssertionError(f"timed out waiting for {what}; page text ends with:\n{text[-3000:]}")


# The notebook panel `_open` opened: found by its path, since a headless browser may give no widget the focus
# that `shell.currentWidget` follows.
_PANEL = ("const nb = window.jupyterapp && Array.from(window.jupyterapp.shell.widgets('main'))"
          ".find(w => w.sessionContext && w.context && w.context.path === window.turboMoeNotebook);")
_SET_PARAMETERS = _PANEL + """
const cells = nb.content.model.cells;
for (let i = 0; i < cells.length; i++) {
  const cell = cells.get(i);
  if ((cell.getMetadata('tags') || []).includes('parameters')) { cell.sharedModel.setSource(arguments[0]); return i; }
}
return -1;"""
_FINISHED = _PANEL + """
if (!nb || !nb.sessionContext || !nb.sessionContext.session || !nb.sessionContext.session.kernel) return false;
if (nb.sessionContext.session.kernel.status !== 'idle') return false;
const cells = nb.content.model.cells;
let last = null, failed = false;
for (let i = 0; i < cells.length; i++) {
  const cell = cells.get(i);
  if (cell.type !== 'code') continue;
  last = cell;
  for (let j = 0; j < cell.outputs.length; j++) if (cell.outputs.get(j).type === 'error') failed = true;
}
return failed || (last !== null && last.executionCount !== null);"""


def _run_all(driver, parameters: str) -> str:
    """Set the parameters cell, Run All, wait for the kernel; returns the notebook's visible text."""
    assert driver.execute_script(_SET_PARAMETERS, parameters) >= 0, "no cell tagged parameters"
    driver.execute_script("window.jupyterapp.commands.execute('notebook:clear-all-cell-outputs');"
                          "window.jupyterapp.commands.execute('notebook:run-all-cells');")
    time.sleep(2)  # let the first cell start before polling for the end
    _wait(driver, _FINISHED, 300, "Run All to finish")
    return driver.execute_script(_PANEL + "return nb.content.node.innerText;")


def _open(driver, url: str, name: str) -> None:
    driver.get(f"{url}/lab/tree/{name}?token={TOKEN}")
    driver.execute_script("window.turboMoeNotebook = arguments[0];", name)
    _wait(driver, _PANEL + "return !!(nb && nb.content && nb.content.model && nb.sessionContext"
                  " && nb.sessionContext.session && nb.sessionContext.session.kernel"
                  " && nb.sessionContext.session.kernel.status === 'idle');", 120, f"{name} and its kernel")
    # The notebook commands (Run All, save) act on the current widget, which follows the focus: click into the
    # notebook, as a user does (a headless browser focuses nothing by itself).
    from selenium.webdriver.common.by import By

    driver.execute_script(_PANEL + "window.jupyterapp.shell.activateById(nb.id);")
    driver.execute_script(_PANEL + "return nb.content.node;").find_element(By.CSS_SELECTOR, ".jp-Cell").click()
    _wait(driver, _PANEL + "return window.jupyterapp.shell.currentWidget === nb;", 30, f"{name} to be current")
    time.sleep(1)
    # Opening alone must not modify the notebook (its language_info matches what the kernel reports).
    assert driver.execute_script(_PANEL + "return nb.context.model.dirty;") is False


def _save(driver, path: Path) -> str:
    driver.execute_script("return window.jupyterapp.commands.execute('docmanager:save');")
    time.sleep(2)
    return path.read_text()


def _object_reprs(saved: str) -> list[str]:
    """Default object reprs in the saved notebook's text outputs (text/plain and streams)."""
    found = []
    for cell in json.loads(saved)["cells"]:
        for out in cell.get("outputs", []):
            texts = [out.get("text", "")] + [out.get("data", {}).get("text/plain", "")]
            found += [m for t in texts for m in OBJECT_REPR.findall("".join(t) if isinstance(t, list) else t)]
    return found


def test_02_train_in_jupyterlab(lab, browser):
    url, root = lab
    _open(browser, url, "02_train.ipynb")
    text = _run_all(browser, TINY)
    # moe_path "auto" is the fast path: turbo (its CPU kernels are always built).
    # Phases as they happened, the final status and the one-line summary, the human table, a figure.
    assert "train turbo: finished 3/3 steps" in text, text[-3000:]
    assert "compiling the train step" in text and "initialising parameters" in text
    assert "train turbo: ok | 3 steps in" in text and "peak memory" in text
    assert "TGS (tokens/device/s)" in text and "Error displaying widget" not in text
    assert "mean over all steps" in text and "last of 3 steps: max/mean" not in text  # the title is in the image
    images = browser.execute_script(_PANEL + "return nb.content.node.querySelectorAll('.jp-OutputArea img').length;")
    assert images >= 2  # run plot and expert-load heatmap
    # Saved, the record stays: the status and summary are plain outputs in the file, all of it human text.
    saved = _save(browser, root / "02_train.ipynb")
    assert "train turbo: ok | 3 steps in" in saved and "widget-view+json" not in saved
    assert _object_reprs(saved) == []

    bad = _run_all(browser, TINY.replace('moe_path = "auto"', 'moe_path = "bogus"'))
    assert "parameter moe_path: unknown path 'bogus'" in bad, bad[-3000:]
    assert "finished 3/3 steps" not in bad  # stopped before training


def test_03_shrunk_slice_in_jupyterlab(lab, browser):
    url, root = lab
    _open(browser, url, "03_full_deepseek.ipynb")
    text = _run_all(browser, SLICE)
    assert "SHRUNK slice (not DeepSeek-V3's widths)" in text, text[-3000:]
    assert "train turbo: ok | 3 steps in" in text and "turbo: train loss" in text, text[-3000:]
    # The page renders only the cells near the view: Part 1 and the figures are read from the saved file.
    saved = _save(browser, root / "03_full_deepseek.ipynb")
    assert "671.03" in saved and "SHRUNK slice" in saved and _object_reprs(saved) == []
    images = sum("image/png" in out.get("data", {}) for cell in json.loads(saved)["cells"]
                 for out in cell.get("outputs", []))
    assert images >= 3  # Part 1's memory bars, Part 2's TGS/memory and its loss curves
    assert (root / "slice_results" / "full_deepseek.csv").is_file()
