"""MaxText's MoE layer with its expert GEMMs on `turbo_moe.ops.grouped_gemm`.

    import turbo_moe.integrations.maxtext as turbo_maxtext
    turbo_maxtext.enable()            # every MaxText RoutedMoE traced from now on; or, scoped:
    with turbo_maxtext.grouped_gemm(): ...

MaxText's `RoutedMoE.sparse_matmul` (maxtext.layers.moe, dropless) multiplies the sorted tokens by each expert's
weights (wi_0, wi_1, wo) through one of three calls, chosen by its config: `jax.lax.ragged_dot` (megablox=False,
which MaxText's GPU configs set), megablox's `gmm` (megablox=True; a TPU Pallas kernel that runs *interpreted*
off TPU) or `tokamax.ragged_dot` (use_tokamax_gmm=True). While enabled, all three names resolve, inside
`maxtext.layers.moe` only, to `turbo_moe.ops.grouped_gemm` (same arguments, `group_offset` included), so no MaxText
config key changes and nothing else in the process sees a different `jax.lax`. grouped_gemm is a JAX primitive with
transpose rules: the data and weight gradients run the turbo kernels too.

A call turbo cannot compute exactly as asked goes to MaxText's own kernel, unchanged: quantized operands (AQT
QTensor, qwix QArray, megablox's quantize dtypes or qwix rule), megablox's fused FSDP weight gather
(`weight_gather_axes`), an `existing_out`, tokamax's fused activations. `stats()` counts both kinds of call.

The switch acts when JAX traces the layer: a function jitted before `enable()` keeps the kernel it was compiled with.

Expert parallelism: inside MaxText's shard_map the GEMMs run on turbo as above. Its `ragged_all_to_all` exchange is
NOT replaced by turbo's moe_dispatch/moe_combine: MaxText exchanges rows it has already sorted by global expert, with
offsets it computes in nested closures of `sparse_matmul` (`ra2a_and_route`, `unsort_output_and_ra2a`), while
moe_dispatch takes the unsorted tokens with their top-k ids and weights and moe_combine also applies the weights and
sums the k copies. The two meet only if the whole routed body (permute -> exchange -> local permute -> GEMMs ->
unsort -> exchange -> unpermute) is replaced, i.e. a second implementation of `sparse_matmul`'s shard_map body.
"""
from __future__ import annotations

import collections
import contextlib
import importlib
import types

import jax
import jax.numpy as jnp

from turbo_moe.ops.grouped_gemm import grouped_gemm as _turbo_grouped_gemm
from turbo_moe.ops.grouped_gemm import kernel_dtypes

MOE_MODULE = "maxtext.layers.moe"
# The module-level names in maxtext.layers.moe that reach a grouped GEMM, and the attribute under each.
_PATCHED_NAMES = ("jax", "mblx", "tokamax")

_saved: dict[str, object] = {}  # name -> the module object maxtext.layers.moe held before enable()
_counts: collections.Counter = collections.Counter()


class _Overlay(types.ModuleType):
    """Module `base` with some attributes replaced (every other attribute read from `base` at access time)."""

    def __init__(self, base: types.ModuleType, **overrides):
        super().__init__(base.__name__, base.__doc__)
        self.__dict__["_overlay_base"] = base
        self.__dict__.update(overrides)

    def __getattr__(self, name):  # only for names not set in __init__
        return getattr(self.__dict__["_overlay_base"], name)


def _plain_float_arrays(*xs) -> bool:
    """Operands turbo's kernels compute exactly (float arrays; no quantized containers)."""
    if not all(isinstance(x, jax.Array) for x in xs):
        return False
    return kernel_dtypes(xs[0].dtype, xs[1].dtype, jnp.float32) is not None


def _run_turbo(kind: str, lhs, rhs, group_sizes, precision, preferred_element_type, group_offset, transpose_rhs=False):
    _counts[f"turbo:{kind}"] += 1
    if isinstance(group_offset, int) and group_offset == 0 and rhs.shape[0] == group_sizes.shape[0]:
        group_offset = None  # every group is local: no row rotation
    if group_offset is not None and not isinstance(group_offset, jax.Array):
        group_offset = jnp.asarray(group_offset, jnp.int32)
    return _turbo_grouped_gemm(lhs, rhs, jnp.asarray(group_sizes), precision, preferred_element_type, group_offset,
                               transpose_rhs=transpose_rhs)


def _make_ragged_dot(original):
    def ragged_dot(lhs, rhs, group_sizes, precision=None, preferred_element_type=None, group_offset=None, **kwargs):
        if kwargs or not _plain_float_arrays(lhs, rhs):
            _counts["fallback:ragged_dot"] += 1
            return original(lhs, rhs, group_sizes, precision=precision, preferred_element_type=preferred_element_type,
                            group_offset=group_offset, **kwargs)
        return _run_turbo("ragged_dot", lhs, rhs, group_sizes, precision, preferred_element_type, group_offset)
    return ragged_dot


