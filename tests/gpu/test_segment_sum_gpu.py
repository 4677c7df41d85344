"""The CUDA segment_sum handler against the CPU handler (the same float32 additions in the same order: equal bits),
float64 and jax.ops.segment_sum on the GPU, at the embedding backward's shapes (`reduced`, DeepSeek-V3's vocab and
width) on uniform and Zipf ids. Skipped without a CUDA device:
    JAX_PLATFORMS=cuda,cpu python -m pytest tests/gpu/test_segment_sum_gpu.py -q
"""
import numpy as np
import pytest

import jax
import jax.numpy as jnp

from tests.gpu import GPU, requires_gpu
from turbo_moe.shapes import DEEPSEEK_V3, REDUCED

pytestmark = requires_gpu

if GPU is not None:
    from turbo_moe.ops import segment_sum

    CPU = jax.devices("cpu")[0]  # the CPU handler as the reference: needs JAX_PLATFORMS=cuda,cpu

# (N rows, D, V): `reduced`'s 8 x 2048 tokens at its vocab and Shakespeare's, DeepSeek-V3's vocab at d 1280 and its
# width at a small vocab, and widths that take the scalar loads (D * 2 bytes not a multiple of 16)
SHAPES = {"reduced": (16384, REDUCED.d_model, 32768), "shakespeare": (16384, REDUCED.d_model, 8192),
          "v3_vocab": (16384, REDUCED.d_model, 129280), "v3_width": (4096, DEEPSEEK_V3.d_model, 8192),
          "odd_width": (3000, 13, 500), "one_column": (2000, 1, 64)}


def ids_for(rng, n, vocab, dist):
    if dist == "uniform":
        return rng.integers(0, vocab, n).astype(np.int32)
    ids = np.minimum(rng.zipf(1.1, n) - 1, vocab - 1).astype(np.int32)  # the top id takes ~1/4 of the rows
    ids[rng.random(n) < 0.01] = -1  # dropped
    return ids


def on(device, data, ids, vocab):
    fn = jax.jit(lambda x, i: segment_sum(x, i, vocab))
    return np.asarray(fn(jax.device_put(data, device), jax.device_put(jnp.asarray(ids), device)), np.float32)


@pytest.mark.parametrize("dist", ["uniform", "zipf"])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
@pytest.mark.parametrize("shape", list(SHAPES))
def test_cuda_equals_the_cpu_handler_and_float64(shape, dtype, dist):
    n, d, vocab = SHAPES[shape]
    rng = np.random.default_rng()
    data = jnp.asarray(rng.standard_normal((n, d)), dtype)
    ids = ids_for(rng, n, vocab, dist)
    gpu = on(GPU, data, ids, vocab)
    np.testing.assert_array_equal(gpu, on(CPU, data, ids, vocab))
    expect = np.zeros((vocab, d))
    keep = ids >= 0
    np.add.at(expect, ids[keep], np.asarray(data, np.float64)[keep])
    err = np.abs(gpu - expect).max() / np.abs(expect).max()
    assert err < (8e-3 if dtype == jnp.bfloat16 else 2e-6), err


def test_repeat_calls_give_the_same_bits_and_match_jax():
    rng = np.random.default_rng()
    data = jax.device_put(jnp.asarray(rng.standard_normal((16384, 1280)), jnp.bfloat16), GPU)
    ids = jax.device_put(jnp.asarray(ids_for(rng, 16384, 8192, "zipf")), GPU)
    fn = jax.jit(lambda x, i: segment_sum(x, i, 8192))
    first = np.asarray(fn(data, ids), np.float32)
    for _ in range(3):
        np.testing.assert_array_equal(np.asarray(fn(data, ids), np.float32), first)
    theirs = np.asarray(jax.jit(lambda x, i: jax.ops.segment_sum(x.astype(jnp.float32), i, 8192))(data, ids))
    np.testing.assert_allclose(first, theirs, rtol=8e-3, atol=8e-3 * np.abs(theirs).max())


def test_vmap_and_empty_on_the_gpu():
    rng = np.random.default_rng()
    data = jnp.asarray(rng.standard_normal((3, 500, 24)), jnp.float32)
    ids = jnp.asarray(rng.integers(-1, 30, (3, 500)), jnp.int32)
    fn = jax.jit(jax.vmap(lambda x, i: segment_sum(x, i, 29)))
    got = np.asarray(fn(jax.device_put(data, GPU), jax.device_put(ids, GPU)))
    np.testing.assert_array_equal(got, np.asarray(fn(jax.device_put(data, CPU), jax.device_put(ids, CPU))))
    empty = segment_sum(jax.device_put(jnp.zeros((0, 8), jnp.bfloat16), GPU), jax.device_put(jnp.zeros((0,), jnp.int32), GPU), 5)
    np.testing.assert_array_equal(np.asarray(empty, np.float32), np.zeros((5, 8)))
