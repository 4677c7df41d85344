"""The routed experts' SwiGLU FFN for any GEMM set: `expert_ffn` on expert-sorted rows (autodiff) and `expert_block`,
permute -> the same FFN -> unpermute as one custom VJP.

    y, group_sizes = ops.expert_block(tokens, expert_ids, combine_w, w_gate_up, w_down, gemms="turbo")

Why the block: differentiated piece by piece, the FFN between a permute and an unpermute keeps two (T*k, D) tensors
for its backward pass: the permuted rows (the gate/up weight gradient reads them) and the down GEMM's output y
(unpermute's backward reads it for the combine weights' gradient). Inside a layer scan XLA copies each into the
scan's residual stacks and the backward reads y once more. Here neither is kept:
  - the permuted rows are copied again from the block's input tokens (`permute_rows`: the permute's copy step);
  - with y = act @ W, out = sum_j w_j y_j and g = dL/dout, the combine weights' gradient comes from the down GEMM's
    data gradient run on the *unweighted* rows of g:  G = g @ W^T,  d_w = <act, G>,  d_act = w * G,
    dW = (w * act)^T @ g  -- the same sums as <y, g>, (w g) @ W^T and act^T (w g), without y.
What the backward reads from the forward: h (gate/up output), the routing's row index and group sizes (named for
the remat policies, as `expert_ffn` names them), the tokens and the combine weights; act = SwiGLU(h) is computed
again where the backward needs it (an elementwise pass over h instead of a saved copy).

With a set that has the fused gate/up + SwiGLU (`GemmSet.gate_up_swiglu`), the forward gets h and act from one call:
h's only reader is then the layer scan's residual stack, which XLA writes in place (with SwiGLU as an XLA fusion
reading h too, XLA copied h there), and the backward computes d_h, the combine weights' gradient and w * act, the
down weight gradient's lhs, in one pass over h and g W^T (`swiglu_combine_grad`; the set's data gradient runs first,
its weight gradient after). Every buffer of T*k rows then leaves its rows past the groups unwritten: only group rows
are read (the GEMMs go by group sizes, unpermute by the row index), and under expert parallelism the buffers are the
dropless worst case, mostly tail. Rounding: d_act is (g @ W^T) rounded, then times w (the pieces: (w g) rounded,
then @ W^T); d_w sums act * G in float32 (the pieces: y * g). Both bf16-close to the pieces, not bit-equal.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from turbo_moe.ops import _checks
from turbo_moe.ops.fp8_scaling import Fp8Weights
from turbo_moe.ops.gemm_sets import GemmSet, gemm_set
from turbo_moe.ops.grouped_gemm_swiglu import swiglu_grad
from turbo_moe.ops.permute import ROW_INDEX_NAME, _permute_call, permute_rows_call
from turbo_moe.ops.swiglu_combine_grad import swiglu_combine_grad
from turbo_moe.ops.unpermute import unpermute_call
from turbo_moe.ops.varying import match_varying

# Names of the expert FFN's inputs and GEMM outputs (`jax.ad_checkpoint.checkpoint_name`): the remat
# policy "dots_experts_attention" saves them so that no path's expert GEMMs run again in the backward pass.
EXPERT_SAVE_NAMES = ("moe_expert_rows", "moe_expert_gate_up", "moe_expert_down", "moe_expert_group_sizes",
                     "moe_expert_act")


def saved(x: jax.Array, name: str) -> jax.Array:
    """x named `name` for the remat policies, behind an optimization barrier."""
    # The barrier keeps XLA's dynamic-slice fusion from wrapping a *clone* of the FFI call that made x
    # around the write into the scan's stacked residuals (it did: every saved grouped GEMM ran twice in
    # the forward pass). Values are unchanged.
    return checkpoint_name(jax.lax.optimization_barrier(x), name)


@jax.custom_vjp
def swiglu(h: jax.Array) -> jax.Array:
    """silu(gate) * up for h (..., 2F) = [gate | up] -> (..., F).

    Its backward is written out: d_h = [d_gate | d_up] as one concatenate, computed in float32. Autodiff of the
    two slices gave pad(d_gate) + pad(d_up), which XLA fused into a loop that evaluated both halves for every
    element of d_h, at almost twice its bytes' time."""
    return _swiglu(h)


def _swiglu(h):
    f = h.shape[-1] // 2
    return jax.nn.silu(h[..., :f]) * h[..., f:]