# megablox gmm keywords that must be unset (None, False, empty) for turbo to compute the same thing.
_GMM_NEUTRAL = ("existing_out", "lhs_quantize_dtype", "rhs_quantize_dtype", "use_qwix_quantization",
                "weight_gather_axes", "qwix_rule", "use_manual_quantization")
_GMM_IGNORED = ("tiling", "interpret", "use_tokamax_backend", "lhs_vma_axes", "rhs_vma_axes", "use_gmm_v2",
                "use_gmm_v2_heuristic_tiling")  # kernel choice / tiling hints for megablox only


def _unset(value) -> bool:
    return value is None or value is False or (isinstance(value, (list, tuple)) and not value)


def _make_megablox_gmm(original):
    def gmm(lhs, rhs, group_sizes, preferred_element_type=jnp.float32, *args, **kwargs):
        neutral = all(_unset(kwargs.get(k)) for k in _GMM_NEUTRAL)
        known = set(kwargs) <= {*_GMM_NEUTRAL, *_GMM_IGNORED, "group_offset", "transpose_rhs", "partial_sum"}
        if args or not neutral or not known or not _plain_float_arrays(lhs, rhs):
            _counts["fallback:megablox_gmm"] += 1
            return original(lhs, rhs, group_sizes, preferred_element_type, *args, **kwargs)
        out = _run_turbo("megablox_gmm", lhs, rhs, group_sizes, None, preferred_element_type,
                         kwargs.get("group_offset"), transpose_rhs=bool(kwargs.get("transpose_rhs", False)))
        partial_sum = kwargs.get("partial_sum")
        return out if partial_sum is None else out + partial_sum.astype(out.dtype)
    return gmm


def _make_tokamax_ragged_dot(original):
    def ragged_dot(lhs, rhs, group_sizes, precision=None, preferred_element_type=None, group_offset=None,
                   activation=None, **kwargs):
        # MaxText wraps the sizes in tokamax.RaggedDotGroupSizes (a representative distribution for autotuning).
        sizes = getattr(group_sizes, "value", group_sizes)
        extra = {k: v for k, v in kwargs.items() if k not in ("implementation", "bypass_device_check")}
        if activation is not None or any(v not in (None, False) for v in extra.values()) \
                or not _plain_float_arrays(lhs, rhs):
            _counts["fallback:tokamax_ragged_dot"] += 1
            return original(lhs, rhs, group_sizes, precision, preferred_element_type, group_offset, activation,
                            **kwargs)
        return _run_turbo("tokamax_ragged_dot", lhs, rhs, sizes, precision, preferred_element_type, group_offset)
    return ragged_dot


def enable() -> None:
    """Route MaxText's MoE expert GEMMs through turbo_moe until `disable()`. Idempotent. Raises ImportError
    (naming the module) where maxtext is not installed."""
    if _saved:
        return
    moe = importlib.import_module(MOE_MODULE)
    missing = [n for n in _PATCHED_NAMES if not isinstance(getattr(moe, n, None), types.ModuleType)]
    if missing:
        raise RuntimeError(f"{MOE_MODULE} has no module-level {missing}: this maxtext version does not call its "
                           f"grouped GEMMs as turbo_moe.integrations.maxtext expects (written against maxtext 0.2.5)")
    originals = {n: getattr(moe, n) for n in _PATCHED_NAMES}
    jax_mod, mblx, tokamax = originals["jax"], originals["mblx"], originals["tokamax"]
    overlays = {
        "jax": _Overlay(jax_mod, lax=_Overlay(jax_mod.lax, ragged_dot=_make_ragged_dot(jax_mod.lax.ragged_dot))),
        "mblx": _Overlay(mblx, gmm=_make_megablox_gmm(mblx.gmm)),
        "tokamax": _Overlay(tokamax, ragged_dot=_make_tokamax_ragged_dot(tokamax.ragged_dot)),
    }
    _saved.update(originals)
    for name, overlay in overlays.items():
        setattr(moe, name, overlay)


def disable() -> None:
    """Give maxtext.layers.moe its own kernels back (functions traced from now on use them)."""
    if not _saved:
        return
    moe = importlib.import_module(MOE_MODULE)
    for name, original in _saved.items():
        setattr(moe, name, original)
    _saved.clear()


def is_enabled() -> bool:
    return bool(_saved)


@contextlib.contextmanager
def grouped_gemm():
    """`enable()` for the duration of the block (trace/jit the layer inside it); restores the previous state."""
    was_enabled = is_enabled()
    enable()
    try:
        yield
    finally:
        if not was_enabled:
            disable()


def stats() -> dict[str, int]:
    """Calls seen while tracing since the last `reset_stats()`: 'turbo:<entry>' ran on turbo, 'fallback:<entry>'
    went to MaxText's own kernel (entry: ragged_dot, megablox_gmm or tokamax_ragged_dot)."""
    return dict(_counts)


def reset_stats() -> None:
    _counts.clear()
