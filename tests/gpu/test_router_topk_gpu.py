"""The CUDA router_topk handler against the CPU handler (the same float32 steps: equal ids) and the model's XLA
path on the GPU, on the `reduced` and DeepSeek-V3 shapes. Skipped without a CUDA device:
    JAX_PLATFORMS=cuda,cpu python -m pytest tests/gpu/test_router_topk_gpu.py -q
"""
import numpy as np
import pytest

import jax
import jax.numpy as jnp

from tests.gpu import GPU, requires_gpu

pytestmark = requires_gpu

if GPU is not None:
    from turbo_moe.model import get_config
    from turbo_moe.model.router import group_limited_topk, seq_load_penalized_selection
    from turbo_moe.ops import router_topk

    CPU = jax.devices("cpu")[0]  # the CPU handler as the reference: needs JAX_PLATFORMS=cuda,cpu
# (B, S, E, top_k, n_groups, topk_groups): `reduced` at 8 x 2048 tokens; DeepSeek-V3's router at 2 x 4096; layouts
# at the edges of the lane-split walk (a full warp of groups; one group) and two it does not take (3 groups; 64
# experts in one group), which run the one-thread-per-token walk
SHAPES = {"reduced": (8, 2048, 64, 6, 8, 4), "deepseek_v3": (2, 4096, 256, 8, 8, 4), "groups_32": (2, 1000, 64, 6, 32, 8),
          "one_group_16": (3, 600, 16, 4, 1, 1), "groups_3": (4, 700, 48, 4, 3, 2), "one_group_64": (2, 500, 64, 6, 1, 1)}


def inputs(rng, B, S, E, skew):
    sel = rng.uniform(0.0, 1.0, (B, S, E)).astype(np.float32)
    if skew:  # every token prefers group 0's experts 3 and 2: the penalty has to spread them
        sel[..., 3] += 1.0
        sel[..., 2] += 0.8
    return sel, rng.normal(0, 0.05, E).astype(np.float32)


def on(device, fn, sel, bias):
    return np.asarray(fn(jax.device_put(jnp.asarray(sel), device), jax.device_put(jnp.asarray(bias), device)))


@pytest.mark.parametrize("skew", [False, True])
# chunk 128 / 100 / 7: a sequence's walk over a cluster of 8 / 8 / 7 blocks on Hopper; 1500 at S 2048: one block
# (a chunk's lanes would need more than 1024 threads per cluster block)
@pytest.mark.parametrize("penalty, chunk", [(0.1, 128), (0.0, 128), (0.5, 100), (0.1, 7), (0.1, 1500)])
@pytest.mark.parametrize("shape", list(SHAPES))
def test_cuda_equals_the_cpu_handler(shape, penalty, chunk, skew):
    B, S, E, k, G, tg = SHAPES[shape]
    sel, bias = inputs(np.random.default_rng(), B, S, E, skew)
    fn = jax.jit(lambda s, b: router_topk(s, b, top_k=k, n_groups=G, topk_groups=tg, penalty=penalty, chunk=chunk))
    gpu, cpu = on(GPU, fn, sel, bias), on(CPU, fn, sel, bias)
    assert gpu.dtype == np.int32 and gpu.shape == (B, S, k)
    np.testing.assert_array_equal(gpu, cpu)
    if skew and penalty > 0 and chunk < S:  # the penalty (from the second chunk on) spreads the boosted expert's picks
        plain = on(CPU, jax.jit(lambda s, b: router_topk(s, b, top_k=k, n_groups=G, topk_groups=tg)), sel, bias)
        assert np.sum(gpu == 3) < np.sum(plain == 3), (np.sum(gpu == 3), np.sum(plain == 3))


