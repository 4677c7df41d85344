"""The parameter-init program, compiled with the random-number lowering that compiles fastest on the device.

Why: an init program has one `jax.random` call site per parameter kind, and its compile time grows with
them.

- GPU: JAX lowers every threefry call site to an unrolled 20-round graph that XLA compiles into its own
  large fusion (13.6 s of the `reduced` cold start on an H100). `jax_threefry_gpu_kernel_lowering` lowers
  the same threefry2x32 to one prebuilt CUDA kernel instead: the same bits (it is the same function), a
  compile of seconds, at the price of materialising the kernel's operands (key and counter broadcast to the
  output shape, ~24 bytes per parameter element of the largest call). `mode="auto"` compiles with the
  kernel, reads XLA's memory analysis and keeps it only if arguments + outputs + temporaries fit in the
  device's memory (else it compiles the default lowering).
- CPU: the threefry lowering is a rolled loop per call site, several fusions each, and the kernel lowering
  does not exist. `mode="auto"` draws from Philox-2x32 instead (`jax.random.key(seed, impl="philox2x32")`,
  10 rounds, unrolled into one fusion per call site): the init compiles several times faster. Other values
  than the threefry init of the same seed, equally random, and the same on every CPU. The program is
  compiled with `CPU_COMPILER_OPTIONS` (XLA's elemental emitters instead of its MLIR fusion emitters: a
  cheaper compile of the same bits, and the program runs once), or without them where this XLA lacks one.
  docs/notes/newcomer.md has the measurements.
- CPU, a mesh of several devices: XLA:CPU cannot lower Philox on a sharded output, and the sharded threefry
  program compiled for minutes (tiny on 4 or 8 devices: 130-240 s, against 8 s on one device). Under "auto" the
  one-device Philox program (`one_device`) draws the whole state on this process's first device, and each leaf is
  laid out on the mesh from a host copy (`jax.make_array_from_callback`: every process draws the same values and
  places its own shards). The same values as a one-device CPU run of the seed; the whole state is held once per
  process while it is laid out.

`mode`: "auto" (the above), "on" (threefry with the GPU kernel lowering; an error where it fails), "off"
(threefry with the default lowering on every device: the values of the jitted init called with the
caller's key).
"""
from __future__ import annotations

import contextlib
import time
from typing import Any, Callable

import jax
import numpy as np

try:  # a jax config state: usable as a context manager (lowering reads it when it runs)
    from jax._src.config import threefry_gpu_kernel_lowering as _threefry_kernel_state
except ImportError:  # pragma: no cover — a jax without the option: always the default lowering
    _threefry_kernel_state = None

MODES = ("auto", "on", "off")
FIT_FRACTION = 0.9  # of the device's bytes_limit the init program may use with the kernel lowering
CPU_RNG = "philox2x32"  # the generator "auto" draws from on the CPU
# XLA:CPU options for the init program only: bit-identical output (tests/train/test_init_program.py checks it),
# a cheaper compile. Not the backend optimisation level: that one changes float roundings of the normal draws.
CPU_COMPILER_OPTIONS = {"xla_cpu_use_fusion_emitters": False}


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


def _has_impl(name: str) -> bool:
    try:
        jax.random.key(0, impl=name)
    except (ValueError, KeyError, TypeError):  # a jax without it: threefry everywhere
        return False
    return True


def _is_threefry(key) -> bool:
    return str(jax.random.key_impl(key)) == "threefry2x32"


def cpu_key(key):
    """`key` (threefry, from `jax.random.key(seed)`) as the Philox-2x32 key of the same seed: equal to
    `jax.random.key(seed, impl="philox2x32")` for any 32-bit seed (64-bit seeds fold in their high word)."""
    hi, lo = (int(word) for word in np.asarray(jax.random.key_data(key)).reshape(-1)[-2:])
    out = jax.random.key(np.uint32(lo), impl=CPU_RNG)
    return jax.random.fold_in(out, hi) if hi else out


def _unlowerable(error: Exception) -> bool:
    """XLA:CPU's refusal to lower Philox on a sharded output (see InitProgram._cpu_compile)."""
    return isinstance(error, jax.errors.JaxRuntimeError) and ("MHLO" in str(error) or "legalize" in str(error))


