"""quantize_rows' CUDA kernel (activations in FP8 per 1x128 tile, a warp per row) bit for bit against the CPU: the jnp
quantiser on the CPU for every input dtype, both FP8 formats, widths of 1, 5 (not a multiple of the tiles a warp loads
at once) and 56 tiles, odd M and leading dims; the CPU kernel at DeepSeek-V3's width on 65536 rows; outputs written
over poisoned memory; NaN and infinity as the CPU kernel treats them; no rows; inside a scanned loop (XLA may replay it
from a command buffer). Skipped without a GPU."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tests.gpu import GPU, requires_gpu
from tests.ops.test_quantize_rows import FP8, INPUTS, activations, bits
from turbo_moe import ops
from turbo_moe.ops.fp8_scaling import quantize_rows as quantize_rows_xla
from turbo_moe.shapes import DEEPSEEK_V3

pytestmark = requires_gpu

CPU = jax.devices("cpu")[0]

CASES = {  # name: shape of x
    "dsv3_width": (301, DEEPSEEK_V3.d_model),  # 56 tiles a row, M not a multiple of the 8 rows of a block
    "odd_tiles": (257, 640),                    # 5 tiles
    "one_tile": (1003, 128),
    "leading_dims": (2, 3, 45, 384),
}


def random_activations(shape, dtype, fp8, seed):
    x = activations(int(np.prod(shape[:-1])), shape[-1], dtype, FP8[fp8], np.random.default_rng(seed))
    return x.reshape(shape)


def on_cpu(fn, *args):
    """fn on the CPU backend: its handler there (the jitted call runs where its operands are committed)."""
    return jax.jit(fn, static_argnums=tuple(range(1, len(args))))(jax.device_put(args[0], CPU), *args[1:])


def assert_same_bits(got, want):
    for g, w in zip(got, want):
        assert g.shape == w.shape and g.dtype == w.dtype
        np.testing.assert_array_equal(bits(g), bits(w))


@pytest.mark.parametrize("fp8", FP8)
@pytest.mark.parametrize("dtype", INPUTS)
@pytest.mark.parametrize("case", CASES)
def test_kernel_matches_the_cpu_reference_bit_for_bit(case, dtype, fp8):
    x = random_activations(CASES[case], dtype, fp8, seed=list(CASES).index(case))
    run = jax.jit(ops.quantize_rows, static_argnums=1)
    assert "turbo_moe_quantize_rows" in run.lower(x, FP8[fp8]).as_text()
    q, scale = run(x, FP8[fp8])
    assert q.devices() == {GPU}
    flat = x.reshape(-1, x.shape[-1])
    q_ref, scale_ref = on_cpu(quantize_rows_xla, flat, FP8[fp8])
    assert_same_bits((q.reshape(flat.shape), scale.reshape(flat.shape[0], -1)), (q_ref, scale_ref))


@pytest.mark.parametrize("fp8", FP8)
def test_deepseek_width_on_65536_rows_matches_the_cpu_kernel(fp8):
    """65536 x 7168 bfloat16 (0.9 GB) made on the GPU: magnitudes over 16 binades a tile, tile exponents over 40."""
    m, k = 65536, DEEPSEEK_V3.d_model
    keys = jax.random.split(jax.random.key(11), 3)
    x = (jax.random.normal(keys[0], (m, k)) * jnp.exp2(jax.random.randint(keys[1], (m, k), -8, 8).astype(jnp.float32))
         * jnp.repeat(jnp.exp2(jax.random.randint(keys[2], (m, k // 128), -20, 20).astype(jnp.float32)), 128, axis=1)
         ).astype(jnp.bfloat16)
    x = x.at[::97].set(0.0)  # zero rows
    q, scale = jax.jit(ops.quantize_rows, static_argnums=1)(x, FP8[fp8])
    assert_same_bits((q, scale), on_cpu(ops.quantize_rows, x, FP8[fp8]))


def poisoned(shape, dtype):
    """An array of all-ones bits on the GPU: NaN in every FP8 and float32 lane, never a result of finite inputs."""
    wide = jnp.dtype(dtype).itemsize == 4
    raw = jnp.full(shape, 0xFFFFFFFF if wide else 0xFF, jnp.uint32 if wide else jnp.uint8)
    return jax.device_put(jax.lax.bitcast_convert_type(raw, dtype), GPU).block_until_ready()


@pytest.mark.parametrize("fp8", FP8)
def test_every_output_is_written_over_poisoned_memory(fp8):
    """The outputs are written into donated poisoned buffers (the same memory: the pointers are checked), so any
    element the kernel left unwritten would show."""
    x = random_activations((1001, 640), jnp.float32, fp8, seed=5)
    q0, scale0 = poisoned(x.shape, FP8[fp8]), poisoned((1001, 5), jnp.float32)
    pointers = (q0.unsafe_buffer_pointer(), scale0.unsafe_buffer_pointer())
    run = jax.jit(lambda q_, s_, a: ops.quantize_rows(a, FP8[fp8]), donate_argnums=(0, 1), keep_unused=True)
    q, scale = run(q0, scale0, x)
    assert (q.unsafe_buffer_pointer(), scale.unsafe_buffer_pointer()) == pointers, "outputs not in the poisoned buffers"
    assert_same_bits((q, scale), on_cpu(quantize_rows_xla, x, FP8[fp8]))


@pytest.mark.parametrize("fp8", FP8)
def test_nan_and_infinity_as_the_cpu_kernel(fp8):
    x = np.random.default_rng(6).standard_normal((9, 384)).astype(np.float32)
    x[0, 3] = np.nan
    x[1, 130] = np.inf
    x[2, 260] = -np.inf
    x[3, :128] = 0.0
    x[3, 7] = np.nan
    x[4, 200:300] = np.nan
    x = jnp.asarray(x, jnp.bfloat16)
    q, scale = jax.jit(ops.quantize_rows, static_argnums=1)(x, FP8[fp8])
    assert_same_bits((q, scale), on_cpu(ops.quantize_rows, x, FP8[fp8]))


def test_no_rows():
    for shape in [(0, 256), (4, 0, 128)]:
        q, scale = jax.jit(ops.quantize_rows)(jnp.zeros(shape, jnp.bfloat16))
        assert q.shape == shape and scale.shape == shape[:-1] + (shape[-1] // 128,) and q.devices() == {GPU}


def test_in_a_scanned_loop():
    """Each iteration quantises new rows (XLA may record the call into a command buffer it replays)."""
    xs = jnp.stack([random_activations((67, 384), jnp.bfloat16, "e4m3", seed=s) for s in range(4)])

    def body(carry, x):
        q, scale = ops.quantize_rows(x)
        return carry + scale.sum(), (q, scale)

    _, (q, scale) = jax.jit(lambda a: jax.lax.scan(body, jnp.float32(0), a))(xs)
    for i in range(xs.shape[0]):
        assert_same_bits((q[i], scale[i]), on_cpu(quantize_rows_xla, xs[i], FP8["e4m3"]))
