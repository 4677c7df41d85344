"""Run-to-run determinism on the GPU: each op of a training step run several times on the same inputs gives the same
bits (skewed routing included), XLA's and cuDNN's non-deterministic ops repeat once compiled with
`turbo_moe.train.determinism.GPU_OPTIONS`, and a `TrainConfig(deterministic=True)` run repeats bit for bit
(losses, gradient norms, the final state's digest). docs/notes/determinism.md says which ops differ without the
option and why. Skipped without a CUDA device:
    JAX_PLATFORMS=cuda,cpu python -m pytest tests/gpu/test_determinism_gpu.py -q -s
(-s prints which ops differed between repeats under the default options: observed, not asserted).
"""
import numpy as np
import pytest

import jax
import jax.numpy as jnp

from tests.gpu import GPU, requires_gpu

pytestmark = requires_gpu

if GPU is not None:
    from turbo_moe import ops
    from turbo_moe.model.layers import causal_attention
    from turbo_moe.ops.swiglu_combine_grad import swiglu_combine_grad
    from turbo_moe.train import TrainConfig, run
    from turbo_moe.train.determinism import GPU_OPTIONS, DeterministicAttention
    from turbo_moe.train.scan_outputs import supported, uninitialized_scan_outputs
    from turbo_moe.train.step import make_optimizer

REPEATS = 4
T, K, D, F, E = 8192, 6, 1280, 512, 64  # `reduced`'s MoE layer at 4 x 2048 tokens
BF16 = jnp.bfloat16


def bits(tree) -> list[bytes]:
    return [np.asarray(leaf).tobytes() for leaf in jax.tree.leaves(jax.device_get(tree))]


def repeated(fn, *args, options=None, times=REPEATS) -> list[list[bytes]]:
    jitted = jax.jit(fn, compiler_options=options)
    return [bits(jitted(*args)) for _ in range(times)]


def same(runs: list[list[bytes]]) -> bool:
    return all(run == runs[0] for run in runs[1:])


def assert_repeats(fn, *args, options=None):
    runs = repeated(fn, *args, options=options)
    differing = [i for i in range(len(runs[0])) if any(run[i] != runs[0][i] for run in runs[1:])]
    assert not differing, f"outputs {differing} differ between {REPEATS} runs on the same inputs"
    return runs[0]


def skewed_ids(rng, t=T, k=K, e=E):
    """Zipf-like routing: expert 0 takes about a third of the copies, the tail experts none, a few copies dropped."""
    ids = np.minimum(rng.zipf(1.3, (t, k)) - 1, e - 1)
    ids[:, 0] = 0
    ids = np.where(ids >= e - 8, 3, ids)  # the last 8 experts get no rows
    ids[rng.random((t, k)) < 0.01] = -1  # dropped copies
    return jnp.asarray(ids, jnp.int32)


@pytest.fixture(scope="module")
def moe():
    rng = np.random.default_rng(0)
    put = lambda a, dtype=BF16: jax.device_put(jnp.asarray(a, dtype), GPU)
    return dict(x=put(rng.standard_normal((T, D))), ids=jax.device_put(skewed_ids(rng), GPU),
                w=put(rng.uniform(0.1, 1.0, (T, K)), jnp.float32),
                w_gate_up=put(rng.standard_normal((E, D, 2 * F)) * 0.03), w_down=put(rng.standard_normal((E, F, D)) * 0.03),
                g=put(rng.standard_normal((T, D))))


def grads_of(fn, argnums):
    return jax.value_and_grad(lambda *a: jnp.sum(fn(*a).astype(jnp.float32) ** 2), argnums)


# ---------------------------------------------------------------- our FFI ops: deterministic by construction


@pytest.mark.parametrize("dtype", [BF16, jnp.float32])  # bf16: the Hopper CUTLASS kernels; float32: the portable ones
def test_grouped_gemm_and_both_gradients_repeat(moe, dtype):
    rows, sizes, _ = ops.permute(moe["x"].astype(dtype), moe["ids"], E)
    assert_repeats(grads_of(lambda r, w: ops.grouped_gemm(r, w, sizes), (0, 1)), rows, moe["w_gate_up"].astype(dtype))


def test_grouped_gemm_swiglu_repeats(moe):
    rows, sizes, _ = ops.permute(moe["x"], moe["ids"], E)
    fn = lambda r, w: ops.grouped_gemm_swiglu(r, w, sizes)[1]
    assert_repeats(grads_of(fn, (0, 1)), rows, moe["w_gate_up"])


def test_permute_unpermute_and_their_gradients_repeat(moe):
    def fn(x, w):
        rows, _, handle = ops.permute(x, moe["ids"], E)
        return ops.unpermute(rows * 1.5, handle, w)
    assert_repeats(grads_of(fn, (0, 1)), moe["x"], moe["w"])


