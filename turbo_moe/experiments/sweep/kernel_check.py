"""The Jupyter kernel a sweep or the report runs its notebooks in must import this clone's turbo_moe.

`make setup` installs the kernel ``turbo-moe`` into this clone's venv (``ipykernel install --prefix .venv``),
where the venv's jupyter, papermill and JupyterLab find it before any kernel of the same name in the user's
folder; so several clones never share one. ``check_kernel`` then asks the kernel which turbo_moe it imports
and refuses, with the fix, when it is not this clone's (a kernel of that name installed by another clone
or venv would run the points with other code, and fail once that folder is gone).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import turbo_moe


def check_kernel(name: str) -> None:
    """Raise a ValueError with the fix when the Jupyter kernel ``name`` is not installed, or when it does not
    import this clone's turbo_moe (a kernel of that name from another clone or venv would run the points
    with other code, and fail once that folder is gone)."""
    from jupyter_client.kernelspec import KernelSpecManager, NoSuchKernel

    try:
        spec = KernelSpecManager().get_kernel_spec(name)
    except NoSuchKernel:
        raise ValueError(
            f"Jupyter kernel {name!r} is not installed for this environment; `make setup` installs it into this "
            f"clone's venv (or: .venv/bin/python -m ipykernel install --prefix .venv --name {name}), or pass "
            "--kernel NAME"
        ) from None
    ours = Path(turbo_moe.__file__).resolve().parent
    theirs = kernel_package_dir(spec)
    if theirs != ours:
        found = f"imports turbo_moe from {theirs}" if theirs else "cannot import turbo_moe"
        raise ValueError(
            f"Jupyter kernel {name!r} ({spec.resource_dir}, running {spec.argv[0]}) {found}, not this clone's "
            f"{ours}; install this clone's kernel with `make setup` (it goes into this clone's venv), or pass "
            "--kernel NAME"
        )


_KERNEL_PACKAGE: dict[tuple, Path | None] = {}  # per kernel spec as installed (its kernel.json's mtime)
_FIND_PACKAGE = "import importlib.util as u; s = u.find_spec('turbo_moe'); print(s.origin if s and s.origin else '')"


def kernel_package_dir(spec) -> Path | None:
    """The turbo_moe package folder the kernel ``spec`` imports (None: it cannot). A standard spec
    (``<python> [flags] -m ipykernel_launcher ...``) is asked through its interpreter with the spec's
    environment, without starting a kernel; any other (a wrapper script) is started as a kernel."""
    kernel_json = Path(spec.resource_dir) / "kernel.json"
    stamp = kernel_json.stat().st_mtime_ns if kernel_json.exists() else None
    key = (spec.resource_dir, tuple(spec.argv), tuple(sorted((spec.env or {}).items())), stamp,
           os.environ.get("PYTHONPATH"))
    if key not in _KERNEL_PACKAGE:
        argv = list(spec.argv)
        if argv and argv[0] in {"python", f"python{sys.version_info[0]}", "python%i.%i" % sys.version_info[:2]}:
            argv[0] = sys.executable  # as jupyter_client starts such a kernel (the venv's own python3 spec)
        if "-m" in argv and argv[argv.index("-m") + 1:argv.index("-m") + 2] == ["ipykernel_launcher"]:
            origin = _ask_interpreter(argv[:argv.index("-m")], spec.env or {})
        else:
            origin = _ask_kernel(spec)
        _KERNEL_PACKAGE[key] = Path(origin).resolve().parent if origin else None
    return _KERNEL_PACKAGE[key]


def _ask_interpreter(command: list[str], env: dict[str, str]) -> str:
    try:
        out = subprocess.run([*command, "-c", _FIND_PACKAGE], capture_output=True, text=True, timeout=120,
                             env={**os.environ, **env})
    except (OSError, subprocess.TimeoutExpired):
        return ""
    return out.stdout.strip().splitlines()[-1] if out.returncode == 0 and out.stdout.strip() else ""


def _ask_kernel(spec) -> str:
    from jupyter_client.manager import start_new_kernel

    lines: list[str] = []
    try:
        manager, client = start_new_kernel(kernel_name=Path(spec.resource_dir).name, startup_timeout=120)
    except Exception:  # a kernel that does not start cannot run the notebook either: say it cannot import
        return ""
    try:
        client.execute_interactive(_FIND_PACKAGE, timeout=120, output_hook=lambda msg: lines.append(
            msg["content"].get("text", "")) if msg["msg_type"] == "stream" else None)
    except Exception:
        return ""
    finally:
        client.stop_channels()
        manager.shutdown_kernel(now=True)
    text = "".join(lines).strip()
    return text.splitlines()[-1] if text else ""