def _lowers(lowered) -> bool:
    """Whether a lowered CPU program compiles (Philox on a sharded output does not: see InitProgram._cpu_compile)."""
    try:
        lowered.compile()
    except jax.errors.JaxRuntimeError as error:
        if not _unlowerable(error):
            raise
        return False
    return True


def compile_on_cpu(lowered, options: dict[str, Any] | None = None):
    """`lowered.compile` with `options` (default CPU_COMPILER_OPTIONS), or without those this XLA does not know."""
    options = CPU_COMPILER_OPTIONS if options is None else options
    try:
        return lowered.compile(compiler_options=dict(options) or None)
    except jax.errors.JaxRuntimeError as error:
        if "compile option" not in str(error):
            raise
        return lowered.compile()


class InitProgram:
    """Callable like the jitted init (`key -> TrainState`), with `.lower(key)` and `.compile(key)`.

    `program_key(key)` is the key the compiled program is called with (the CPU's Philox key under "auto",
    else `key`): `init(key)` is `init.compile(key)(init.program_key(key))`. `last_choice` says which
    generator and lowering the program uses ("rng", "lowering": "kernel" or "default") and why.
    """

    def __init__(self, jitted: Callable, mode: str = "auto", *, devices: int = 1, one_draw: Callable | None = None,
                 one_device: Callable | None = None, shardings: Any = None):
        """`one_draw`: the same init with every normal parameter sliced from one draw (model/normal_init.py), jitted
        like `jitted`; the Philox program on the CPU runs it (one random call site to compile instead of one a
        parameter kind). `one_device` and `shardings`: that init jitted onto one local device, and the layout of
        `jitted`'s outputs; a CPU mesh of several devices draws there and lays the state out (the module doc)."""
        if mode not in MODES:
            raise ValueError(f"InitProgram mode: must be one of {MODES}, got {mode!r}")
        self.jitted = jitted
        self.one_draw = one_draw
        self.one_device, self.shardings = one_device, shardings
        self.mode = mode
        self.last_choice: dict[str, Any] = {}
        # Philox does not lower on outputs sharded over several CPU devices (see _cpu_compile): a program over a
        # mesh of `devices` > 1 keeps threefry from the start (no failed compile, no XLA error printed).
        self._philox_unlowerable = devices > 1
        self._compiled: dict[Any, Any] = {}  # key dtype (threefry / philox / rbg) -> compiled program
        self._choices: dict[Any, dict[str, Any]] = {}  # key dtype -> its last_choice
        self._threefry_why = "not a GPU"  # why a CPU program under "auto" draws from threefry

    @property
    def _gpu(self) -> bool:
        return jax.default_backend() == "gpu" and _threefry_kernel_state is not None

    def _cheap_rng(self, key) -> bool:
        return (self.mode == "auto" and jax.default_backend() == "cpu" and not self._philox_unlowerable
                and not isinstance(key, jax.core.Tracer) and _is_threefry(key) and _has_impl(CPU_RNG))

    def program_key(self, key):
        """The key the init program draws from (see the class docstring)."""
        return cpu_key(key) if self._cheap_rng(key) else key

    def _program(self, program_key) -> Callable:
        """The jitted init that `program_key` runs: the one-draw init for the CPU's Philox key, where given."""
        if self.one_draw is not None and not isinstance(program_key, jax.core.Tracer) \
                and str(jax.random.key_impl(program_key)) == CPU_RNG:
            return self.one_draw
        return self.jitted

    def lower(self, key, *, kernel: bool | None = None):
        use = self.mode != "off" and self._gpu if kernel is None else kernel
        program_key = self.program_key(key)
        with _threefry_kernel(use):
            lowered = self._program(program_key).lower(program_key)
        if program_key is not key and not _lowers(lowered):  # see _cpu_compile
            self._philox_unlowerable = True
            with _threefry_kernel(use):
                lowered = self.jitted.lower(key)
        return lowered

    def compile(self, key):
        """Compile once per key kind (cached): on the GPU with the kernel lowering where it fits, else the default;
        on the CPU with CPU_COMPILER_OPTIONS."""
        program_key = self.program_key(key)
        if program_key.dtype not in self._compiled:
            compiled = self._compile(program_key)
            if compiled is None:  # Philox does not lower here: program_key(key) is now the threefry key
                return self.compile(key)
            self._compiled[program_key.dtype] = compiled
            self._choices[program_key.dtype] = self.last_choice
        self.last_choice = self._choices[program_key.dtype]
        return self._compiled[program_key.dtype]

    def _compile(self, key):
        rng = str(jax.random.key_impl(key))
        if not self._gpu:
            return self._cpu_compile(key)
        if self.mode == "off":
            return self._default(key, "mode off")
        start = time.perf_counter()
        try:
            with _threefry_kernel(True):
                compiled = self.jitted.lower(key).compile()
        except Exception as error:  # noqa: BLE001 — e.g. a jaxlib without the kernel: the default lowering
            if self.mode == "on":
                raise
            return self._default(key, f"kernel lowering failed: {type(error).__name__}: {error}")
        need, limit = _program_bytes(compiled), _device_bytes_limit()
        if self.mode == "auto" and need is not None and limit is not None and need > FIT_FRACTION * limit:
            return self._default(key, f"kernel lowering needs {need} bytes > {FIT_FRACTION} x {limit}")
        self.last_choice = {"rng": rng, "lowering": "kernel", "program_bytes": need, "device_bytes_limit": limit,
                            "kernel_compile_s": round(time.perf_counter() - start, 2)}
        return compiled

    def _cpu_compile(self, key):
        """The init on the CPU (or a GPU-less jaxlib), with CPU_COMPILER_OPTIONS where the backend is the CPU.
        XLA:CPU cannot lower Philox's mulhi on an output sharded over several devices (jax 0.10.2: "failed to
        legalize mhlo.unknown"): None then, and program_key draws from threefry from now on (last_choice says why)."""
        lowered = self._program(key).lower(key)
        try:
            compiled = compile_on_cpu(lowered) if jax.default_backend() == "cpu" else lowered.compile()
        except jax.errors.JaxRuntimeError as error:
            if str(jax.random.key_impl(key)) != CPU_RNG or not _unlowerable(error):
                raise
            self._philox_unlowerable = True
            self._threefry_why = f"not a GPU; {CPU_RNG} does not lower on this sharding"
            return None
        why = self._threefry_why if _is_threefry(key) and self.mode == "auto" else "not a GPU"
        self.last_choice = {"rng": str(jax.random.key_impl(key)), "lowering": "default", "why": why}
        if self._program(key) is self.one_draw:
            self.last_choice["normal_draws"] = "one"
        return compiled

    def _default(self, key, why: str):
        self.last_choice = {"rng": str(jax.random.key_impl(key)), "lowering": "default", "why": why}
        return self.jitted.lower(key).compile()

    def _laid_out_from_one_device(self, key) -> bool:
        return (self.mode == "auto" and self.one_device is not None and self.shardings is not None
                and jax.default_backend() == "cpu" and not isinstance(key, jax.core.Tracer) and _is_threefry(key)
                and _has_impl(CPU_RNG))

    def _one_device_init(self, key):
        """The state drawn on one device with the CPU's Philox program, then each leaf laid out as `shardings` say."""
        program_key = cpu_key(key)
        if "one_device" not in self._compiled:
            self._compiled["one_device"] = compile_on_cpu(self.one_device.lower(program_key))
        state = self._compiled["one_device"](program_key)
        self.last_choice = {"rng": CPU_RNG, "lowering": "default", "normal_draws": "one",
                            "why": "not a GPU; drawn on one device, then laid out on the mesh"}
        return jax.tree.map(_laid_out, state, self.shardings)

    def __call__(self, key):
        if isinstance(key, jax.core.Tracer):  # traced (eval_shape, an outer jit): the plain jitted init
            return self.jitted(key)
        if self._laid_out_from_one_device(key):
            return self._one_device_init(key)
        return self.compile(key)(self.program_key(key))


def _laid_out(array, sharding):
    """`array` (whole, on one CPU device) as a global array with `sharding`: each addressable shard from a host copy
    (jax.device_put between these layouts compiled a program per leaf: 16 s for tiny's 152 leaves)."""
    host = np.asarray(array)  # the CPU device's memory is the host's
    return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])
