"""The dense layout of `moe_dispatch` / `moe_combine`: every token to every rank, no packing.

Block j of the (P*T, H) receive buffer holds all T tokens of one source rank; the receiver keeps the
ids of its own experts (-1 elsewhere), and the combine sums each token's P rows, rounded once. Three
ways to move the blocks (`via`), the same bytes on the wire (P-1 blocks of T rows each way):
- "all_gather": all_gather there, reduce-scatter back (all_to_all + float32 sum where a reduce-scatter
  would round more than once: bf16 at P > 2). Blocks in source-rank order.
- "all_to_all": x broadcast to (P, T, H), all_to_all there; all_to_all back + float32 sum.
  Source-rank order.
- "permute": P-1 collective permutes (shift s: rank r sends to r - s, so block s is source me + s)
  there and back; nothing is sent to oneself and nothing is broadcast. Blocks rotated: block j is
  source (me + j) % P, so block 0 is this rank's own tokens.
Why three: NCCL's all_gather + reduce-scatter of two H200s ran at 0.85x an all_to_all of the same
bytes (docs/expert-parallel.md), and the all_to_all copies the block a rank keeps.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from turbo_moe.ops.varying import match_varying

DENSE_VIA = ("auto", "all_gather", "all_to_all", "permute")
DEFAULT_DENSE_VIA = "auto"


def resolve_via(via: str, n_ranks: int) -> str:
    """"auto": permute at two ranks (one permute each way: the fastest of the three there), all_gather beyond (XLA
    runs the P-1 permutes one after another). Measured on four H200s: docs/expert-parallel.md."""
    if via not in DENSE_VIA:
        raise ValueError(f"dense_via must be one of {DENSE_VIA}, got {via!r}")
    if via == "auto":
        return "permute" if n_ranks == 2 else "all_gather"
    return via


def _shift(x, axis_name: str, s: int):
    """Rank r receives rank (r + s) % P's x."""
    P = jax.lax.axis_size(axis_name)
    return jax.lax.ppermute(x, axis_name, [((r + s) % P, r) for r in range(P)])


def source_order(rows, axis_name: str, via: str):
    """(P*T, ...) rows gathered in source-rank order -> the block order of `via` (rotated for permute)."""
    if via != "permute":
        return rows
    P = jax.lax.axis_size(axis_name)
    me = jax.lax.axis_index(axis_name)
    blocks = rows.reshape(P, -1, *rows.shape[1:])
    return jnp.roll(blocks, -me, axis=0).reshape(rows.shape)  # small arrays only (ids, weights)


def block_sources(axis_name: str, via: str):
    """(P,) the source rank of each block of the receive buffer."""
    P = jax.lax.axis_size(axis_name)
    blocks = jnp.arange(P, dtype=jnp.int32)
    return (blocks + jax.lax.axis_index(axis_name)) % P if via == "permute" else blocks


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2))
def gather_blocks(x, axis_name: str, via: str = "all_gather"):
    """(T, H) -> (P*T, H): every rank's rows in `via`'s block order; the transpose is `sum_blocks`."""
    P = jax.lax.axis_size(axis_name)
    if via == "all_gather":
        return jax.lax.all_gather(x, axis_name, tiled=True)
    if via == "all_to_all":
        sent = jnp.broadcast_to(x[None], (P,) + x.shape)
        return jax.lax.all_to_all(sent, axis_name, 0, 0).reshape(P * x.shape[0], -1)
    return jnp.concatenate([x] + [_shift(x, axis_name, s) for s in range(1, P)])


def _gather_fwd(x, axis_name, via):
    return gather_blocks(x, axis_name, via), x[:0]  # x[:0]: x's type, no data


def _gather_bwd(axis_name, via, x_type, d_out):
    return (match_varying(sum_blocks(d_out, axis_name, via), x_type),)


gather_blocks.defvjp(_gather_fwd, _gather_bwd)


def sum_blocks(y, axis_name: str, via: str = "all_gather"):
    """(P*T, H) in `via`'s block order -> (T, H): row t is the sum over ranks of the row each computed
    for my token t, rounded once (float32 sums)."""
    P = jax.lax.axis_size(axis_name)
    if via == "permute":
        blocks = y.reshape(P, -1, y.shape[-1])
        # block s came from rank me + s: its rows go back there, i.e. I receive rank (me - s)'s block s
        parts = [blocks[0]] + [_shift(blocks[s], axis_name, -s) for s in range(1, P)]
        return functools.reduce(jnp.add, [p.astype(jnp.float32) for p in parts]).astype(y.dtype)
    if via == "all_gather" and (y.dtype == jnp.float32 or P <= 2):  # one addition a row: one rounding
        return jax.lax.psum_scatter(y, axis_name, scatter_dimension=0, tiled=True)
    got = jax.lax.all_to_all(y.reshape(P, -1, y.shape[-1]), axis_name, 0, 0)  # (P src, T, H)
    return got.astype(jnp.float32).sum(0).astype(y.dtype)


def dispatch_dense(x, ids, weights, P: int, El: int, axis_name: str, via: str):
    """Every token to every rank; the receiver keeps the ids of its own experts.
    Returns recv_x (P*T, H), recv_ids (P*T, k), recv_w (P*T, k), sent (T, P) bool."""
    me = jax.lax.axis_index(axis_name).astype(jnp.int32)
    # two small all_gathers (XLA may combine them); the weights' one carries their gradient back
    all_ids = source_order(jax.lax.all_gather(ids, axis_name, tiled=True), axis_name, via)  # (P*T, k)
    all_w = source_order(jax.lax.all_gather(weights, axis_name, tiled=True), axis_name, via)
    mine = (all_ids >= me * El) & (all_ids < (me + 1) * El)
    recv_ids = jnp.where(mine, all_ids - me * El, -1)
    recv_w = jnp.where(mine, all_w, 0.0)
    dest = jnp.where(ids >= 0, ids // El, -1)  # (T, k) rank of each expert
    sent = jnp.any(dest[:, :, None] == jnp.arange(P, dtype=jnp.int32), axis=1)  # (T, P)
    return gather_blocks(x, axis_name, via), recv_ids, recv_w, sent
