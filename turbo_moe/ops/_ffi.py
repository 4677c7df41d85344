"""Loads the FFI handler libraries with ctypes and registers their targets with XLA, once, lazily.

The libraries are plain shared objects (no Python ABI) built from `kernels/` by the package build,
so the same build works under any Python version. The CPU library is required; the CUDA library
is registered for platform "CUDA" when it was built (nvcc present) and a CUDA backend exists.
"""
from __future__ import annotations

import ctypes
import functools
import os
import warnings
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp

from turbo_moe.ops.varying import make_varying, match_varying, varying_axes  # noqa: F401  (the ops use them)

# One name per handler, spelled the same in kernels/cpu/*.cc, kernels/cuda/*.cu and here.
TARGETS = (
    "turbo_moe_grouped_gemm",
    "turbo_moe_grouped_gemm_weight_grad",
    "turbo_moe_grouped_gemm_swiglu",
    "turbo_moe_swiglu_combine_grad",
    "turbo_moe_swiglu_combine_grad_fp8",
    "turbo_moe_swiglu_quantize",
    "turbo_moe_permute",
    "turbo_moe_permute_rows",
    "turbo_moe_permute_fp8",
    "turbo_moe_permute_rows_fp8",
    "turbo_moe_quantize_group_columns",
    "turbo_moe_quantize_rows",
    "turbo_moe_unpermute",
    "turbo_moe_unpermute_bwd",
    "turbo_moe_dispatch_pack",
    "turbo_moe_router_topk",
    "turbo_moe_segment_sum",
)
# Hopper-only handlers: the CUDA library has them (when built with CUTLASS); the CPU runs these ops in jnp.
CUDA_ONLY_TARGETS = ("turbo_moe_grouped_gemm_fp8", "turbo_moe_grouped_gemm_fp8_weight_grad")
# CPU-only handlers: the fused EP dispatch's CPU reference (its GPU transport is planned: docs/notes/ep-transport.md).
CPU_ONLY_TARGETS = ("turbo_moe_fused_dispatch_pack", "turbo_moe_fused_dispatch_land")
CPU_LIBRARY = "libturbo_moe_cpu.so"
CUDA_LIBRARY = "libturbo_moe_cuda.so"


def library_dirs() -> list[Path]:
    """Where the built libraries may live, in search order."""
    dirs = []
    if os.environ.get("TURBO_MOE_LIB_DIR"):
        dirs.append(Path(os.environ["TURBO_MOE_LIB_DIR"]))
    import turbo_moe

    for root in turbo_moe.__path__:  # the installed package, or the source tree (editable)
        dirs.append(Path(root) / "_lib")
    return dirs


def find_library(name: str) -> Path | None:
    for d in library_dirs():
        if (d / name).is_file():
            return d / name
    return None


def _register(path: Path, platform: str, required: bool) -> list[str]:
    """Registers the targets `path` exports; a required library must export all of them."""
    lib = ctypes.CDLL(str(path))
    missing = []
    for target in TARGETS + (CUDA_ONLY_TARGETS if platform == "CUDA" else CPU_ONLY_TARGETS):
        symbol = getattr(lib, target, None)
        if symbol is None:
            missing.append(target)
            continue
        jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(symbol), platform=platform)
    if missing and required:
        raise RuntimeError(f"{path} does not export the FFI handlers {missing}; rebuild turbo_moe")
    if missing:
        warnings.warn(f"{path} lacks {missing}: those ops have no {platform} kernel", RuntimeWarning)
    return missing


def _cuda_backend_present() -> bool:
    try:
        return bool(jax.devices("cuda"))
    except Exception:  # no CUDA plugin, or it failed to initialise: CPU only
        return False


@functools.lru_cache(maxsize=None)
def ensure_registered() -> dict[str, str]:
    """Registers every target once; returns {platform: library path} of what was registered."""
    cpu = find_library(CPU_LIBRARY)
    if cpu is None:
        searched = ", ".join(str(d) for d in library_dirs())
        raise RuntimeError(
            f"turbo_moe's CPU kernel library {CPU_LIBRARY} was not found (searched: {searched}). "
            "Build it with `pip install .` (or `pip install -e .`) from the repository root, "
            "or point TURBO_MOE_LIB_DIR at the folder that holds it."
        )
    _register(cpu, "cpu", required=True)
    registered = {"cpu": str(cpu)}
    cuda = find_library(CUDA_LIBRARY)
    if cuda is not None and _cuda_backend_present():
        _register(cuda, "CUDA", required=False)
        registered["CUDA"] = str(cuda)
        _warn_if_hopper_without_sm90(cuda)
    return registered


