"""Optional dependency groups: a subpackage that needs an extra says which one when it is missing.

`turbo_moe.ops` and `turbo_moe.model` need only the core dependencies; `turbo_moe.train` /
`turbo_moe.data` need ``[train]`` and `turbo_moe.experiments` ``[notebooks]`` (pyproject.toml).
"""
from __future__ import annotations

import importlib.util

# What each subpackage imports when it is imported (never more: the GPU machine runs turbo_moe.train
# and experiments.convergence with only part of an extra installed). Other modules of an extra are
# imported lazily, where they are used.
NEEDS = {
    "turbo_moe.train": ("train", ("optax", "orbax", "tokenizers")),
    "turbo_moe.data": ("train", ("tokenizers",)),
    "turbo_moe.experiments": ("notebooks", ("pandas",)),
}


def require(package: str) -> None:
    """Raise ImportError naming the extra when a module ``package`` imports is not installed."""
    extra, modules = NEEDS[package]
    missing = [m for m in modules if not _installed(m)]
    if missing:
        raise ImportError(f"{package} needs the [{extra}] extra (missing: {', '.join(missing)}); "
                          f"install it with `pip install 'turbo-moe[{extra}]'` (or `make setup`)")


def _installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # a broken or half-installed package counts as missing
        return False