def _swiglu_fwd(h):
    return _swiglu(h), h


def _swiglu_bwd(h, d_act):
    return (swiglu_grad(h, d_act).astype(h.dtype),)


swiglu.defvjp(_swiglu_fwd, _swiglu_bwd)


def _check_weights(w_gate_up, w_down, width: int, width_name: str, gemms: GemmSet) -> None:
    """w_gate_up (E, D, 2F) and w_down (E, F, D) of one float dtype, D = `width` (the rows' last dim), D and F
    multiples of the set's `width_multiple`."""
    for name, w in (("w_gate_up", w_gate_up), ("w_down", w_down)):
        if isinstance(w, Fp8Weights) and gemms.name != "fp8":
            raise TypeError(f"{name} is Fp8Weights (ops.fp8_weights), which only gemms='fp8' reads; got "
                            f"gemms={gemms.name!r}: pass the weight itself")
    _checks.check_rank("w_gate_up", w_gate_up, 3, "(E, D, 2F)")
    _checks.check_rank("w_down", w_down, 3, "(E, F, D)")
    _checks.float_dtype("w_gate_up", w_gate_up.dtype)
    if w_down.dtype != w_gate_up.dtype:
        raise TypeError(f"w_down must have w_gate_up's dtype {w_gate_up.dtype}, got {w_down.dtype}")
    e, d, f2 = w_gate_up.shape
    if d != width or f2 % 2:
        raise ValueError(f"w_gate_up must be (E, D, 2F) with D = {width} ({width_name}) and an even 2F = "
                         f"[gate | up], got {w_gate_up.shape}")
    if (w_down.shape[0], w_down.shape[2]) != (e, d):
        raise ValueError(f"w_down must be (E, F, D) with E = {e} and D = {d} like w_gate_up {w_gate_up.shape}, "
                         f"got {w_down.shape}")
    f = w_down.shape[1]
    if f2 != 2 * f:  # each could be the wrong one: name both, the gate/up width first
        raise ValueError(f"w_gate_up's last dimension must be 2F = {2 * f} ([gate | up] for w_down (E, F, D) "
                         f"{w_down.shape}), got {f2} (w_gate_up {w_gate_up.shape})")
    m = gemms.width_multiple
    for name, size, what in ((width_name, d, "D"), ("w_down (E, F, D)", f, "F")):
        if size % m:
            raise ValueError(f"{name.split()[0]}: gemms={gemms.name!r} needs {what} a multiple of {m} (its GEMMs' "
                             f"K and N), got {what} = {size} ({name})")


def expert_ffn(rows: jax.Array, w_gate_up: jax.Array, w_down: jax.Array, group_sizes: jax.Array | None,
               gemms: GemmSet | str = "turbo") -> jax.Array:
    """The E SwiGLU experts on expert-sorted rows: gate+up GEMM -> SwiGLU -> down GEMM, differentiated by autodiff.

    rows (M, D) sorted by expert with group_sizes (E,) int rows each (or slots (E, ..., D) and None for the "einsum"
    set), w_gate_up (E, D, 2F) = [gate | up], w_down (E, F, D), all of one float dtype -> (M, D) (or (E, ..., D)).
    gemms: a GemmSet or its name in GEMM_SETS; its fused gate/up + SwiGLU is not used here (`expert_block` uses it).
    Rows past sum(group_sizes) give zero rows."""
    gemms = gemm_set(gemms)
    _checks.float_dtype("rows", rows.dtype)
    if rows.ndim < 2:
        raise ValueError(f"rows must be (M, D) (or slots (E, ..., D)), got shape {rows.shape}")
    _check_weights(w_gate_up, w_down, rows.shape[-1], "rows (M, D)", gemms)
    if rows.dtype != w_gate_up.dtype:
        raise TypeError(f"rows ({rows.dtype}) and w_gate_up ({w_gate_up.dtype}) must have one dtype")
    rows = saved(rows, EXPERT_SAVE_NAMES[0])
    if group_sizes is not None:  # the grouped GEMMs' backward reads them: saved, the permute need not run again
        group_sizes = saved(group_sizes, EXPERT_SAVE_NAMES[3])
    with jax.named_scope("grouped_gemm"):
        h = saved(gemms.forward(rows, w_gate_up, group_sizes), EXPERT_SAVE_NAMES[1])  # (M, 2F)
    with jax.named_scope("swiglu"):
        act = checkpoint_name(swiglu(h), EXPERT_SAVE_NAMES[4])  # (M, F); saved: not recomputed for the backward
    with jax.named_scope("grouped_gemm"):
        return saved(gemms.forward(act, w_down, group_sizes), EXPERT_SAVE_NAMES[2])  # (M, D)


