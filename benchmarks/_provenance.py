"""Provenance attached to every committed benchmark result: device, jax version, git commit, date."""
from __future__ import annotations

import datetime
import os
import platform
import subprocess
from pathlib import Path

import jax


def git_commit() -> str:
    if os.environ.get("TURBO_MOE_GIT_COMMIT"):  # a copied tree without .git (the GPU machine)
        return os.environ["TURBO_MOE_GIT_COMMIT"]
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                             cwd=Path(__file__).parent, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], capture_output=True,
                               text=True, cwd=Path(__file__).parent).stdout.strip()
        return out + ("-dirty" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def provenance() -> dict:
    dev = jax.devices()[0]
    return {
        "device_kind": dev.device_kind,
        "platform": dev.platform,
        "device_count": jax.device_count(),
        "cpu": cpu_model(),
        "jax_version": jax.__version__,
        "git_commit": git_commit(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }
