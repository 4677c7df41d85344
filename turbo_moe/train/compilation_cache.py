"""JAX's persistent compilation cache, on by default for CPU runs.

Why: on a CPU, a run of the `tiny`/`small` models spends most of its start in XLA's compiler (the init
program, the train step). The cache keeps each compiled program on disk keyed by the program and the
compiler's options, so a second run of the same shapes (a notebook re-run, the next point of a sweep with
the same model, `make main` again) loads it instead. A cache hit gives the executable a fresh compile
would: the numbers do not change, only the start-up time does.

Only where nothing set a cache already (`jax_compilation_cache_dir`, e.g. from JAX_COMPILATION_CACHE_DIR or
a test's conftest), and only on the CPU: GPU runs measure their own cold compile (docs/notes/gpu-runs.md).
"""
from __future__ import annotations

from pathlib import Path

import jax

DEFAULT_DIR = Path.home() / ".cache" / "turbo_moe" / "jax_compilation_cache"


def ensure_on(platform: str | None = None, directory: str | Path = DEFAULT_DIR) -> str | None:
    """Turn the cache on at `directory` for a CPU `platform` (default: JAX's backend) unless one is set.
    Returns the cache folder in use, or None when the cache is off (another platform, or disabled)."""
    platform = platform or jax.default_backend()
    current = jax.config.jax_compilation_cache_dir
    if current is None and platform == "cpu":
        try:
            Path(directory).mkdir(parents=True, exist_ok=True)
        except OSError:  # a read-only home: no cache, compile as before
            return None
        jax.config.update("jax_compilation_cache_dir", str(directory))
        current = str(directory)
    return current if current is not None and jax.config.jax_enable_compilation_cache else None