def expert_block(tokens: jax.Array, expert_ids: jax.Array, combine_w: jax.Array, w_gate_up: jax.Array,
                 w_down: jax.Array, gemms: GemmSet | str = "turbo") -> tuple[jax.Array, jax.Array]:
    """The routed experts of a MoE layer as one op: permute -> `expert_ffn` -> unpermute, with one custom VJP.

    Args:
      tokens: (T, D) bfloat16, float16 or float32.
      expert_ids: (T, k) integer, the experts of each token's k copies; an id outside [0, E) drops that copy.
      combine_w: (T, k) float, each copy's combine weight (computed in float32).
      w_gate_up: (E, D, 2F) = [gate | up], w_down: (E, F, D), in tokens' dtype; with gemms="fp8" either may be
        `ops.fp8_weights(w)`, its FP8 blocks made once for every call of an optimizer step.
      gemms: a `GemmSet` or its name in `GEMM_SETS`: "turbo" (our FFI kernels, fused SwiGLU), "ragged_dot"
        (`jax.lax.ragged_dot`), "pallas" (Pallas Mosaic-GPU, Hopper only) or "fp8" (`grouped_gemm_fp8`, D and F
        multiples of 128); not "einsum", the batched einsum of the capacity path's slots (`expert_ffn` takes it). A
        set with `gate_up_swiglu` runs the fused kernels (`without_fused_swiglu()` leaves SwiGLU to XLA).
    Returns:
      y (T, D) in tokens' dtype, y[t] = sum_j combine_w[t, j] * expert_{ids[t, j]}(tokens[t]), and group_sizes
      (E,) int32 (copies per expert). Differentiable in tokens, combine_w and both weights.
    """
    gemms = gemm_set(gemms)
    if gemms.name == "einsum":
        raise ValueError("gemms: the 'einsum' set multiplies capacity slots, not expert-sorted rows; use 'turbo', "
                         "'ragged_dot', 'pallas' or 'fp8'")
    _checks.check_rank("tokens", tokens, 2, "(T, D)")
    _checks.float_dtype("tokens", tokens.dtype)
    _checks.check_rank("expert_ids", expert_ids, 2, "(T, k)")
    _checks.check_integer("expert_ids", expert_ids)
    if expert_ids.shape[0] != tokens.shape[0] or jnp.shape(combine_w) != expert_ids.shape:
        raise ValueError(f"expert_ids and combine_w must be (T, k) with T = {tokens.shape[0]} like tokens (T, D), "
                         f"got {expert_ids.shape} and {jnp.shape(combine_w)}")
    if not jnp.issubdtype(combine_w.dtype, jnp.floating):
        raise TypeError(f"combine_w must be a float array (T, k), got dtype {combine_w.dtype}")
    _check_weights(w_gate_up, w_down, tokens.shape[1], "tokens (T, D)", gemms)
    if w_gate_up.dtype != tokens.dtype:
        raise TypeError(f"w_gate_up and w_down must have tokens' dtype {tokens.dtype}, got {w_gate_up.dtype}")
    n_experts = w_gate_up.shape[0]
    ids = _checks.index_as_int32(expert_ids, n_experts)
    return _block(tokens, ids, combine_w.astype(jnp.float32), w_gate_up, w_down, n_experts, gemms)


def _forward(tokens, expert_ids, combine_w, w_gate_up, w_down, n_experts, gemms):
    fused = gemms.gate_up_swiglu is not None
    zero_tail = not fused  # the fused kernels leave every buffer's rows past the groups unwritten
    if gemms.permute_forward is not None and not fused:  # the set's own permute (fp8: rows quantised in the copy)
        h, group_sizes, row_index = gemms.permute_forward(tokens, expert_ids, n_experts, w_gate_up)
        group_sizes = saved(group_sizes, EXPERT_SAVE_NAMES[3])
        h = saved(h, EXPERT_SAVE_NAMES[1])  # (T*k, 2F)
        y_rows = _swiglu_down(h, w_down, group_sizes, gemms, zero_tail)
    else:
        with jax.named_scope("permute"):
            rows, group_sizes, row_index = _permute_call(tokens, expert_ids, n_experts, zero_tail)[:3]
        group_sizes = saved(group_sizes, EXPERT_SAVE_NAMES[3])
        h, act = _gate_up(rows, w_gate_up, group_sizes, gemms)
        with jax.named_scope("grouped_gemm"):
            y_rows = gemms.forward(act, w_down, group_sizes, zero_tail)  # (T*k, D): not kept for the backward
    with jax.named_scope("unpermute"):
        y = unpermute_call(y_rows, row_index, combine_w)
    return y, group_sizes, (h, saved(row_index, ROW_INDEX_NAME))


