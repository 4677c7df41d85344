"""One-device exchanges: token copies -> expert-sorted rows -> an FFN -> weighted sum per token.

An exchange is a function
    exchange(tokens (T, D), expert_ids (T, k) int32, combine_w (T, k) float32, n_experts, ffn)
        -> (y (T, D), computed () int32)
that lays the token copies out by expert, calls `ffn(rows, group_sizes) -> out_rows` once and sums each
token's outputs with its combine weights; it never looks inside `ffn` (the experts, `ops.expert_ffn`, or
an expert-parallel exchange's move of the rows to other ranks and back). `computed` counts the copies that
reached an expert (the rest were dropped). A `Stage` is the experts behind an exchange, ffn bound
(`paths.expert_stage`; the expert-parallel exchanges of `ep_exchange.py` are stages too).

- `sort_exchange`: pure JAX (argsort + gather; MaxText `sparse_matmul`). Ids in [0, E]; E means none.
- `permute_exchange`: the turbo_moe.ops permute / unpermute FFI kernels. Ids outside [0, E) mean none.
- `capacity_exchange`: MaxText `dense_matmul` capacity slots (E, B, C, D) per sequence; drops overflow.
"""

from __future__ import annotations

import math
from typing import Callable

import jax
import jax.numpy as jnp

from turbo_moe.ops.permute import permute
from turbo_moe.ops.unpermute import unpermute

# ffn(rows, group_sizes) -> out_rows; an exchange(tokens, expert_ids, combine_w, n_experts, ffn) -> (y, computed)
Ffn = Callable[[jax.Array, "jax.Array | None"], jax.Array]
Exchange = Callable[[jax.Array, jax.Array, jax.Array, int, Ffn], "tuple[jax.Array, jax.Array]"]
# stage(tokens, expert_ids, combine_w, n_experts) -> (y, computed): the experts behind an exchange
Stage = Callable[[jax.Array, jax.Array, jax.Array, int], "tuple[jax.Array, jax.Array]"]


def sort_exchange(tokens, expert_ids, combine_w, n_experts: int, ffn: Ffn):
    """Copies sorted by expert with a stable argsort; ids == n_experts (padding) sort last, in no group."""
    t, d = tokens.shape
    k = expert_ids.shape[-1]
    flat_ids = expert_ids.reshape(-1)  # (T*k,) copy c = token c // k, choice c % k
    with jax.named_scope("permute"):
        order = jnp.argsort(flat_ids, stable=True)  # (T*k,) copies grouped by expert
        rows = tokens[order // k]  # (T*k, D)
        group_sizes = jnp.bincount(flat_ids, length=n_experts).astype(jnp.int32)  # (E,), drops ids >= E
    out_rows = ffn(rows, group_sizes)  # (T*k, D)
    with jax.named_scope("unpermute"):
        inverse = jnp.argsort(order)  # sorted row of each copy
        out = out_rows[inverse].reshape(t, k, d).astype(jnp.float32)  # (T, k, D)
        y = jnp.einsum("tkd,tk->td", out, combine_w)  # (T, D) float32
    return y.astype(tokens.dtype), group_sizes.sum()


def permute_exchange(tokens, expert_ids, combine_w, n_experts: int, ffn: Ffn):
    """turbo_moe.ops.permute -> ffn -> unpermute (the weighted sum over a token's copies is fused in)."""
    with jax.named_scope("permute"):
        rows, group_sizes, handle = permute(tokens, expert_ids, n_experts)  # (T*k, D), (E,)
    out_rows = ffn(rows, group_sizes)  # (T*k, D)
    with jax.named_scope("unpermute"):
        y = unpermute(out_rows, handle, combine_w)  # (T, D)
    return y, group_sizes.sum()


def expert_capacity(seq_len: int, top_k: int, n_experts: int, capacity_factor: float) -> int:
    """MaxText: int(max(ceil(seq_len * k / E) * cf, cf)) slots per expert per sequence."""
    if capacity_factor <= 0:
        raise ValueError(f"capacity_factor must be > 0 for a capacity, got {capacity_factor}")
    return int(max(math.ceil(seq_len * top_k / n_experts) * capacity_factor, capacity_factor))


def dispatch_masks(expert_ids: jax.Array, n_experts: int, capacity: int) -> tuple[jax.Array, jax.Array]:
    """kept (B, S, k, E) int32 one-hot of copies that fit; position (B, S, E) 1-based slot, 0 = none."""
    b, s, k = expert_ids.shape
    expert_mask = jax.nn.one_hot(expert_ids, n_experts, dtype=jnp.int32)  # (B, S, k, E)
    # Running count per expert over the sequence's choices in (token, choice) order.
    count = jnp.cumsum(expert_mask.reshape(b, s * k, n_experts), axis=1).reshape(b, s, k, n_experts)
    kept = expert_mask * (count <= capacity)  # (B, S, k, E)
    position = jnp.sum(kept * count, axis=2)  # (B, S, E)
    return kept, position


def capacity_exchange(tokens, expert_ids, combine_w, n_experts: int, ffn: Ffn, *, seq_len: int,
                      capacity_factor: float):
    """Each sequence of `seq_len` tokens gives every expert C slots; copies claim them in (token, choice)
    order and those past C are dropped. ffn gets slots (E, B, C, D) and group_sizes None.

    capacity_factor <= 0 uses C = seq_len: top-k picks distinct experts, so no expert gets more than S
    copies of a sequence, nothing drops, and every expert computes every token (dense)."""
    t, d = tokens.shape
    k = expert_ids.shape[-1]
    b, s = t // seq_len, seq_len
    x = tokens.reshape(b, s, d)
    expert_ids, combine_w = expert_ids.reshape(b, s, k), combine_w.reshape(b, s, k)
    capacity = expert_capacity(s, k, n_experts, capacity_factor) if capacity_factor > 0 else s
    with jax.named_scope("permute"):
        kept, position = dispatch_masks(expert_ids, n_experts, capacity)  # (B, S, k, E), (B, S, E)
        choice = jax.nn.one_hot(expert_ids, n_experts, dtype=jnp.float32)  # (B, S, k, E)
        gate = jnp.sum(choice * combine_w[..., None], axis=2)  # (B, S, E) float32, 0 if not chosen
        dispatch = jax.nn.one_hot(position, capacity + 1, dtype=x.dtype)[..., 1:]  # (B, S, E, C); slot 0 = none
        slots = jnp.einsum("bsd,bsec->ebcd", x, dispatch)  # (E, B, C, D)
    out = ffn(slots, None)  # (E, B, C, D)
    with jax.named_scope("unpermute"):
        combine = gate[..., None] * dispatch.astype(jnp.float32)  # (B, S, E, C) float32
        y = jnp.einsum("ebcd,bsec->bsd", out.astype(jnp.float32), combine)  # (B, S, D) float32
    return y.astype(x.dtype).reshape(t, d), jnp.sum(kept)
