"""README.md as a new user reads it on a CPU-only machine: every fenced command and Python snippet is run as written,
or, where it needs a GPU or a machine set-up, checked to say so and to parse.

Each command and snippet is classified below; one that fits no class fails the test, so a new README line needs a
decision here. The runs use a fresh folder as the working directory (their `runs/` go there), one JAX compilation
cache shared by them, no XLA_FLAGS (one CPU device, as on a user's machine) and XLA's CPU optimisations off for
compile time, as the rest of the suite does.
"""
from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from turbo_moe import cli
from turbo_moe.train.config_file import load_train_config

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
BIN = Path(sys.executable).parent
# The user's own arrays, which the ops snippets take from their model: T tokens of width D, top-k of E experts.
USER_ARRAYS = """
import jax, jax.numpy as jnp
T, D, F, num_experts, k = 16, 32, 24, 4, 2
keys = jax.random.split(jax.random.key(0), 5)
tokens = jax.random.normal(keys[0], (T, D))
expert_ids = jax.random.randint(keys[1], (T, k), 0, num_experts)
weights = jax.nn.softmax(jax.random.normal(keys[2], (T, k)), axis=-1)
w_gate_up = jax.random.normal(keys[3], (num_experts, D, 2 * F)) / D**0.5
w_down = jax.random.normal(keys[4], (num_experts, F, D)) / F**0.5
act = lambda h: jax.nn.silu(h[..., :F]) * h[..., F:]   # SwiGLU: (.., 2F) -> (.., F)
"""


def fenced(lang: str) -> list[str]:
    return re.findall(rf"^```{lang}\n(.*?)^```", README, flags=re.M | re.S)


def command_lines() -> list[tuple[str, str]]:
    """(command, its comment) for every line of the README's bash blocks."""
    lines = []
    for block in fenced("bash"):
        for line in block.splitlines():
            if line.strip():
                command, _, comment = line.partition("#")
                lines.append((command.strip(), comment.strip()))
    return lines


def python_snippets() -> list[str]:
    return fenced("python")


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    """A user's working folder: the repository's experiments/ beside it (read by the commands, never written: the
    runs write runs/ here), its own compilation cache."""
    path = tmp_path_factory.mktemp("readme_user")
    (path / "experiments").symlink_to(ROOT / "experiments")
    return path