def test_expert_block_forward_and_backward_repeat(moe):
    """permute -> grouped_gemm_swiglu -> grouped_gemm -> unpermute; backward: permute_rows, swiglu_combine_grad,
    both weight gradients, the data gradients."""
    fn = lambda x, w, wg, wd: ops.expert_block(x, moe["ids"], w, wg, wd)[0]
    assert_repeats(grads_of(fn, (0, 1, 2, 3)), moe["x"], moe["w"], moe["w_gate_up"], moe["w_down"])


def test_swiglu_combine_grad_repeats(moe):
    rng = np.random.default_rng(1)
    h = jax.device_put(jnp.asarray(rng.standard_normal((T * K, 2 * F)), BF16), GPU)
    g = jax.device_put(jnp.asarray(rng.standard_normal((T * K, F)), BF16), GPU)
    assert_repeats(lambda h, g, w: swiglu_combine_grad(h, g, w), h, g, moe["w"].reshape(-1))


@pytest.mark.parametrize("zipf", [False, True])
def test_segment_sum_and_its_gradient_repeat(moe, zipf):
    rng = np.random.default_rng(2)
    vocab = 32768
    ids = np.minimum(rng.zipf(1.1, T) - 1, vocab - 1) if zipf else rng.integers(0, vocab, T)
    ids = jax.device_put(jnp.asarray(ids, jnp.int32), GPU)
    assert_repeats(grads_of(lambda x: ops.segment_sum(x, ids, vocab), 0), moe["x"])


@pytest.mark.parametrize("penalty", [0.0, 0.1])  # 0.1: the chunked walk (a cluster of blocks per sequence)
def test_router_topk_repeats(penalty):
    rng = np.random.default_rng(3)
    sel = rng.uniform(0, 1, (4, 2048, E)).astype(np.float32)
    sel[..., 3] += 1.0  # skewed: every token prefers expert 3
    args = [jax.device_put(jnp.asarray(a), GPU) for a in (sel, rng.normal(0, 0.05, E).astype(np.float32))]
    assert_repeats(lambda s, b: ops.router_topk(s, b, top_k=K, n_groups=8, topk_groups=4, penalty=penalty), *args)


def test_moe_dispatch_and_combine_repeat(moe):
    mesh = jax.sharding.Mesh(np.array([GPU]), ("expert",))
    spec = jax.sharding.PartitionSpec("expert")

    def layer(x, w):
        rx, rids, rw, handle = ops.moe_dispatch(x, moe["ids"], w, num_experts=E, axis_name="expert")
        rows, sizes, ph = ops.permute(rx, rids, E)
        return ops.moe_combine(ops.unpermute(rows * 2, ph, rw), handle, axis_name="expert")

    fn = jax.shard_map(layer, mesh=mesh, in_specs=(spec, spec), out_specs=spec)
    assert_repeats(grads_of(fn, (0, 1)), moe["x"], moe["w"])


@pytest.mark.skipif(not str(getattr(GPU, "compute_capability", "")).startswith("9"), reason="FP8 kernels need Hopper")
def test_fp8_quantize_ops_and_gemm_repeat(moe):
    sizes = ops.permute_fp8(moe["x"], moe["ids"], E)[2]
    assert_repeats(lambda x: ops.permute_fp8(x, moe["ids"], E)[:2], moe["x"])
    assert_repeats(lambda x: ops.quantize_group_columns(x, sizes), moe["g"].repeat(K, axis=0)[: T * K])
    rows, sizes, _ = ops.permute(moe["x"], moe["ids"], E)
    w = moe["w_gate_up"][:, :, :1024]
    assert_repeats(grads_of(lambda r, w: ops.grouped_gemm_fp8(r, w, sizes), (0, 1)), rows, w)


def test_uninitialized_scan_outputs_repeat():
    if not supported():
        pytest.skip("this JAX's scan does not build its outputs the way scan_outputs replaces")
    xs = jax.device_put(jnp.asarray(np.random.default_rng(4).standard_normal((16, 512, 1024)), BF16), GPU)

    def fn(xs):
        return jax.lax.scan(lambda c, x: (c + x.sum(), jnp.tanh(x) * c), jnp.zeros((), BF16), xs)

    with uninitialized_scan_outputs():
        lowered = jax.jit(jax.grad(lambda xs: fn(xs)[1].astype(jnp.float32).sum())).lower(xs)
    compiled = lowered.compile()
    runs = [bits(compiled(xs)) for _ in range(REPEATS)]
    assert same(runs)


# ---------------------------------------------------------------- XLA's and cuDNN's ops, the optimizer


def zipf_rows(seed, n=T * K, vocab=8192):
    rng = np.random.default_rng(seed)
    ids = jax.device_put(jnp.asarray(np.minimum(rng.zipf(1.1, n) - 1, vocab - 1), jnp.int32), GPU)
    rows = jax.device_put(jnp.asarray(rng.standard_normal((n, 256)), jnp.float32), GPU)
    return ids, rows, vocab


def scatter_add(ids, rows, vocab):
    return jnp.zeros((vocab, rows.shape[1]), rows.dtype).at[ids].add(rows)


