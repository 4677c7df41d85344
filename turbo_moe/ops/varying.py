"""shard_map typing helpers: which mesh axes a value varies over, and casts between those types.

Inside `jax.shard_map` every value carries the set of manual mesh axes it varies over (its "vma").
XLA FFI calls, collectives and custom_vjp cotangents need operands of matching types; these helpers
are the one place that reads and sets that type (the ops and the expert-parallel model use them).
"""
from __future__ import annotations

from typing import Any

import jax


def varying_axes(x: Any) -> frozenset:
    """Manual mesh axes (inside shard_map) over which `x` varies; empty outside shard_map."""
    aval = jax.typeof(x)
    vma = getattr(aval, "vma", None)
    if vma is None:
        vma = getattr(getattr(aval, "mat", None), "varying", frozenset())
    return frozenset(vma)


def make_varying(x: Any, axes: frozenset) -> Any:
    """Marks `x` as varying over `axes` (a no-op for axes it already varies over)."""
    missing = tuple(sorted(axes - varying_axes(x)))
    if not missing:
        return x
    if hasattr(jax.lax, "pcast"):
        return jax.lax.pcast(x, missing, to="varying")
    return jax.lax.pvary(x, missing)


def match_varying(grad: Any, primal: Any) -> Any:
    """A custom_vjp cotangent typed like its primal input inside shard_map.

    When a primal input is invariant over a mesh axis (replicated, e.g. expert weights over `data`)
    but was used in per-shard computation, its gradient is the sum of the per-shard gradients.
    """
    extra = tuple(sorted(varying_axes(grad) - varying_axes(primal)))
    return jax.lax.psum(grad, extra) if extra else grad