@pytest.mark.parametrize("penalty", [0.0, 0.1])
@pytest.mark.parametrize("shape", list(SHAPES))
def test_cuda_matches_the_xla_path_on_the_gpu(shape, penalty):
    """Without the penalty the arithmetic is one add: equal. With it, XLA:GPU may fuse `x - p * m` into an fma
    (the kernel follows XLA:CPU): an ulp apart, a near-tie can flip and move that sequence's later counts."""
    B, S, E, k, G, tg = SHAPES[shape]
    sel, bias = inputs(np.random.default_rng(), B, S, E, skew=False)
    cfg = get_config("tiny", n_experts=E, top_k=k, n_groups=G, topk_groups=tg, max_seq_len=S)

    def xla(s, b):
        return group_limited_topk(seq_load_penalized_selection(s, b, cfg, penalty, 128) if penalty > 0 else s, b,
                                  top_k=k, n_groups=G, topk_groups=tg)

    kernel = on(GPU, jax.jit(lambda s, b: router_topk(s, b, top_k=k, n_groups=G, topk_groups=tg, penalty=penalty,
                                                      chunk=128)), sel, bias)
    expect = on(GPU, jax.jit(xla), sel, bias)
    differ = float((kernel != expect).any(-1).mean())
    print(f"{shape} penalty {penalty}: {differ:.2e} of tokens differ from the XLA path")
    assert differ == 0.0 if penalty == 0 else differ < 1e-2


def test_vmap_and_empty_on_the_gpu():
    E, k, G, tg = 64, 6, 8, 4
    rng = np.random.default_rng()
    sel = rng.uniform(0, 1, (3, 2, 300, E)).astype(np.float32)
    bias = rng.normal(0, 0.3, (3, E)).astype(np.float32)
    fn = jax.jit(jax.vmap(lambda s, b: router_topk(s, b, top_k=k, n_groups=G, topk_groups=tg, penalty=0.2,
                                                   chunk=64)))
    np.testing.assert_array_equal(on(GPU, fn, sel, bias), on(CPU, fn, sel, bias))
    for shape in ((2, 0, E), (0, 5, E)):
        out = router_topk(jax.device_put(jnp.zeros(shape), GPU), jax.device_put(jnp.zeros(E), GPU), top_k=k,
                          n_groups=G, topk_groups=tg, penalty=0.1)
        assert out.shape == shape[:2] + (k,)



def test_inside_a_scan_of_a_larger_program():
    """The walk as the model runs it: inside a jitted scan between matmuls and fusions, where XLA may record it
    into a command buffer (a CUDA graph: the cluster launch must keep its cluster shape there), layer after layer,
    each layer's picks feeding the next. Each layer's selection comes back too: the CPU handler on it must pick
    the same, bit for bit."""
    B, S, D, E, k, G, tg = 4, 512, 64, 64, 6, 8, 4
    rng = np.random.default_rng()
    x = rng.standard_normal((B, S, D)).astype(np.float32)
    gates = (rng.standard_normal((3, D, E)) / np.sqrt(D)).astype(np.float32)
    bias = rng.normal(0, 0.05, E).astype(np.float32)
    topk = dict(top_k=k, n_groups=G, topk_groups=tg, penalty=0.1, chunk=32)

    def layers(x, gates, bias):
        def layer(h, gate):
            sel = jax.nn.sigmoid(h @ gate)
            ids = router_topk(sel, bias, **topk)
            picked = jnp.take_along_axis(sel, ids, axis=-1).sum(-1, keepdims=True)  # the picks steer the next layer
            return jnp.tanh(h + picked), (sel, ids)
        return jax.lax.scan(layer, x, gates)[1]

    args = [jax.device_put(jnp.asarray(a), GPU) for a in (x, gates, bias)]
    sel, ids = jax.jit(layers)(*args)
    assert ids.shape == (3, B, S, k)
    np.testing.assert_array_equal(np.asarray(jax.jit(layers)(*args)[1]), np.asarray(ids))  # run to run
    cpu = jax.jit(jax.vmap(lambda s, b: router_topk(s, b, **topk), in_axes=(0, None)))
    np.testing.assert_array_equal(np.asarray(ids), on(CPU, cpu, np.asarray(sel), bias))
