"""Provenance for benchmark results: the package's one schema (`turbo_moe.provenance`), re-exported so
scripts run as `python benchmarks/x.py` keep `from _provenance import provenance`."""
from __future__ import annotations

from turbo_moe.provenance import collect as provenance  # noqa: F401
from turbo_moe.provenance import cpu_model, git_info  # noqa: F401


def git_commit() -> str:
    return git_info()["git_commit"]
