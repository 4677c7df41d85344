"""Expert-parallel dispatch fused with the permute, and its combine: the protocol of a DeepEP-class transport
(docs/notes/ep-transport.md), run here as its CPU reference, with XLA collectives standing in for peer writes.

    x_sorted, group_sizes, recv_w, handle = fused_dispatch(x, expert_ids, weights, num_experts=E, axis_name="expert")
    y_sorted = experts(x_sorted, group_sizes)                      # the grouped GEMM's groups, as they arrive
    out = fused_combine(y_sorted, recv_w, handle, axis_name="expert")   # (T, H)

Call inside `shard_map` over `axis_name` (P ranks; rank p owns experts [p*El, (p+1)*El)). Per rank:
1. layout: each token takes a packet slot at every rank owning any of its experts, in token order, at most C a rank
   (`capacity`; tokens past it are dropped there and counted in handle.overflow, as moe_dispatch does); the rank
   counts its copies per (destination rank, local expert): (P, El).
2. notify: one all_gather of those counts, so every rank holds (P src, P dst, El). A receiver's group sizes are its
   column summed over sources; a sender's first row in group e of rank p is that group's offset plus the copies
   the sources before it send there. No count reaches the host.
3. dispatch: the pack kernel writes one packet per (token, destination rank): the row once, with the destination
   row and weight of each of its copies there; the wire (all_to_all here, peer writes on the GPU) moves the
   packets; the land kernel puts each packet's row on its destination rows. The receiver's buffer holds its copies
   sorted by (local expert, source rank, source token, top-k slot): the order of moe_dispatch's packed layout +
   permute, so the rows, and every sum over them, are bit-equal to that exchange's.
4. combine, the transpose: the receiver sums each packet's copies (weighted, float32: `unpermute`), sends one row a
   packet back, and the source sums what its ranks return (float32, rounded once).
Gradients: each kernel call is a custom_vjp whose backward is the other side's kernel (land <-> the receiver's sum,
pack <-> the source's sum); the all_to_all transposes itself.

Buffers are static. The receive buffer has R = `recv_rows` rows, by default the worst case P*C*k (every copy of every
source's packets lands here), which never overflows. A smaller R (memory) can: copies whose rows fall past R are not
written (the last groups lose their tails), the group sizes say so, and handle.lost_rows counts them. That is an
error, not a drop: the caller checks it (`check_receive_buffer`, outside jit) and must raise `recv_rows`.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from turbo_moe.ops import _checks
from turbo_moe.ops._ffi import ffi_call, make_varying, match_varying, varying_axes
from turbo_moe.ops.moe_dispatch import slot_rows
from turbo_moe.ops.unpermute import PermuteHandle, unpermute, unpermute_call


class ReceiveBufferOverflow(RuntimeError):
    """A fused dispatch's receive buffer was too small for the copies routed to it."""


@functools.partial(jax.tree_util.register_dataclass, data_fields=("slot", "rows", "overflow", "needed_rows"),
                   meta_fields=("recv_rows",))
@dataclasses.dataclass(frozen=True)
class FusedHandle:
    """What `fused_combine` needs. slot int32 (T, P): my token t's packet slot at rank p, -1 where none.
    rows int32 (P*C, k): the x_sorted row of each received packet's copy j, -1 where none (or lost).
    overflow int32 (P,): my tokens past the capacity of each rank (dropped there, as moe_dispatch counts them).
    needed_rows int32 (): the rows my receive buffer needed; recv_rows: the rows it has (static)."""

    slot: jax.Array
    rows: jax.Array
    overflow: jax.Array
    needed_rows: jax.Array
    recv_rows: int

    @property
    def lost_rows(self) -> jax.Array:
        """int32 (): copies that found no row in my receive buffer (0 unless recv_rows is below the worst case)."""
        return jnp.maximum(self.needed_rows - self.recv_rows, 0)


def worst_case_rows(n_ranks: int, capacity: int, top_k: int) -> int:
    """Receive-buffer rows that no routing can overflow: every copy of every source's C packets lands here."""
    return n_ranks * capacity * top_k


def check_receive_buffer(lost_rows, recv_rows: int) -> None:
    """Outside jit (e.g. after a training step): raises ReceiveBufferOverflow if any rank lost copies.
    lost_rows: FusedHandle.lost_rows, from one rank or stacked over ranks."""
    lost = np.asarray(lost_rows)
    if lost.size and int(lost.max()) > 0:
        raise ReceiveBufferOverflow(
            f"fused_dispatch: a receive buffer of recv_rows={recv_rows} rows lost {int(lost.max())} copies (a rank "
            f"needed {recv_rows + int(lost.max())} rows): raise recv_rows (the worst case never overflows)")