def user_env(workdir: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env.update(JAX_PLATFORMS="cpu", JAX_COMPILATION_CACHE_DIR=str(workdir / "jax_cache"),
               JAX_DISABLE_MOST_OPTIMIZATIONS="1", PYTHONPATH=str(ROOT))
    return env


def run(argv: list[str], workdir: Path, timeout: int = 600) -> subprocess.CompletedProcess:
    done = subprocess.run(argv, cwd=workdir, env=user_env(workdir), capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, f"{shlex.join(argv)} exited {done.returncode}:\n{done.stdout[-3000:]}\n" \
                                 f"{done.stderr[-3000:]}"
    return done


def as_user_runs_it(command: str) -> list[str]:
    """The command's argv, with `.venv/bin/X` and `python` as this environment's."""
    argv = shlex.split(command)
    if argv[0].startswith(".venv/bin/"):
        argv[0] = str(BIN / argv[0].removeprefix(".venv/bin/"))
    elif argv[0] == "python":
        argv[0] = sys.executable
    return argv


def parsed(argv: list[str], monkeypatch) -> object:
    """What `turbo-moe` would run for argv: its parsed arguments, the command not run."""
    seen = []
    for name in ("cmd_train", "cmd_launch", "cmd_sweep", "cmd_report"):
        monkeypatch.setattr(cli, name, lambda args: seen.append(args) or 0)
    assert cli.main(argv) == 0
    return seen[0]


def gpu_only(command: str, comment: str) -> bool:
    return "--gpus" in command or "GPU" in comment


def test_every_readme_line_is_classified():
    """Every command and snippet falls in one of the classes the tests below handle."""
    assert command_lines() and python_snippets()
    for command, comment in command_lines():
        argv = shlex.split(command)
        known = (argv[:1] == ["make"] or argv[0].endswith("turbo-moe")
                 or (argv[0] == "python" and argv[1].startswith("benchmarks/") and gpu_only(command, comment)))
        assert known, f"README command not covered by tests/test_readme.py: {command!r}"
        if argv[0].endswith("turbo-moe") and argv[1] == "sweep" and "--dry-run" not in argv:
            assert gpu_only(command, comment), f"a sweep run is minutes to hours: say it needs a GPU: {command!r}"
    for snippet in python_snippets():
        assert any(marker in snippet for marker in ("from turbo_moe.ops import", "turbo_maxtext.enable()",
                                                    "from turbo_moe.train import")), snippet


def test_make_lines_are_targets_and_say_what_they_do():
    makefile = (ROOT / "Makefile").read_text()
    for command, comment in command_lines():
        if command.startswith("make "):
            target = command.split()[1]
            assert re.search(rf"^{target}:", makefile, flags=re.M), f"Makefile has no target {target!r}"
            assert comment, f"README line {command!r} must say what it does (it is not run here)"


def test_ops_and_maxtext_snippets_run_as_written(workdir):
    """The ops snippets on the user's own arrays (USER_ARRAYS) give finite (T, D) outputs; the MaxText snippet
    enables the integration, or, without MaxText, raises one ImportError saying what to install. One process."""
    snippets = [s for s in python_snippets() if "from turbo_moe.ops import" in s]
    (maxtext,) = [s for s in python_snippets() if "turbo_maxtext.enable()" in s]
    assert len(snippets) >= 2
    checks = "\nassert y.shape == (T, D) and bool(jnp.isfinite(y).all()), y.shape\nprint('ops ok')\n"
    program = USER_ARRAYS + "\n".join(s + checks for s in snippets)
    program += "try:\n" + "".join(f"    {line}\n" for line in maxtext.splitlines()) + "    print('maxtext ok')\n"
    program += "except ImportError as error:\n    print(f'ImportError: {error}')\n"
    out = run([sys.executable, "-c", program], workdir).stdout
    assert out.count("ops ok") == len(snippets), out
    if "maxtext ok" not in out:
        assert "ImportError: turbo_moe.integrations.maxtext needs MaxText" in out and "pip install maxtext" in out, out


def test_gpu_lines_say_so_and_parse(monkeypatch):
    """GPU-only lines are not run here: each says it needs GPUs, parses, and its config or script exists."""
    checked = 0
    for command, comment in command_lines():
        if not gpu_only(command, comment):
            continue
        argv = as_user_runs_it(command)
        if argv[0].endswith("turbo-moe"):
            args = parsed(argv[1:], monkeypatch)
            target = getattr(args, "config", None) or getattr(args, "spec", None)
            assert (ROOT / target).is_file(), target
            if hasattr(args, "config"):
                load_train_config(ROOT / args.config, args.sets)  # the config itself is valid
        else:  # a benchmark script: it exists and takes the flags the README gives it
            help_text = subprocess.run([sys.executable, str(ROOT / argv[1]), "--help"], capture_output=True,
                                       text=True, timeout=300, env={**os.environ, "JAX_PLATFORMS": "cpu"}).stdout
            for flag in (a for a in argv[2:] if a.startswith("--")):
                assert flag in help_text, f"{argv[1]} has no {flag}"
        checked += 1
    assert checked >= 2


def test_cli_help_names_every_command_the_readme_uses():
    done = subprocess.run([str(BIN / "turbo-moe"), "--help"], capture_output=True, text=True, timeout=120)
    used = {shlex.split(c)[1] for c, _ in command_lines() if shlex.split(c)[0].endswith("turbo-moe")}
    head = done.stdout.split("positional arguments")[0]
    for name in used:
        assert name in head, f"turbo-moe --help's description does not name {name!r}"


def test_cpu_commands_and_training_snippet_run_as_written(workdir, monkeypatch):
    """Every turbo-moe line that runs on a CPU is run; then the Python training snippet (its programs may come from
    the compilation cache the command filled)."""
    ran = []
    for command, comment in command_lines():
        argv = as_user_runs_it(command)
        if not argv[0].endswith("turbo-moe") or gpu_only(command, comment):
            continue
        if argv[1] == "report":
            # It redraws the report from the whole store (a minute of CI): here its defaults must find this clone's
            # store and notebook from another folder; tests/notebooks/test_nb_04_report.py runs the command.
            args = parsed(argv[1:], monkeypatch)
            assert args.experiments_dir is None and args.notebook is None, args
            assert (ROOT / "experiments" / "store").is_dir() and (ROOT / "notebooks" / "04_report.ipynb").is_file()
            continue
        done = run(argv, workdir)
        if argv[1] == "train":
            assert "status ok" in done.stdout + done.stderr, done.stdout[-2000:]
            # "Each run writes runs/<config>-<n>/ (or --out): record, curves, TensorBoard log, checkpoint."
            folder = workdir / "runs" / f"{Path(argv[2]).stem}-1"
            assert {"record.json", "history.csv", "checkpoint"} <= {f.name for f in folder.iterdir()}, folder
            assert any(f.name.startswith("events.out.tfevents") for f in folder.iterdir()), folder
        ran.append(argv[1])
    assert "train" in ran and "sweep" in ran
    (snippet,) = [s for s in python_snippets() if "from turbo_moe.train import" in s]
    done = run([sys.executable, "-c", snippet], workdir)
    assert done.stdout.strip().splitlines()[-1].split()[0] == "ok", done.stdout[-2000:]


def test_the_readme_stays_within_12000_bytes():
    """The README is for users: measurements go to the results store, reasoning to docs/ (the house limit)."""
    size = len(README.encode())
    assert size <= 12_000, f"README.md is {size} bytes; move detail to docs/ (limit 12,000)"
