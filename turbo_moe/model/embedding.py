"""Token embedding lookup whose backward is `turbo_moe.ops.segment_sum`.

The gradient of `table[ids]` is a scatter-add of the B*S rows of d_hidden into the (V, D) table. XLA's GPU scatter adds
with atomics, so the rows of frequent tokens serialise on real text (Zipf-like ids). `segment_sum` sorts the ids and sums
each id's rows in float32 in a fixed order: deterministic, and its cost is tokens x D whatever V and the ids
(docs/performance.md has the measurements that decided it over the scatter and a one-hot matmul).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from turbo_moe.model.mesh import batch_summed
from turbo_moe.ops.segment_sum import segment_sum


def lookup(table: jax.Array, ids: jax.Array) -> jax.Array:
    """table (V, D), integer ids (...) -> (..., D), with the segment-sum backward."""
    return _lookup_segment_grad(table, ids)


@jax.custom_vjp
def _lookup_segment_grad(table, ids):
    return jnp.take(table, ids, axis=0)


def _fwd(table, ids):
    return jnp.take(table, ids, axis=0), (ids, jnp.zeros((0,), table.dtype), table.shape[0])


def _segment_bwd(res, g):
    ids, table_type, vocab = res
    d = g.shape[-1]

    def local(part_g, part_ids):  # the per-device sum on a mesh (XLA would gather the batch for the FFI call)
        return segment_sum(part_g.reshape(-1, d), part_ids.reshape(-1), vocab)

    if ids.ndim == 0:  # one id: give it the batch axis that batch_summed splits
        g, ids = g[None], ids[None]
    return batch_summed(local)(g, ids).astype(table_type.dtype), None


_lookup_segment_grad.defvjp(_fwd, _segment_bwd)