def _swiglu_down(h, w_down, group_sizes, gemms, zero_tail):
    """The down GEMM's output rows (T*k, D) from h: SwiGLU in bf16 then the set's forward, or (a set with
    `producer_quantized`) SwiGLU writing its FP8 rows for the GEMM, so no pass reads act again to quantise it."""
    pq = gemms.producer_quantized
    if pq is None:
        with jax.named_scope("swiglu"):
            act = swiglu(h)  # (T*k, F)
        with jax.named_scope("grouped_gemm"):
            return gemms.forward(act, w_down, group_sizes, zero_tail)
    with jax.named_scope("swiglu"):  # rows past the groups unwritten: the GEMM reads group rows only
        act_q, act_scale = pq.swiglu(h, jnp.sum(group_sizes).astype(jnp.int32))
    with jax.named_scope("grouped_gemm"):
        return pq.forward(act_q, act_scale, w_down, group_sizes, out_dtype=h.dtype)  # rows past the groups zero


def _gate_up(rows, w_gate_up, group_sizes, gemms):
    """h (T*k, 2F) and act = SwiGLU(h) (T*k, F) from the permuted rows."""
    if gemms.gate_up_swiglu is not None:
        with jax.named_scope("grouped_gemm"):
            h, act = gemms.gate_up_swiglu(rows, w_gate_up, group_sizes)  # (T*k, 2F), (T*k, F)
        # Named without `saved`'s barrier: h's one reader is its write into the scan's residual stack, which XLA's
        # dynamic-slice fusion then does in place, from inside the FFI call (no clone: act is the call's own output).
        return checkpoint_name(h, EXPERT_SAVE_NAMES[1]), act
    with jax.named_scope("grouped_gemm"):
        h = saved(gemms.forward(rows, w_gate_up, group_sizes), EXPERT_SAVE_NAMES[1])  # (T*k, 2F)
    with jax.named_scope("swiglu"):
        return h, swiglu(h)  # (T*k, F)


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6))
def _block(tokens, expert_ids, combine_w, w_gate_up, w_down, n_experts, gemms):
    y, group_sizes, _ = _forward(tokens, expert_ids, combine_w, w_gate_up, w_down, n_experts, gemms)
    return y, group_sizes


def _block_fwd(tokens, expert_ids, combine_w, w_gate_up, w_down, n_experts, gemms):
    y, group_sizes, (h, row_index) = _forward(tokens, expert_ids, combine_w, w_gate_up, w_down, n_experts, gemms)
    return (y, group_sizes), (tokens, combine_w, w_gate_up, w_down, group_sizes, h, row_index)


