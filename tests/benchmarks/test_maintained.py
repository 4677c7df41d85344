"""benchmarks/ holds maintained benchmarks only: every script answers --help, and docs/benchmarks.md names every file."""
import json
import os
import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
BENCHMARKS = REPO / "benchmarks"

# Runs each script as `python <script> --help` would, all in one process (one JAX import for all of them).
_HELP_ALL = """
import contextlib, io, json, runpy, sys
failures = {}
for path in sys.argv[1:]:
    sys.argv = [path, "--help"]
    out = io.StringIO()
    try:
        with contextlib.redirect_stdout(out):
            runpy.run_path(path, run_name="__main__")
        failures[path] = "ran to the end instead of printing its help"
    except SystemExit as done:
        if done.code not in (0, None) or "usage:" not in out.getvalue():
            failures[path] = f"exit code {done.code}: {out.getvalue()[-300:]!r}"
    except BaseException as error:
        failures[path] = f"{type(error).__name__}: {error}"
print("FAILURES " + json.dumps(failures))
"""


def scripts() -> list[Path]:
    return sorted(p for p in BENCHMARKS.glob("*.py") if not p.name.startswith("_"))


def test_every_benchmark_answers_help():
    assert len(scripts()) >= 15
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(REPO)}
    done = subprocess.run([sys.executable, "-c", _HELP_ALL, *map(str, scripts())], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=300)
    line = [l for l in done.stdout.splitlines() if l.startswith("FAILURES ")]
    assert line, done.stdout[-2000:] + done.stderr[-2000:]
    assert json.loads(line[-1].removeprefix("FAILURES ")) == {}


def test_docs_name_every_file_of_benchmarks():
    docs = (REPO / "docs" / "benchmarks.md").read_text()
    named = set(re.findall(r"`([\w./-]+)`", docs))
    entries = {p.name for p in BENCHMARKS.iterdir() if p.name != "__pycache__"}
    assert entries - {n.rstrip("/") for n in named} == set()