def fused_dispatch(x, expert_ids, weights, *, num_experts: int, axis_name: str, capacity: int | None = None,
                   recv_rows: int | None = None):
    """Sends each token once to every rank owning any of its experts; rows land sorted by local expert.

    Args:
      x: (T, H) this rank's tokens, float32/bfloat16/float16.  expert_ids: int (T, k) global expert ids (out of
        range: dropped).  weights: (T, k) combine weights.  num_experts: E, divisible by the axis size P.
      capacity: packet slots per destination rank (default T: nothing is dropped), as moe_dispatch's.
      recv_rows: rows R of the receive buffer, in [1, P*C*k] (default P*C*k, the worst case: nothing is lost).
    Returns:
      x_sorted (R, H): the copies this rank's experts compute, grouped by local expert; rows past the groups zero.
      group_sizes int32 (El,): copies per local expert (the grouped GEMM's groups).
      recv_w float32 (P*C, k): each received packet's combine weights (fused_combine's), 0 where no copy.
      handle: FusedHandle for fused_combine (overflow, lost_rows: the counts to check).
    """
    T, k, num_experts, P = _checks.expert_parallel_inputs(x, expert_ids, weights, num_experts, axis_name)
    if not jnp.issubdtype(weights.dtype, jnp.floating):
        raise TypeError(f"weights must be a float array (T, k), got dtype {weights.dtype}")
    C = T if capacity is None else _checks.static_int("capacity", capacity, maximum=T)
    worst = worst_case_rows(P, C, k)
    if worst > _checks.INT32_MAX:  # rows travel as int32
        raise ValueError(f"the receive buffer's worst case P*C*k = {P}*{C}*{k} rows must be < 2^31: cap capacity")
    R = worst if recv_rows is None else _checks.static_int("recv_rows", recv_rows, maximum=worst)
    if jax.default_backend() != "cpu":
        raise NotImplementedError("fused_dispatch has only its CPU reference so far; the GPU transport is planned in "
                                  "docs/notes/ep-transport.md (use moe_dispatch there)")
    El = num_experts // P
    ids = _checks.index_as_int32(expert_ids, num_experts)
    slot, counts, overflow = _layout(ids, P, El, C)
    all_counts = jax.lax.all_gather(counts, axis_name)  # (P src, P dst, El): the notify
    dest_base, group_sizes, needed = _offsets(all_counts, jax.lax.axis_index(axis_name), R)
    send_x, send_rows, send_w = _pack(x, ids, weights.astype(jnp.float32), slot, dest_base, C, R)
    wire = functools.partial(jax.lax.all_to_all, axis_name=axis_name, split_axis=0, concat_axis=0)
    recv_x, rows, recv_w = (wire(a).reshape(P * C, -1) for a in (send_x, send_rows, send_w))
    x_sorted = _land(recv_x, rows, R)
    return x_sorted, group_sizes, recv_w, FusedHandle(slot, rows, overflow, needed, R)


def fused_combine(y_sorted, recv_w, handle: FusedHandle, *, axis_name: str):
    """(R, H) expert outputs in x_sorted's rows -> (T, H): out[t] = sum over my token t's copies of weight * output.

    recv_w: the (P*C, k) weights fused_dispatch returned (differentiable: their gradient flows back to the
    dispatch's weights). Same axis_name as the dispatch."""
    if not isinstance(handle, FusedHandle):
        raise TypeError(f"handle must be the FusedHandle returned by fused_dispatch, got {type(handle).__name__}")
    _checks.check_rank("y_sorted", y_sorted, 2, "(R, H)")
    _checks.float_dtype("y_sorted", y_sorted.dtype)
    if y_sorted.shape[0] != handle.recv_rows:
        raise ValueError(f"y_sorted must have the dispatch's recv_rows={handle.recv_rows} rows, got {y_sorted.shape}")
    if recv_w.shape != handle.rows.shape:
        raise ValueError(f"recv_w must be the dispatch's (P*C, k) = {handle.rows.shape} weights, got {recv_w.shape}")
    T, P = handle.slot.shape
    C = handle.rows.shape[0] // P
    per_packet = unpermute(y_sorted, PermuteHandle(handle.rows), recv_w)  # (P*C, H): the receiver's sums
    back = jax.lax.all_to_all(per_packet.reshape(P, C, -1), axis_name, 0, 0)  # (P, C, H): rows for my tokens
    ones = make_varying(jnp.ones((T, P), jnp.float32), varying_axes(back))
    return unpermute(back.reshape(P * C, -1), PermuteHandle(slot_rows(handle.slot, C)), ones)