def report(name, runs):
    print(f"\n[default options] {name}: {'repeats' if same(runs) else 'DIFFERS between repeats'}")


def test_scatter_add_repeats_under_the_options_and_stays_right():
    ids, rows, vocab = zipf_rows(5)
    fn = lambda i, r: scatter_add(i, r, vocab)
    report("scatter-add (Zipf ids)", repeated(fn, ids, rows))
    got = np.frombuffer(assert_repeats(fn, ids, rows, options=GPU_OPTIONS)[0], np.float32)
    want = np.zeros((vocab, 256))
    np.add.at(want, np.asarray(ids), np.asarray(rows, np.float64))
    np.testing.assert_allclose(got.reshape(vocab, 256), want, rtol=1e-4, atol=1e-3)


def test_scatter_set_under_the_options_equals_the_default():
    """The model's scatter-set (the expert block's combine weights by row, index 0 and dropped entries included): the
    options' sort-based scatter must write what the default one writes."""
    rng = np.random.default_rng(6)
    n = T * K
    rows = rng.permutation(n).astype(np.int32)
    rows[rng.random(n) < 0.02] = n  # dropped: out of range
    args = [jax.device_put(jnp.asarray(a), GPU) for a in (rows, rng.uniform(0.1, 1, n).astype(np.float32))]
    fn = lambda r, v: jnp.zeros((n,), jnp.float32).at[r].set(v, mode="drop")
    default = bits(jax.jit(fn)(*args))
    assert assert_repeats(fn, *args, options=GPU_OPTIONS) == default


def test_reductions_repeat():
    x = jax.device_put(jnp.asarray(np.random.default_rng(7).standard_normal((16384, 4096)), jnp.float32), GPU)
    assert_repeats(lambda x: (x.sum(), x.sum(0), x.sum(1), jnp.linalg.norm(x)), x)


def two_attention_layers(q, k, v):
    """Two cuDNN attention calls of one shape (MLA's head dims): identical fMHA backward calls, the case that made
    XLA's deterministic option crash."""
    o = causal_attention(q, k, v)  # (B, S, H, Dv)
    o = causal_attention(jnp.concatenate([o, o[..., :32]], -1), k, v)
    return o


@pytest.fixture(scope="module")
def qkv():
    rng = np.random.default_rng(8)
    shapes = [(4, 2048, 16, 96), (4, 2048, 16, 96), (4, 2048, 16, 64)]
    return [jax.device_put(jnp.asarray(rng.standard_normal(s), BF16), GPU) for s in shapes]


def test_cudnn_attention_backward_repeats_under_the_options(qkv):
    fn = grads_of(two_attention_layers, (0, 1, 2))
    report("cuDNN attention forward + backward", repeated(fn, *qkv))
    program = DeterministicAttention(jax.jit(fn, compiler_options=GPU_OPTIONS))
    runs = [bits(program(*qkv)) for _ in range(REPEATS)]
    assert same(runs)
    default = jax.jit(fn)(*qkv)[1]
    for got, want in zip(program(*qkv)[1], default):
        got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
        assert np.abs(got - want).max() <= 2e-2 * np.abs(want).max()


def test_optimizer_update_repeats():
    tx = make_optimizer(TrainConfig(model="tiny", moments_dtype="bfloat16", grad_clip=1.0))
    rng = np.random.default_rng(9)
    params = {"w": jax.device_put(jnp.asarray(rng.standard_normal((4096, 4096)), jnp.float32), GPU),
              "b": jax.device_put(jnp.asarray(rng.standard_normal((4096,)), jnp.float32), GPU)}
    grads = jax.tree.map(lambda p: p * 1e-2 + 1e-3, params)
    state = tx.init(params)
    assert_repeats(lambda g, s, p: tx.update(g, s, p), grads, state, params)


# ---------------------------------------------------------------- a whole run


def small_reduced(deterministic: bool) -> "TrainConfig":
    """`reduced`'s layers (a dense layer, MoE layers in a scan, the MTP layer: several identical attention calls),
    fewer of them, on synthetic tokens."""
    return TrainConfig(model="reduced", model_overrides={"n_layers": 3}, seq_len=1024, per_device_batch=4, steps=8,
                       warmup_steps=1, dataset="synthetic", eval_batches=0, progress=False, seed=5,
                       deterministic=deterministic)


def fingerprint(result):
    assert result.status == "ok", result.error
    return ([row["loss"] for row in result.history], [row["grad_norm"] for row in result.history],
            result.summary["state_digest"])


def test_a_deterministic_run_repeats_bit_for_bit():
    first, second = (fingerprint(run(small_reduced(True))) for _ in range(2))
    assert first == second
    losses = [[row["loss"] for row in run(small_reduced(False)).history] for _ in range(2)]
    print(f"\n[default options] small reduced run: losses {'repeat' if losses[0] == losses[1] else 'DIFFER'}: {losses}")
