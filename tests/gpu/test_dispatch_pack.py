"""The CUDA dispatch_pack handler (expert-parallel packing) against the CPU handler, bit for bit.

Packing only moves data and assigns slots in token order, so both backends must agree exactly.
The pack is called directly with P > 1 ranks on one GPU (no collective needed). Skipped without a GPU.
"""
import numpy as np
import pytest

import jax
import jax.numpy as jnp

from tests.gpu import GPU, requires_gpu

pytestmark = requires_gpu

if GPU is not None:
    from turbo_moe.ops.moe_dispatch import _pack_call

CPU = jax.devices("cpu")[0]


def pack_on(device, x, ids, w, P, El, C):
    args = [jax.device_put(a, device) for a in (x, ids, w)]
    return [np.asarray(o) for o in jax.jit(_pack_call, static_argnums=(3, 4, 5), device=device)(*args, P, El, C)]


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
@pytest.mark.parametrize("T, H, k, P, El, C, kind", [
    (1000, 72, 4, 4, 8, 1000, "random"),      # worst-case capacity, odd H
    (4096, 256, 8, 8, 32, 4096, "random"),    # DeepSeek-like top-8 over 8 ranks
    (777, 64, 2, 2, 4, 100, "skewed"),        # capacity hint: overflow counted
    (300, 40, 3, 4, 2, 300, "invalid"),       # out-of-range ids dropped
])
def test_cuda_pack_matches_cpu(dtype, T, H, k, P, El, C, kind):
    rng = np.random.default_rng(T + k)
    E = P * El
    if kind == "skewed":
        ids = rng.integers(0, El, (T, k))  # everything to rank 0
    elif kind == "invalid":
        ids = rng.integers(-2, E + 3, (T, k))
    else:
        ids = np.stack([rng.choice(E, k, replace=False) for _ in range(T)])
    x = jnp.asarray(rng.normal(size=(T, H)), dtype)
    w = jnp.asarray(rng.random((T, k)), jnp.float32)
    ids = jnp.asarray(ids, jnp.int32)
    gpu = pack_on(GPU, x, ids, w, P, El, C)
    cpu = pack_on(CPU, x, ids, w, P, El, C)
    names = ["send_x", "send_ids", "send_w", "counts", "overflow", "slot"]
    for name, g, c in zip(names, gpu, cpu):
        np.testing.assert_array_equal(g, c, err_msg=name)
    if kind == "skewed":
        assert int(cpu[4][0]) == T - C and int(cpu[3][0]) == C