def _layout(ids, P: int, El: int, C: int):
    """ids int32 (T, k), -1 for none -> slot int32 (T, P), counts int32 (P, El) of the copies in packets,
    overflow int32 (P,) tokens past each rank's C slots. Token order, as moe_dispatch's pack kernel."""
    valid = ids >= 0
    dest = jnp.where(valid, ids // El, -1)  # (T, k) rank of each copy
    goes = jnp.any(dest[:, :, None] == jnp.arange(P, dtype=jnp.int32), axis=1)  # (T, P)
    position = jnp.cumsum(goes, axis=0, dtype=jnp.int32) - 1
    fits = goes & (position < C)
    slot = jnp.where(fits, position, -1)
    overflow = jnp.sum(goes & ~fits, axis=0, dtype=jnp.int32)
    in_packet = valid & jnp.take_along_axis(fits, jnp.maximum(dest, 0), axis=1)  # (T, k)
    counts = jnp.zeros((P * El,), jnp.int32).at[jnp.where(in_packet, ids, P * El)].add(1, mode="drop")
    return slot, counts.reshape(P, El), overflow


def _offsets(all_counts, me, R: int):
    """From the notify's (P src, P dst, El) counts: my first row in each (rank, local expert) group dest_base (P, El),
    my group sizes (El,) clipped to R rows, and the rows my buffer needed ()."""
    P = all_counts.shape[0]
    per_dest = all_counts.sum(0)  # (P dst, El) copies each rank receives per local expert
    group_start = jnp.cumsum(per_dest, axis=1) - per_dest  # (P dst, El)
    before_me = jnp.where((jnp.arange(P) < me)[:, None, None], all_counts, 0).sum(0)  # (P dst, El)
    mine, my_start = per_dest[me], group_start[me]  # (El,)
    group_sizes = jnp.clip(R - my_start, 0, mine)
    return ((group_start + before_me).astype(jnp.int32), group_sizes.astype(jnp.int32),
            mine.sum().astype(jnp.int32))


def _pack_call(x, ids, weights, slot, dest_base, C: int, R: int):
    P, k = dest_base.shape[0], ids.shape[1]
    out = (jax.ShapeDtypeStruct((P, C, x.shape[1]), x.dtype), jax.ShapeDtypeStruct((P, C, k), jnp.int32),
           jax.ShapeDtypeStruct((P, C, k), jnp.float32))
    return ffi_call("turbo_moe_fused_dispatch_pack", out, x, ids, weights, slot, dest_base, recv_rows=R)


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6))
def _pack(x, ids, weights, slot, dest_base, C: int, R: int):
    return _pack_call(x, ids, weights, slot, dest_base, C, R)


def _pack_fwd(x, ids, weights, slot, dest_base, C, R):
    out = _pack_call(x, ids, weights, slot, dest_base, C, R)
    return out, (ids, slot, out[1], dest_base, x[:0], weights[:0])  # [:0]: the inputs' types, no data


def _pack_bwd(C, R, residuals, cotangents):
    """The source's side of the combine: a token's x gradient sums its packets' (unit weights); a weight's is what
    its copy's packet brought back (none for a copy without a row)."""
    ids, slot, send_rows, dest_base, x_type, w_type = residuals
    d_send_x, _, d_send_w = cotangents
    (T, P), k, El = slot.shape, ids.shape[1], dest_base.shape[1]
    d_x = unpermute_call(d_send_x.reshape(P * C, -1), slot_rows(slot, C), jnp.ones((T, P), jnp.float32))
    dest = jnp.where(ids >= 0, ids // El, 0)  # (T, k) rank of each copy
    dest_slot = jnp.take_along_axis(slot, dest, axis=1)  # (T, k) its packet there
    flat = (dest * C + jnp.maximum(dest_slot, 0)) * k + jnp.arange(k, dtype=jnp.int32)  # (T, k) into (P, C, k)
    has_row = (ids >= 0) & (dest_slot >= 0) & (send_rows.reshape(-1)[flat] >= 0)
    d_w = jnp.where(has_row, d_send_w.reshape(-1)[flat], 0.0)
    return match_varying(d_x, x_type), None, match_varying(d_w, w_type), None, None


_pack.defvjp(_pack_fwd, _pack_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _land(recv_x, rows, R: int):
    return _land_call(recv_x, rows, R)


def _land_call(recv_x, rows, R: int):
    out = jax.ShapeDtypeStruct((R, recv_x.shape[1]), recv_x.dtype)
    return ffi_call("turbo_moe_fused_dispatch_land", out, recv_x, rows)


def _land_fwd(recv_x, rows, R):
    return _land_call(recv_x, rows, R), (rows, recv_x[:0])


def _land_bwd(R, residuals, d_sorted):
    """The receiver's side of the combine with unit weights: each packet's gradient sums its copies' rows."""
    rows, x_type = residuals
    d_recv = unpermute_call(d_sorted, rows, jnp.ones(rows.shape, jnp.float32))
    return match_varying(d_recv, x_type), None


_land.defvjp(_land_fwd, _land_bwd)
