"""Deterministic training on the GPU (`TrainConfig.deterministic`): the same config twice gives the same bits.

Our CUDA kernels already repeat bit for bit (no float atomics, no split-K: docs/notes/determinism.md has the per-op
table). What does not, in a GPU step, is XLA's and cuDNN's: cuDNN's flash-attention backward accumulates dQ with
atomics, XLA's float scatter-adds use atomics, and GEMM autotuning picks kernels by timing, so two processes can
compile different programs. XLA's `xla_gpu_deterministic_ops` switches all three (the deterministic cuDNN backward,
sort-based scatters, the first valid GEMM config instead of the fastest).

How it is applied: as a per-program compiler option (`jax.jit(..., compiler_options=...)`), read when each program
compiles; no XLA_FLAGS, so it needs no backend restart and is recorded with the config. A run without the field but
with the flag in XLA_FLAGS is refused (`check_xla_flags`): the environment must not change the program.

The XLA bug it works around: with determinism required, XLA's cuDNN custom-call compiler writes `force_deterministic`
into an fMHA backward call's config after fingerprinting it, so a second call identical to the first (any model with
two attention layers of one shape) hits the cache unmarked, and the runtime looks its graph up under a fingerprint
that was never stored: `IndexError: absl::container_internal::raw_hash_map<>::at` at the first step
(docs/notes/determinism.md has the reproduction). `mark_attention_deterministic` writes the flag into every fMHA
backward call of the lowered module before XLA sees it, so every fingerprint already holds it.
"""
from __future__ import annotations

import hashlib
import json
import os
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

# What `TrainConfig.deterministic` compiles every program of a GPU run with.
GPU_OPTIONS = {"xla_gpu_deterministic_ops": True}
# XLA flags that require determinism module-wide: set through XLA_FLAGS they would change the program unrecorded
# (and crash on the bug above), so a run refuses them there.
_DETERMINISM_FLAGS = ("xla_gpu_deterministic_ops", "xla_gpu_exclude_nondeterministic_ops")
_FMHA_BACKWARD = "__cudnn$fmha"  # call targets "__cudnn$fmha...Backward" (jax._src.cudnn.fused_attention_stablehlo)


def compiler_options(deterministic: bool, platform: str) -> dict[str, Any]:
    """The XLA options a program compiles with for `TrainConfig.deterministic` on `platform`: GPU_OPTIONS on the
    GPU, none elsewhere (XLA:CPU repeats its results without them)."""
    return dict(GPU_OPTIONS) if deterministic and platform == "gpu" else {}


def check_xla_flags(deterministic: bool, flags: str | None = None) -> None:
    """Refuses XLA_FLAGS that require determinism: the config field is the one switch, recorded with the run."""
    flags = os.environ.get("XLA_FLAGS", "") if flags is None else flags
    named = [flag for flag in _DETERMINISM_FLAGS if flag in flags]
    if named:
        raise ValueError(f"XLA_FLAGS sets {', '.join(named)}: set TrainConfig.deterministic={deterministic!r} -> "
                         f"True instead and remove the flag (the field applies it per program, records it, and "
                         f"avoids XLA's crash on models with several attention layers)")


def mark_attention_deterministic(module) -> int:
    """Sets `force_deterministic` in the cuDNN config of every fMHA backward custom call of a lowered StableHLO
    `module` (an `ir.Module`, changed in place). Returns how many calls it marked."""
    from jax._src.interpreters import mlir

    calls = []

    def visit(op):
        if op.name == "stablehlo.custom_call":
            target = op.attributes["call_target_name"].value
            if target.startswith(_FMHA_BACKWARD) and "Backward" in target:
                calls.append(op)
        return mlir.ir.WalkResult.ADVANCE

    module.operation.walk(visit)
    with module.context:
        for op in calls:
            config = json.loads(op.attributes["backend_config"].value)
            config.setdefault("cudnn_fmha_backend_config", {})["force_deterministic"] = True
            op.attributes["backend_config"] = mlir.ir.StringAttr.get(json.dumps(config))
    return len(calls)


class DeterministicAttention:
    """A jitted program whose lowering has every cuDNN attention backward marked deterministic
    (`mark_attention_deterministic`): `.lower(...)` returns the marked lowering; a call compiles once (for the
    first call's argument types) and runs that executable from then on."""

    def __init__(self, program: Callable):
        self.program = program
        self._compiled = None

    def lower(self, *args: Any, **kwargs: Any):
        lowered = self.program.lower(*args, **kwargs)
        mark_attention_deterministic(lowered.compiler_ir("stablehlo"))
        return lowered

    def __call__(self, *args: Any):
        if self._compiled is None:
            self._compiled = self.lower(*args).compile()
        return self._compiled(*args)


def _hash32(x):
    """uint32 mixing (murmur3's finaliser)."""
    x = x ^ (x >> 16)
    x = x * jnp.uint32(0x85EBCA6B)
    x = x ^ (x >> 13)
    x = x * jnp.uint32(0xC2B2AE35)
    return x ^ (x >> 16)


def _words(x):
    """x's bits as uint32 words (any dtype of 1, 2, 4 or 8 bytes; typed keys through their data)."""
    if jnp.issubdtype(x.dtype, jax.dtypes.prng_key):
        x = jax.random.key_data(x)
    if x.dtype == jnp.bool_:
        return x.astype(jnp.uint32)
    size = x.dtype.itemsize
    if size == 8:
        return jax.lax.bitcast_convert_type(x, jnp.uint32)  # (..., 2)
    return jax.lax.bitcast_convert_type(x, {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32}[size]).astype(jnp.uint32)


@jax.jit
def _leaf_sums(leaves):
    # Each element's bits mixed with its position, summed modulo 2**32: integer sums, so the same value whatever
    # order or sharding the reduction runs in, and cheap (one pass over the state on its devices).
    sums = []
    for i, leaf in enumerate(leaves):
        words = _words(leaf).reshape(-1)
        index = jnp.arange(words.size, dtype=jnp.uint32) * jnp.uint32(0x9E3779B1) + jnp.uint32(i + 1)
        sums.append(jnp.sum(_hash32(words ^ _hash32(index)), dtype=jnp.uint32))
    return jnp.stack(sums) if sums else jnp.zeros((0,), jnp.uint32)


def state_digest(tree) -> str:
    """A short hex digest of every array in `tree` (a train state: parameters, optimizer moments, ...), bit-exact:
    two states digest alike only if (barring a 2**-64 collision) every bit of every leaf is equal. Computed on the
    state's devices; only the per-leaf sums come to the host."""
    leaves = [leaf for leaf in jax.tree.leaves(tree) if leaf is not None]
    shapes = ";".join(f"{leaf.dtype}{tuple(leaf.shape)}" for leaf in leaves)
    sums = np.asarray(_leaf_sums(leaves))
    return hashlib.sha256(shapes.encode() + sums.tobytes()).hexdigest()[:16]
