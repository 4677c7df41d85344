"""Scan outputs without the zero fill (on GPUs, wherever this JAX's scan allows it: `build_program`).

`jax.lax.scan` builds each stacked output (and, under autodiff, each stacked residual of the forward scan and
each stacked parameter gradient of the backward one) as a zero-filled buffer that the loop then overwrites slice by
slice; every slice is written, so the fill is wasted work (`loop_broadcast_fusion` kernels; docs/configuration.md).
JAX has `lax.empty` (XLA's "AllocateBuffer" on
GPU/TPU, zeros elsewhere) but its scan does not use it yet (a TODO in jax/_src/lax/control_flow/loops.py).
`uninitialized_scan_outputs()` swaps JAX's private `loops._empty_array` for one that returns `lax.empty` while
a program is lowered. It depends on that private function: with a JAX whose scan builds its outputs another
way it refuses, by name, rather than guess.
"""
from __future__ import annotations

import contextlib
import inspect
from typing import Any, Callable

import jax
from jax import lax

from turbo_moe.ops.varying import make_varying, varying_axes

_EXPECTED_PARAMETERS = ["prefix", "length_spec", "aval"]


def _loops():
    from jax._src.lax.control_flow import loops

    return loops


def supported() -> bool:
    """Whether this JAX's scan builds its outputs the way `uninitialized_scan_outputs` replaces."""
    original = getattr(_loops(), "_empty_array", None)
    return original is not None and list(inspect.signature(original).parameters) == _EXPECTED_PARAMETERS


def check_supported() -> None:
    """Raises if this JAX's scan does not build its outputs with `loops._empty_array(prefix, length_spec, aval)`."""
    if not supported():
        raise RuntimeError(
            f"uninitialized_scan_outputs: jax {jax.__version__} does not build scan outputs with "
            f"jax._src.lax.control_flow.loops._empty_array{tuple(_EXPECTED_PARAMETERS)}, which it replaces")


@contextlib.contextmanager
def uninitialized_scan_outputs():
    """Within this context, scans lowered leave their stacked outputs uninitialised until the loop writes them."""
    check_supported()
    loops = _loops()
    original = loops._empty_array

    def empty_array(prefix, length_spec, aval):
        zeros = original(prefix, length_spec, aval)  # traced only for its type; XLA drops the unused fill
        return make_varying(lax.empty(zeros.shape, zeros.dtype), varying_axes(zeros))

    # JAX caches primitive lowerings within a process: clear them on the way in (so that this lowering does not
    # reuse a zero-filled scan) and out (so that a later lowering does not reuse an uninitialised one).
    jax.clear_caches()
    loops._empty_array = empty_array
    try:
        yield
    finally:
        loops._empty_array = original
        jax.clear_caches()


class LoweredWithUninitializedScans:
    """A jitted function whose lowering runs inside `uninitialized_scan_outputs()`: `.lower(...)`, or a call, which
    compiles once (for the first call's argument types) and runs that executable from then on."""

    def __init__(self, jitted: Callable):
        check_supported()
        self.jitted = jitted
        self._compiled = None

    def lower(self, *args: Any, **kwargs: Any):
        with uninitialized_scan_outputs():
            return self.jitted.lower(*args, **kwargs)

    def __call__(self, *args: Any):
        if self._compiled is None:
            self._compiled = self.lower(*args).compile()
        return self._compiled(*args)