def _cuda_has_sm90(path: Path) -> bool | None:
    """Whether the CUDA library holds the Hopper (CUTLASS) grouped GEMM; None for builds without the probe."""
    probe = getattr(ctypes.CDLL(str(path)), "turbo_moe_grouped_gemm_has_sm90", None)
    return None if probe is None else bool(probe())


def _warn_if_hopper_without_sm90(path: Path) -> None:
    """On a Hopper GPU (compute capability 9.x), a library without the sm90 kernel silently runs the
    portable SIMT grouped GEMM (no tensor cores): say so once, at first use."""
    hopper = [d for d in jax.devices("cuda") if str(getattr(d, "compute_capability", "")).startswith("9")]
    if hopper and _cuda_has_sm90(path) is False:
        warnings.warn(
            f"{path} was built without the Hopper (sm90, CUTLASS) grouped GEMM, so grouped_gemm runs the slow "
            f"portable kernel on this {hopper[0].device_kind}. Rebuild with the CUTLASS headers "
            "(`pip install --no-deps nvidia-cutlass` then reinstall turbo_moe, or set "
            "-C cmake.define.TURBO_MOE_CUTLASS_INCLUDE=<cutlass>/include).", RuntimeWarning, stacklevel=3)


def kernel_info() -> dict[str, str | None]:
    """Which kernels this process uses: ``cpu`` and ``cuda`` (library paths, None when not registered) and
    ``grouped_gemm`` on the first device: "cpu", "cuda_sm90" (Hopper CUTLASS + portable kernels),
    "cuda_portable" (no Hopper kernel in this build) or "cuda_unknown" (a library older than the probe)."""
    registered = ensure_registered()
    cuda = registered.get("CUDA")
    info = {"cpu": registered["cpu"], "cuda": cuda, "grouped_gemm": "cpu"}
    if cuda is not None and jax.devices()[0].platform == "gpu":
        has = _cuda_has_sm90(Path(cuda))
        info["grouped_gemm"] = {True: "cuda_sm90", False: "cuda_portable", None: "cuda_unknown"}[has]
    return info


@functools.lru_cache(maxsize=None)
def _cuda_workspace_counter(name: str):
    """The CUDA library's ``int64 name(int64...)`` that sizes a handler's workspace; None without a CUDA library."""
    cuda = ensure_registered().get("CUDA")
    if cuda is None:
        return None
    fn = getattr(ctypes.CDLL(cuda), name, None)
    if fn is None:
        raise RuntimeError(f"{cuda} does not export {name}: it predates the workspace results; rebuild turbo_moe")
    fn.restype = ctypes.c_int64
    return fn


def workspace(counter: str, *sizes: int, batch: tuple[int, ...] = ()) -> jax.ShapeDtypeStruct:
    """The uint8 workspace result of a CUDA handler (empty where no CUDA library is registered: the CPU
    handlers take the same result and ignore it). A result, not XLA scratch, so that the handler can sit in
    XLA's command buffers. `sizes` describe one problem; leading `batch` dims (and vmap's) multiply it, which
    covers a batched call's need (the counts are linear in the problems, rounded up per problem)."""
    fn = _cuda_workspace_counter(counter)
    n = 0 if fn is None else int(fn(*(ctypes.c_int64(v) for v in sizes)))
    return jax.ShapeDtypeStruct(tuple(batch) + (n,), jnp.uint8)


def ffi_call(target: str, result_shape_dtypes: Any, *args: Any, **attrs: Any) -> Any:
    """Calls a registered target; vmap broadcasts every operand to the batch (kernels take leading dims).

    Inside shard_map, XLA FFI calls need operands of one varying-axes type: operands and results are
    all typed as varying over the union of the operands' axes (the kernels are per-shard anyway).
    Every call here sits inside a custom_vjp, so these casts are never transposed by autodiff.
    """
    ensure_registered()
    axes = frozenset().union(*(varying_axes(a) for a in args))
    args = tuple(make_varying(a, axes) for a in args)
    out = jax.ffi.ffi_call(target, result_shape_dtypes, vmap_method="broadcast_all")(*args, **attrs)
    return jax.tree.map(lambda o: make_varying(o, axes), out) if axes else out
