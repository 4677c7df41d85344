"""The permute exchange's whole expert block as one custom VJP (what the model always runs on those paths):
permute -> gate/up grouped GEMM -> SwiGLU -> down grouped GEMM -> unpermute.

Why: differentiated piece by piece, the block keeps two (T*k, D) tensors for its backward pass: the permuted rows
(the gate/up weight gradient reads them) and the down GEMM's output y (unpermute's backward reads it for the
combine weights' gradient). Inside a layer scan XLA copies each into the scan's residual stacks and the backward
reads y once more. Here neither is kept:
  - the permuted rows are copied again from the block's input tokens (`ops.permute_rows`: the permute's copy step);
  - with y = act @ W, out = sum_j w_j y_j and g = dL/dout, the combine weights' gradient comes from the down GEMM's
    data gradient run on the *unweighted* rows of g:  G = g @ W^T,  d_w = <act, G>,  d_act = w * G,
    dW = (w * act)^T @ g  -- the same sums as <y, g>, (w g) @ W^T and act^T (w g), without y.
What the backward reads from the forward: h (gate/up output), the routing's row index and group sizes (named for
the remat policies, as `experts.expert_ffn` names them), the tokens and the combine weights; act = SwiGLU(h) is
computed again where the backward needs it (an elementwise pass over h instead of a saved copy).

The grouped GEMM is any differentiable `GroupedGemm` (the turbo FFI kernel, the Pallas one); the permute and
unpermute are the turbo_moe.ops FFI calls. With `swiglu_kernels` (`gemms.SWIGLU_KERNELS`, for the turbo GEMM) the
forward gets h and act from one call (`ops.grouped_gemm_swiglu`): h's only reader is then the layer scan's residual
stack, which XLA writes in place (with SwiGLU as an XLA fusion reading h too, it copied h there: 201 MB a layer at
`reduced`), and the backward computes d_h, the combine weights' gradient and w * act, the down weight gradient's lhs,
in one pass over h and g W^T (`ops.swiglu_combine_grad`; the down GEMM's data gradient runs first, its weight
gradient after). act * w is then the forward kernel's act times w; on the XLA path it is act computed again by XLA.
Rounding: d_act is (g @ W^T) rounded, then times w (the pieces: (w g) rounded, then @ W^T); d_w sums act * G in
float32 (the pieces: y * g). Both bf16-close, not bit-equal.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from turbo_moe.model.experts import EXPERT_SAVE_NAMES, ExpertWeights, GroupedGemm, saved, swiglu_fused
from turbo_moe.ops import _checks
from turbo_moe.ops._ffi import match_varying
from turbo_moe.ops.permute import ROW_INDEX_NAME, _permute_call, permute_rows_call
from turbo_moe.ops.swiglu_combine_grad import swiglu_combine_grad
from turbo_moe.ops.unpermute import unpermute_call


def expert_block(tokens: jax.Array, expert_ids: jax.Array, combine_w: jax.Array, weights: ExpertWeights,
                 n_experts: int, gemm: GroupedGemm, swiglu_kernels=None) -> tuple[jax.Array, jax.Array]:
    """tokens (T, D), expert_ids (T, k) (ids outside [0, E) drop the copy), combine_w (T, k) float32 ->
    (y (T, D) = sum_j combine_w[t, j] * expert_{ids[t, j]}(tokens[t]), group_sizes (E,) int32).

    swiglu_kernels: None, or the GEMM's `gemms.SwigluKernels` (gate/up + SwiGLU in one call, the down GEMM's data
    and weight gradients as separate calls)."""
    _checks.check_rank("tokens", tokens, 2, "(T, D)")
    _checks.float_dtype("tokens", tokens.dtype)
    _checks.check_rank("expert_ids", expert_ids, 2, "(T, k)")
    _checks.check_integer("expert_ids", expert_ids)
    if expert_ids.shape[0] != tokens.shape[0] or combine_w.shape != expert_ids.shape:
        raise ValueError(f"expert_ids and combine_w must be (T, k) with T = {tokens.shape[0]} like tokens (T, D), "
                         f"got {expert_ids.shape} and {combine_w.shape}")
    n_experts = _checks.static_int("n_experts", n_experts)
    ids = _checks.index_as_int32(expert_ids, n_experts)
    return _block(tokens, ids, combine_w.astype(jnp.float32), weights.w_gate_up, weights.w_down, n_experts, gemm,
                  swiglu_kernels)


def _gemm_and_zero_tail(gemm, swiglu_kernels):
    """(the block's GEMM, whether its permutes write zeros past the groups). With the SwiGLU kernels every buffer of
    T*k rows leaves its rows past the groups unwritten (only group rows are read: the GEMMs go by group sizes,
    unpermute by the row index; `gemms.SWIGLU_KERNELS`)."""
    if swiglu_kernels is None:
        return gemm, True
    return swiglu_kernels.gemm, False


def _forward(tokens, expert_ids, combine_w, w_gate_up, w_down, n_experts, gemm, swiglu_kernels):
    gemm, zero_tail = _gemm_and_zero_tail(gemm, swiglu_kernels)
    with jax.named_scope("permute"):
        rows, group_sizes, row_index = _permute_call(tokens, expert_ids, n_experts, zero_tail)[:3]
    group_sizes = saved(group_sizes, EXPERT_SAVE_NAMES[3])
    if swiglu_kernels is not None:
        with jax.named_scope("grouped_gemm"):
            h, act = swiglu_kernels.gate_up_swiglu(rows, w_gate_up, group_sizes)  # (T*k, 2F), (T*k, F)
        # Named without `saved`'s barrier: h's one reader is its write into the scan's residual stack, which XLA's
        # dynamic-slice fusion then does in place, from inside the FFI call (no clone: act is the call's own output).
        h = checkpoint_name(h, EXPERT_SAVE_NAMES[1])
    else:
        with jax.named_scope("grouped_gemm"):
            h = saved(gemm(rows, w_gate_up, group_sizes), EXPERT_SAVE_NAMES[1])  # (T*k, 2F)
        with jax.named_scope("swiglu"):
            act = swiglu_fused(h)  # (T*k, F)
    with jax.named_scope("grouped_gemm"):
        y_rows = gemm(act, w_down, group_sizes)  # (T*k, D): not kept for the backward
    with jax.named_scope("unpermute"):
        y = unpermute_call(y_rows, row_index, combine_w)
    return y, group_sizes, (h, saved(row_index, ROW_INDEX_NAME))


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6, 7))
def _block(tokens, expert_ids, combine_w, w_gate_up, w_down, n_experts, gemm, swiglu_kernels):
    y, group_sizes, _ = _forward(tokens, expert_ids, combine_w, w_gate_up, w_down, n_experts, gemm, swiglu_kernels)
    return y, group_sizes


def _block_fwd(tokens, expert_ids, combine_w, w_gate_up, w_down, n_experts, gemm, swiglu_kernels):
    y, group_sizes, (h, row_index) = _forward(tokens, expert_ids, combine_w, w_gate_up, w_down, n_experts, gemm,
                                              swiglu_kernels)
    return (y, group_sizes), (tokens, combine_w, w_gate_up, w_down, group_sizes, h, row_index)


def _block_bwd(n_experts, gemm, swiglu_kernels, residuals, cotangents):
    tokens, combine_w, w_gate_up, w_down, group_sizes, h, row_index = residuals
    d_y = cotangents[0]  # (T, D); group_sizes are integers
    gemm, zero_tail = _gemm_and_zero_tail(gemm, swiglu_kernels)
    with jax.named_scope("unpermute"):
        g_rows = permute_rows_call(d_y.astype(h.dtype), row_index, group_sizes, zero_tail)  # unweighted rows of g
        # each row's combine weight (0 for rows no copy fills): one XLA scatter of T*k scalars (~2 us a layer; the
        # row-copy kernel spends a warp per 4-byte row)
        n = row_index.size
        rows_of_copies = jnp.where(row_index >= 0, row_index, n).reshape(-1)  # dropped copies -> out of range
        w_rows = jnp.zeros((n,), jnp.float32).at[rows_of_copies].set(combine_w.reshape(-1), mode="drop")[:, None]
    if swiglu_kernels is not None:  # swiglu_impl="kernel": one pass over h and g_act gives d_h, d_w and w * act
        with jax.named_scope("grouped_gemm"):
            g_act = swiglu_kernels.data_grad(g_rows, w_down, group_sizes)  # g @ W^T
        with jax.named_scope("swiglu"):
            # only the group rows: a worst-case EP buffer is mostly tail (d_w_rows is read by row index, d_h and
            # act_w by the GEMMs, by group)
            valid = None if zero_tail else jnp.sum(group_sizes).astype(jnp.int32)
            d_h, d_w_rows, act_w = swiglu_combine_grad(h, g_act, w_rows[:, 0], valid)
        with jax.named_scope("grouped_gemm"):
            d_w_down = swiglu_kernels.weight_grad(act_w, g_rows, group_sizes).astype(w_down.dtype)  # (w act)^T @ g
    else:
        act = swiglu_fused(h)  # not saved: XLA fuses it into the passes below that read it
        with jax.named_scope("unpermute"):
            act_w = (act.astype(jnp.float32) * w_rows).astype(act.dtype)
        with jax.named_scope("grouped_gemm"):
            _, down_vjp = jax.vjp(lambda a, w: gemm(a, w, group_sizes), act_w, w_down)
            g_act, d_w_down = down_vjp(g_rows)  # g @ W^T (it does not depend on act_w) and (w act)^T @ g
        with jax.named_scope("unpermute"):
            d_w_rows = jnp.sum(act.astype(jnp.float32) * g_act.astype(jnp.float32), axis=-1)  # <y, g> per row
        with jax.named_scope("swiglu"):
            d_act = (g_act.astype(jnp.float32) * w_rows).astype(act.dtype)
            _, swiglu_vjp = jax.vjp(swiglu_fused, h)
            (d_h,) = swiglu_vjp(d_act)
    with jax.named_scope("unpermute"):
        d_combine = jnp.where(row_index >= 0, d_w_rows[jnp.maximum(row_index, 0)], 0.0)
    with jax.named_scope("permute"):
        rows = permute_rows_call(tokens, row_index, group_sizes, zero_tail)  # the forward's permuted rows
    with jax.named_scope("grouped_gemm"):
        _, up_vjp = jax.vjp(lambda r, w: gemm(r, w, group_sizes), rows, w_gate_up)
        d_rows, d_w_gate_up = up_vjp(d_h)
    with jax.named_scope("permute"):
        d_tokens = unpermute_call(d_rows, row_index, jnp.ones(row_index.shape, jnp.float32))
    return (match_varying(d_tokens, tokens), None, match_varying(d_combine, combine_w),
            match_varying(d_w_gate_up, w_gate_up), match_varying(d_w_down, w_down))


_block.defvjp(_block_fwd, _block_bwd)
