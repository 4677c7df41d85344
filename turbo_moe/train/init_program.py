"""The parameter-init program, compiled with JAX's threefry GPU kernel where its temporaries fit.

Why: on the GPU, JAX lowers every `jax.random` call site to an unrolled 20-round threefry graph that
XLA compiles into its own large fusion; the init program of a model has one such site per parameter
kind, and compiling them took 13.6 s of the `reduced` cold start on an H100 (experiments/NOTES.md).
`jax_threefry_gpu_kernel_lowering` lowers the same threefry2x32 to one prebuilt CUDA kernel instead:
the same bits (it is the same function), a compile of seconds, at the price of materialising the
kernel's operands (key and counter broadcast to the output shape, ~24 bytes per parameter element of
the largest call). `mode="auto"` compiles with the kernel, reads XLA's memory analysis and keeps it
only if arguments + outputs + temporaries fit in the device's memory (else it compiles the default
lowering). On the CPU the flag changes nothing (its lowering ignores it). `TURBO_MOE_INIT_THREEFRY_KERNEL`
= auto (default) | on | off overrides the choice.
"""
from __future__ import annotations

import contextlib
import os
import time
from typing import Any, Callable

import jax

try:  # a jax config state: usable as a context manager (lowering reads it when it runs)
    from jax._src.config import threefry_gpu_kernel_lowering as _threefry_kernel_state
except ImportError:  # pragma: no cover — a jax without the option: always the default lowering
    _threefry_kernel_state = None

MODES = ("auto", "on", "off")
FIT_FRACTION = 0.9  # of the device's bytes_limit the init program may use with the kernel lowering


def _threefry_kernel(enabled: bool):
    if _threefry_kernel_state is None or not enabled:
        return contextlib.nullcontext()
    return _threefry_kernel_state(True)


def _device_bytes_limit() -> int | None:
    try:
        stats = jax.devices()[0].memory_stats() or {}
    except Exception:  # noqa: BLE001 — backends without memory stats (CPU)
        return None
    return stats.get("bytes_limit")


def _program_bytes(compiled) -> int | None:
    try:
        mem = compiled.memory_analysis()
    except Exception:  # noqa: BLE001
        return None
    if mem is None:
        return None
    return sum(getattr(mem, f, 0) or 0 for f in (
        "argument_size_in_bytes", "output_size_in_bytes", "temp_size_in_bytes", "generated_code_size_in_bytes"))


class InitProgram:
    """Callable like the jitted init (`key -> TrainState`), with `.lower(key)` and `.compile(key)`.

    `last_choice` says which lowering the compiled program uses ("kernel" or "default") and why.
    """

    def __init__(self, jitted: Callable, mode: str | None = None):
        mode = mode or os.environ.get("TURBO_MOE_INIT_THREEFRY_KERNEL", "auto")
        if mode not in MODES:
            raise ValueError(f"init threefry kernel mode (TURBO_MOE_INIT_THREEFRY_KERNEL) must be one of "
                             f"{MODES}, got {mode!r}")
        self.jitted = jitted
        self.mode = mode
        self.last_choice: dict[str, Any] = {}
        self._compiled: dict[Any, Any] = {}  # key dtype (threefry / rbg) -> compiled program

    @property
    def _gpu(self) -> bool:
        return jax.default_backend() == "gpu" and _threefry_kernel_state is not None

    def lower(self, key, *, kernel: bool | None = None):
        use = self.mode != "off" and self._gpu if kernel is None else kernel
        with _threefry_kernel(use):
            return self.jitted.lower(key)

    def compile(self, key):
        """Compile once per key kind (cached): with the kernel lowering where it fits, else the default."""
        if key.dtype not in self._compiled:
            self._compiled[key.dtype] = self._compile(key)
        return self._compiled[key.dtype]

    def _compile(self, key):
        if not self._gpu or self.mode == "off":
            return self._default(key, "mode off" if self._gpu else "not a GPU")
        start = time.perf_counter()
        try:
            compiled = self.lower(key, kernel=True).compile()
        except Exception as error:  # noqa: BLE001 — e.g. a jaxlib without the kernel: the default lowering
            if self.mode == "on":
                raise
            return self._default(key, f"kernel lowering failed: {type(error).__name__}: {error}")
        need, limit = _program_bytes(compiled), _device_bytes_limit()
        if self.mode == "auto" and need is not None and limit is not None and need > FIT_FRACTION * limit:
            return self._default(key, f"kernel lowering needs {need} bytes > {FIT_FRACTION} x {limit}")
        self.last_choice = {"lowering": "kernel", "program_bytes": need, "device_bytes_limit": limit,
                            "kernel_compile_s": round(time.perf_counter() - start, 2)}
        return compiled

    def _default(self, key, why: str):
        self.last_choice = {"lowering": "default", "why": why}
        return self.lower(key, kernel=False).compile()

    def __call__(self, key):
        if isinstance(key, jax.core.Tracer) or not self._gpu:  # traced, or the CPU: the plain jitted init
            return self.jitted(key)
        return self.compile(key)(key)