def _block_bwd(n_experts, gemms, residuals, cotangents):
    tokens, combine_w, w_gate_up, w_down, group_sizes, h, row_index = residuals
    d_y = cotangents[0]  # (T, D); group_sizes are integers
    # The backward's one pass over h (`swiglu_combine_grad`) also serves a set whose forward leaves SwiGLU to XLA
    # (fp8: no FP8 GEMM with a SwiGLU epilogue); its buffers' tails are then written (zero_tail), as its forward's.
    pq = gemms.producer_quantized  # FP8 rows written by their producers: g's rows and d_h come in bf16 and FP8
    fused = gemms.gate_up_swiglu is not None or gemms.swiglu_backward_kernel or pq is not None
    zero_tail = gemms.gate_up_swiglu is None
    with jax.named_scope("unpermute"):
        if pq is None:
            g_rows = permute_rows_call(d_y.astype(h.dtype), row_index, group_sizes, zero_tail)  # unweighted rows of g
        else:
            g_rows, g_q, g_scale = pq.permute_rows(d_y.astype(h.dtype), row_index, group_sizes, zero_tail)
        # each row's combine weight (0 for rows no copy fills): one XLA scatter of T*k scalars (the row-copy kernel
        # spends a warp per 4-byte row)
        n = row_index.size
        rows_of_copies = jnp.where(row_index >= 0, row_index, n).reshape(-1)  # dropped copies -> out of range
        w_rows = jnp.zeros((n,), jnp.float32).at[rows_of_copies].set(combine_w.reshape(-1), mode="drop")[:, None]
    if fused:  # one pass over h and g_act gives d_h, d_w and w * act
        with jax.named_scope("grouped_gemm"):  # g @ W^T
            g_act = (gemms.data_grad(g_rows, w_down, group_sizes, zero_tail) if pq is None
                     else pq.data_grad(g_q, g_scale, w_down, group_sizes, out_dtype=h.dtype))
        with jax.named_scope("swiglu"):
            # only the group rows: a worst-case EP buffer is mostly tail (d_w_rows is read by row index, d_h and
            # act_w by the GEMMs, by group)
            valid = jnp.sum(group_sizes).astype(jnp.int32)
            if pq is None:
                d_h, d_w_rows, act_w = swiglu_combine_grad(h, g_act, w_rows[:, 0], valid)
            else:
                d_h, d_h_q, d_h_scale, d_w_rows, act_w = pq.swiglu_grad(h, g_act, w_rows[:, 0], valid)
        with jax.named_scope("grouped_gemm"):
            d_w_down = gemms.weight_grad(act_w, g_rows, group_sizes).astype(w_down.dtype)  # (w act)^T @ g
    else:
        act = swiglu(h)  # not saved: XLA fuses it into the passes below that read it
        with jax.named_scope("unpermute"):
            act_w = (act.astype(jnp.float32) * w_rows).astype(act.dtype)
        with jax.named_scope("grouped_gemm"):
            _, down_vjp = jax.vjp(lambda a, w: gemms.forward(a, w, group_sizes), act_w, w_down)
            g_act, d_w_down = down_vjp(g_rows)  # g @ W^T (it does not depend on act_w) and (w act)^T @ g
        with jax.named_scope("unpermute"):
            d_w_rows = jnp.sum(act.astype(jnp.float32) * g_act.astype(jnp.float32), axis=-1)  # <y, g> per row
        with jax.named_scope("swiglu"):
            d_act = (g_act.astype(jnp.float32) * w_rows).astype(act.dtype)
            _, swiglu_vjp = jax.vjp(swiglu, h)
            (d_h,) = swiglu_vjp(d_act)
    with jax.named_scope("unpermute"):
        d_combine = jnp.where(row_index >= 0, d_w_rows[jnp.maximum(row_index, 0)], 0.0)
    with jax.named_scope("permute"):
        rows = permute_rows_call(tokens, row_index, group_sizes, zero_tail)  # the forward's permuted rows
    with jax.named_scope("grouped_gemm"):
        if pq is None:
            _, up_vjp = jax.vjp(lambda r, w: gemms.forward(r, w, group_sizes, zero_tail), rows, w_gate_up)
            d_rows, d_w_gate_up = up_vjp(d_h)
        else:  # the data gradient from d_h's FP8 rows; the weight gradient as the set's VJP runs it
            d_rows = pq.data_grad(d_h_q, d_h_scale, w_gate_up, group_sizes, out_dtype=tokens.dtype)
            d_w_gate_up = gemms.weight_grad(rows, d_h, group_sizes).astype(w_gate_up.dtype)
    with jax.named_scope("permute"):
        d_tokens = unpermute_call(d_rows, row_index, jnp.ones(row_index.shape, jnp.float32))
    return (match_varying(d_tokens, tokens), None, match_varying(d_combine, combine_w),
            _weight_cotangent(d_w_gate_up, w_gate_up), _weight_cotangent(d_w_down, w_down))


def _weight_cotangent(d_w, w):
    """A weight's cotangent typed like it; for Fp8Weights only the master leaf gets one (the FP8 copies are made
    from it, behind a stop_gradient)."""
    if isinstance(w, Fp8Weights):  # d_w: the weight gradient itself, or an Fp8Weights cotangent (a VJP through w)
        d_master = d_w.master if isinstance(d_w, Fp8Weights) else d_w
        return Fp8Weights(match_varying(d_master, w.master), None, None, None)
    return match_varying(d_w, w)


_block.defvjp(_block_fwd, _block_bwd)
