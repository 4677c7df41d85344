"""MaxText's MoE layer with its expert GEMMs on `turbo_moe.ops.grouped_gemm` and, under expert parallelism, its
exchange on `moe_dispatch` / `moe_combine`.

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

Expert parallelism (`ici_expert_parallelism > 1`): while enabled, `RoutedMoE.sparse_matmul` itself is replaced
too. Its whole routed body (MaxText's sort -> `ragged_all_to_all` -> local permute -> GEMMs -> unsort ->
`ragged_all_to_all` -> unpermute) runs on turbo (`turbo_moe.integrations.maxtext_ep`): MaxText's routing on its
logits (get_topk, its load-balance loss and bias update, with MaxText's own helpers), then turbo's `moe_dispatch` ->
each rank's experts (grouped GEMMs + SwiGLU) -> `moe_combine` in one shard_map over the `expert` axis; same
`(output, lb_loss, bias_updates)`. What that body cannot do exactly (tensor parallelism, quantization,
ring-of-experts, a ragged buffer factor or dropless fallback, expert biases, other activations, hash/random/forced
routing, a mesh that does not split the batch over the expert axis and every other axis of more than one device,
...) runs MaxText's own body with the GEMM swap above, counted as 'fallback_ep:<reason>' in `stats()`; the EP body
counts 'turbo_ep:sparse_matmul'.
"""
from __future__ import annotations

import collections
import contextlib
import importlib
import types

import jax
import jax.numpy as jnp

from turbo_moe.integrations import maxtext_ep
from turbo_moe.ops.grouped_gemm import grouped_gemm as _turbo_grouped_gemm
from turbo_moe.ops.grouped_gemm import kernel_dtypes

MOE_MODULE = "maxtext.layers.moe"
# The module-level names in maxtext.layers.moe that reach a grouped GEMM, and the attribute under each.
_PATCHED_NAMES = ("jax", "mblx", "tokamax")

_saved: dict[str, object] = {}  # name -> the module object maxtext.layers.moe held before enable()
_saved_method: dict[str, object] = {}  # "sparse_matmul" -> RoutedMoE's own method before enable()
_ep_options: dict[str, str] = {}  # enable()'s options for the EP body (maxtext_ep.sparse_matmul keywords)
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


def _make_sparse_matmul(original):
    """RoutedMoE.sparse_matmul: under expert parallelism the turbo EP body where it computes the same thing."""
    def sparse_matmul(self, inputs, gate_logits, pre_bias_logits, w0_kernel, w1_kernel, wo_kernel, w0_bias, w1_bias,
                      wo_bias, input_ids=None, forced_routed_experts=None):
        args = (inputs, gate_logits, pre_bias_logits, w0_kernel, w1_kernel, wo_kernel, w0_bias, w1_bias, wo_bias)
        if self.get_expert_parallelism_size() > 1:
            reason = maxtext_ep.unsupported(self, inputs, w0_kernel, w1_kernel, wo_kernel, w0_bias, w1_bias, wo_bias,
                                            input_ids, forced_routed_experts)
            if reason is None:
                _counts["turbo_ep:sparse_matmul"] += 1
                return maxtext_ep.sparse_matmul(self, inputs, gate_logits, pre_bias_logits, w0_kernel, w1_kernel,
                                                wo_kernel, **_ep_options)
            _counts[f"fallback_ep:{reason}"] += 1
        return original(self, *args, input_ids=input_ids, forced_routed_experts=forced_routed_experts)
    sparse_matmul.__wrapped__ = original
    return sparse_matmul


def _maxtext_moe() -> types.ModuleType:
    """maxtext.layers.moe, or an ImportError that says what to install."""
    try:
        return importlib.import_module(MOE_MODULE)
    except ImportError as error:
        raise ImportError(f"turbo_moe.integrations.maxtext needs MaxText, which is not installed ({error}): install "
                          f"it with `pip install maxtext==0.2.5` (Python >= 3.12; the version this integration is "
                          f"written against) in the environment that runs MaxText") from error


def enable(ep_weights: str = "fused") -> None:
    """Route MaxText's MoE expert GEMMs (and, under expert parallelism, its exchange) through turbo_moe until
    `disable()`. Idempotent for the same options (other options: a ValueError). Raises ImportError (naming the module) where
    maxtext is not installed. ep_weights: how the EP body takes MaxText's wi_0 / wi_1, "fused" (concatenated into
    turbo's (E, D, 2F) gate/up each step: turbo's expert block and fused SwiGLU) or "split" (three grouped GEMMs,
    no weight copy); see `turbo_moe.integrations.maxtext_ep`."""
    if ep_weights not in maxtext_ep.EP_WEIGHTS:
        raise ValueError(f"ep_weights: expected one of {maxtext_ep.EP_WEIGHTS}, got {ep_weights!r}")
    if _saved:
        if _ep_options.get("ep_weights") != ep_weights:
            raise ValueError(f"ep_weights: enable() is already on with ep_weights={_ep_options.get('ep_weights')!r}; "
                             f"call disable() before enabling it with {ep_weights!r}")
        return
    moe = _maxtext_moe()
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
    _ep_options["ep_weights"] = ep_weights
    _saved_method["sparse_matmul"] = moe.RoutedMoE.__dict__["sparse_matmul"]
    moe.RoutedMoE.sparse_matmul = _make_sparse_matmul(_saved_method["sparse_matmul"])


def disable() -> None:
    """Give maxtext.layers.moe its own kernels back (functions traced from now on use them)."""
    if not _saved:
        return
    moe = importlib.import_module(MOE_MODULE)
    for name, original in _saved.items():
        setattr(moe, name, original)
    _saved.clear()
    if "sparse_matmul" in _saved_method:
        moe.RoutedMoE.sparse_matmul = _saved_method.pop("sparse_matmul")
    _ep_options.clear()


def is_enabled() -> bool:
    return bool(_saved)


@contextlib.contextmanager
def grouped_gemm(ep_weights: str = "fused"):
    """`enable(ep_weights)` for the duration of the block (trace/jit the layer inside it); restores the previous
    state."""
    was_enabled = is_enabled()
    enable(ep_weights)
    try:
        yield
    finally:
        if not was_enabled:
            disable()


def stats() -> dict[str, int]:
    """Calls seen while tracing since the last `reset_stats()`: 'turbo:<entry>' ran on turbo, 'fallback:<entry>'
    went to MaxText's own kernel (entry: ragged_dot, megablox_gmm or tokamax_ragged_dot); under expert parallelism
    'turbo_ep:sparse_matmul' ran the turbo EP body, 'fallback_ep:<reason>' MaxText's own (its GEMMs on turbo)."""
    return dict(_counts)


def body_summary(counts: dict[str, int]) -> dict[str, str]:
    """A benchmark row's view of `stats()`: turbo_body "ep_exchange" (the EP body ran) or "gemms_only" (MaxText's body
    with turbo GEMMs: one device, or a config the EP body fell back from, its reason in turbo_stats)."""
    return dict(turbo_body="ep_exchange" if counts.get("turbo_ep:sparse_matmul") else "gemms_only",
                turbo_stats=";".join(f"{k}={v}" for k, v in sorted(counts.items())))


def reset_stats() -> None:
    _counts.clear()
