"""DeepSeekModel end to end on micro configs: shapes, causality, path equivalence, remat, training; the stacked
weights cast before the layer scan; the router recipe's output-head bias (`head_bias`) and zero-initialised out
projections (`zero_init_out_proj`); the remat policy "dots_experts_attention" (same loss and gradients, and neither
the expert GEMMs nor the routing run again in the backward pass)."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from tests.model.conftest import ALL_PATHS, micro_config, model_paths_with, requires_turbo, router_recipe_with
from turbo_moe.data import PackedSequences, SyntheticSequences, unigram_log_prior
from turbo_moe.model import DeepSeekModel, RouterBias, get_config, lm_loss, update_router_bias
from turbo_moe.model.chunked_loss import chunked_cross_entropy
from turbo_moe.model import stack
from turbo_moe.ops.fp8_scaling import Fp8Weights
from turbo_moe.model.model import cross_entropy


def make_batch(cfg, batch=2, seq=16, seed=0):
    tokens = jax.random.randint(jax.random.key(seed), (batch, seq + 1), 0, cfg.vocab_size)
    return {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}


def loss_and_grads(model, batch):
    return nnx.jit(nnx.value_and_grad(lm_loss, has_aux=True))(model, batch)


def test_forward_shapes_load_and_causality():
    cfg = micro_config(dtype="float32", moe_path="ragged")
    model = DeepSeekModel(cfg, rngs=nnx.Rngs(0))
    inputs = make_batch(cfg)["inputs"]
    forward = nnx.jit(lambda m, x: m(x))
    out = forward(model, inputs)
    assert out.logits.shape == (2, 16, cfg.vocab_size) and out.logits.dtype == jnp.float32
    assert len(out.mtp_logits) == cfg.mtp_depth and out.mtp_logits[0].shape == out.logits.shape
    assert out.moe.expert_load.shape == (cfg.n_router_layers, cfg.n_experts) == (2, cfg.n_experts)
    np.testing.assert_array_equal(out.moe.expert_load.sum(-1), 2 * 16 * cfg.top_k)
    assert np.isfinite(np.asarray(out.logits)).all()

    changed = inputs.at[:, 10].set((inputs[:, 10] + 1) % cfg.vocab_size)
    a, b = out.logits, forward(model, changed).logits
    np.testing.assert_allclose(a[:, :10], b[:, :10], rtol=1e-5, atol=1e-5)
    assert not np.allclose(a[:, 10:], b[:, 10:])


def path_results(path):
    cfg = micro_config(dtype="float32", moe_path=path, capacity_factor=8.0)  # cf = E: nothing drops
    model = DeepSeekModel(cfg, rngs=nnx.Rngs(0))  # same seed and structure: same parameters for every path
    return loss_and_grads(model, make_batch(cfg))


@pytest.fixture(scope="module")
def ragged_results():
    return path_results("ragged")


@pytest.mark.parametrize("path", [p for p in ALL_PATHS if p != "ragged"])
def test_paths_give_same_loss_and_grads_for_same_params(path, ragged_results):
    (loss, metrics), grads = path_results(path)
    (ref_loss, ref_metrics), ref_grads = ragged_results
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-5)
    assert float(metrics["dropped_fraction"]) == 0.0
    np.testing.assert_array_equal(metrics["expert_load"], ref_metrics["expert_load"])
    flat, ref_flat = nnx.to_flat_state(grads), nnx.to_flat_state(ref_grads)
    for (name, g), (_, r) in zip(flat, ref_flat):
        np.testing.assert_allclose(g[...], r[...], rtol=2e-4, atol=1e-6, err_msg=f"{path}: {name}")


def test_remat_does_not_change_loss_or_grads(ragged_results):
    cfg = micro_config(dtype="float32", moe_path="ragged", capacity_factor=8.0, remat_policy="dots_no_batch")
    (loss, _), grads = loss_and_grads(DeepSeekModel(cfg, rngs=nnx.Rngs(0)), make_batch(cfg))
    (ref_loss, _), ref_grads = ragged_results
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-6)
    for g, r in zip(jax.tree.leaves(grads), jax.tree.leaves(ref_grads)):
        np.testing.assert_allclose(g, r, rtol=1e-5, atol=1e-7)


def test_training_steps_reduce_loss_and_update_router_bias():
    cfg = micro_config(moe_path="dense_cf", capacity_factor=1.0)  # bfloat16 compute, float32 params
    model = DeepSeekModel(cfg, rngs=nnx.Rngs(0))
    assert all(p.dtype == jnp.float32 for p in jax.tree.leaves(nnx.state(model, nnx.Param)))
    # The router bias is not a parameter: the optimizer never sees it.
    assert not any(isinstance(v, RouterBias) for v in jax.tree.leaves(
        nnx.state(model, nnx.Param), is_leaf=lambda x: isinstance(x, nnx.Variable)))
    optimizer = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)
    batch = make_batch(cfg)

    @nnx.jit
    def train_step(model, optimizer, batch):
        (loss, metrics), grads = nnx.value_and_grad(lm_loss, has_aux=True)(model, batch)
        optimizer.update(model, grads)
        return loss, metrics

    losses = []
    for _ in range(8):
        loss, metrics = train_step(model, optimizer, batch)
        update_router_bias(model, metrics["expert_load"])
        losses.append(float(loss))
    assert losses[-1] < losses[0] - 0.5, losses
    assert 0.0 <= float(metrics["dropped_fraction"]) < 1.0
    biases = np.asarray(model.router_bias_table())
    assert biases.shape == (2, cfg.n_experts) and np.abs(biases).max() > 0


def test_bad_inputs_raise_clear_errors():
    cfg = micro_config()
    model = DeepSeekModel(cfg, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="max_seq_len"):
        model(jnp.zeros((1, 17), jnp.int32))
    with pytest.raises(ValueError, match="inputs"):
        model(jnp.zeros((1, 4), jnp.float32))
    with pytest.raises(ValueError, match="expert_load"):
        update_router_bias(model, jnp.zeros((3, cfg.n_experts)))
    with pytest.raises(ValueError, match="targets"):
        lm_loss(model, {"inputs": jnp.zeros((1, 4), jnp.int32)})


# ------------------------------------------------------------------ the stacked weights cast before the layer scan
# The stacked matmul weights are cast to the compute dtype once before the layer scan. Rounding to bfloat16 commutes
# with slicing a layer out, and the cast's gradient (a cast back) commutes with stacking the per-layer gradients, so
# loss and gradients are bit-identical to casting each layer's slice inside the scan.

def _config(**overrides):
    # bfloat16 compute, float32 params (tiny's defaults); 2 MoE blocks in the scanned stack + an MoE MTP block
    return get_config("tiny", n_layers=3, max_seq_len=16, capacity_factor=1.0, **overrides)


def _loss_and_grads(cfg):
    model = DeepSeekModel(cfg, rngs=nnx.Rngs(0))
    tokens = jax.random.randint(jax.random.key(1), (2, 17), 0, cfg.vocab_size)
    batch = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}
    (loss, metrics), grads = nnx.jit(nnx.value_and_grad(lm_loss, has_aux=True))(model, batch)
    return loss, metrics, nnx.to_flat_state(grads)


def _case(path, remat="none"):
    marks = requires_turbo if path == "turbo" else ()
    return pytest.param(path, remat, marks=marks, id=f"{path}-{remat}")


# Each path once, and turbo under `reduced`'s remat policy (the cast sits outside the rematerialised block); CI time.
@pytest.mark.parametrize("path, remat", [_case("dense_cf"), _case("turbo"), _case("turbo", "dots_no_batch")])
def test_loss_and_grads_bit_identical(path, remat, monkeypatch):
    cfg = _config(moe_path=path, remat_policy=remat)
    cast_loss, cast_metrics, cast_grads = _loss_and_grads(cfg)  # the model as it runs
    # the reference: each layer's slice cast inside the scan
    monkeypatch.setattr(stack, "cast_stacked_weights", lambda blocks, state, dtype: state)
    loss, metrics, grads = _loss_and_grads(cfg)
    np.testing.assert_array_equal(cast_loss, loss)
    np.testing.assert_array_equal(cast_metrics["expert_load"], metrics["expert_load"])
    assert len(grads) == len(cast_grads)
    for (name, g), (cast_name, c) in zip(grads, cast_grads):
        assert name == cast_name and c[...].dtype == g[...].dtype == jnp.float32
        np.testing.assert_array_equal(c[...], g[...], err_msg=f"{path}: {name}")


def test_only_the_weights_cast_at_use_are_cast():
    cfg = _config(moe_path="dense_cf")
    model = DeepSeekModel(cfg, rngs=nnx.Rngs(0))
    moe_stack = model.moe_layers
    _, state = nnx.split(moe_stack.blocks)
    cast = {path: var[...]
            for path, var in nnx.to_flat_state(stack.cast_stacked_weights(moe_stack.blocks, state, jnp.bfloat16))}
    bf16 = {path for path, value in cast.items() if value.dtype == jnp.bfloat16}
    assert bf16 == {
        ("attn", name, "kernel") for name in ("wq_a", "wq_b", "wkv_a", "wkv_b", "wo")} | {
        ("ffn", "shared", name, "kernel") for name in ("wi_gate", "wi_up", "wo")} | {
        ("ffn", "experts", "w_gate_up"), ("ffn", "experts", "w_down")}
    # norm scales, the float32 router gate and its bias stay float32, each with its stacked shape
    for path in (("attn_norm", "scale"), ("attn", "kv_norm", "scale"), ("ffn", "router", "kernel"),
                 ("ffn", "router", "bias")):
        assert cast[path].dtype == jnp.float32
    original = dict(nnx.to_flat_state(state))
    for path, value in cast.items():
        assert value.shape == original[path][...].shape
        np.testing.assert_array_equal(value, original[path][...].astype(value.dtype))
    assert original[("attn", "wo", "kernel")][...].dtype == jnp.float32  # the model's own state is untouched


def test_the_scans_read_bfloat16_weights():
    def scan_weight_dtypes(cfg):  # dtypes of the (L, ...) matrices each layer scan slices
        graphdef, state = nnx.split(DeepSeekModel(cfg, rngs=nnx.Rngs(0)))
        jaxpr = jax.make_jaxpr(lambda s: nnx.merge(graphdef, s)(jnp.zeros((1, 8), jnp.int32)).logits)(state)
        scans = [e for e in jaxpr.jaxpr.eqns if e.primitive.name == "scan"]
        return [sorted(str(v.aval.dtype) for v in e.invars if v.aval.ndim >= 3 and v.aval.shape[0] == 3)
                for e in scans]

    cfg = _config(moe_path="dense_cf", n_dense_layers=0, mtp_depth=0)  # one stack of 3 MoE blocks
    # (3, ...) weights: 5 attention, 3 shared expert, 2 routed experts (bfloat16), the router gate (float32);
    # h (1, 8, 64) is not one
    assert scan_weight_dtypes(cfg) == [["bfloat16"] * 10 + ["float32"]]


# ------------------------------------------------------------------ head_bias: a float32 (V,) bias on the main and
# MTP logits, its gradient (plain and chunked cross-entropy), the data's log unigram prior (training sets it at init:
# tests/train/test_program.py)

def _model(**overrides):
    cfg = get_config("tiny", n_layers=2, max_seq_len=16, moe_path="ragged", dtype="float32", **overrides)
    return DeepSeekModel(cfg, rngs=nnx.Rngs(0))


def _batch(vocab, b=2, s=16):
    tokens = jax.random.randint(jax.random.key(1), (b, s + 1), 0, vocab)
    mask = (jax.random.uniform(jax.random.key(2), (b, s)) > 0.2).astype(jnp.float32)
    return {"inputs": tokens[:, :-1], "targets": tokens[:, 1:], "mask": mask}


def _random_bias(vocab):
    return jax.random.normal(jax.random.key(3), (vocab,), jnp.float32) * 2.0


@pytest.fixture
def bias_recipe(monkeypatch):
    """A recipe with the head bias alone (a model starts it at zero; training sets the unigram prior)."""
    return router_recipe_with(monkeypatch, head_bias="unigram")


def test_head_bias_config_choices():
    assert all(get_config(name).router.head_bias == "none" for name in ("tiny", "small", "deepseek_v3_671b"))
    assert get_config("reduced").router.head_bias == "unigram"  # the "short_run" recipe
    with pytest.raises(ValueError, match=r"\['head_bias'\] were replaced by router_recipe"):
        get_config("tiny", head_bias="yes")


def test_bias_adds_to_main_and_mtp_logits_and_changes_nothing_else(bias_recipe):
    plain, biased = _model(), _model(router_recipe=bias_recipe)
    assert plain.head_bias is None and "head_bias" not in nnx.state(plain, nnx.Param)
    # the bias draws no random numbers: every other parameter is the plain model's
    flat = dict(nnx.to_flat_state(nnx.state(biased, nnx.Param)))
    for name, leaf in nnx.to_flat_state(nnx.state(plain, nnx.Param)):
        np.testing.assert_array_equal(flat[name][...], leaf[...], err_msg=str(name))
    bias = _random_bias(plain.cfg.vocab_size)
    biased.head_bias[...] = bias
    inputs = _batch(plain.cfg.vocab_size)["inputs"]
    out, out_b = plain(inputs), biased(inputs)
    np.testing.assert_allclose(out_b.logits, out.logits + bias, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(out_b.mtp_logits[0], out.mtp_logits[0] + bias, rtol=1e-6, atol=1e-6)


def test_bias_gradient_is_the_mean_softmax_minus_onehot(bias_recipe):
    model = _model(router_recipe=bias_recipe, mtp_depth=0)  # the balance loss does not read the head's bias
    model.head_bias[...] = _random_bias(model.cfg.vocab_size)
    batch = _batch(model.cfg.vocab_size)
    grads = nnx.grad(lambda m: lm_loss(m, batch)[0])(model)
    probs = jax.nn.softmax(model(batch["inputs"]).logits, axis=-1)
    onehot = jax.nn.one_hot(batch["targets"], model.cfg.vocab_size)
    mask = batch["mask"][..., None]
    expected = jnp.sum((probs - onehot) * mask, axis=(0, 1)) / jnp.sum(mask)
    np.testing.assert_allclose(grads.head_bias[...], expected, rtol=1e-4, atol=1e-7)


@pytest.mark.parametrize("vocab_major", [False, True])
@pytest.mark.parametrize("chunk", [1, 6, 1000])
def test_chunked_loss_with_bias_matches_unchunked(vocab_major, chunk):
    keys = jax.random.split(jax.random.key(0), 4)
    b, s, d, v = 2, 7, 16, 50
    hidden = jax.random.normal(keys[0], (b, s, d))
    weight = jax.random.normal(keys[1], (v, d) if vocab_major else (d, v)) * 0.3
    targets = jax.random.randint(keys[2], (b, s), 0, v)
    mask = (jax.random.uniform(keys[3], (b, s)) > 0.25).astype(jnp.float32)
    bias = _random_bias(v)
    eq = "bsd,vd->bsv" if vocab_major else "bsd,dv->bsv"
    reference = lambda h, w, c: cross_entropy(jnp.einsum(eq, h, w) + c, targets, mask)
    chunked = lambda h, w, c: 0.7 * chunked_cross_entropy(h, w, targets, mask, chunk, vocab_major, bias=c)
    ref, ref_grads = jax.value_and_grad(reference, argnums=(0, 1, 2))(hidden, weight, bias)
    loss, grads = jax.jit(jax.value_and_grad(chunked, argnums=(0, 1, 2)))(hidden, weight, bias)
    np.testing.assert_allclose(loss, 0.7 * ref, rtol=1e-6)
    for g, r in zip(grads, ref_grads):
        np.testing.assert_allclose(g, 0.7 * r, rtol=1e-5, atol=1e-7)
    with pytest.raises(ValueError, match=r"bias must be float32 \(50,\)"):
        chunked_cross_entropy(hidden, weight, targets, mask, chunk, vocab_major, bias=bias[:-1])
    with pytest.raises(ValueError, match=r"bias must be float32 \(50,\)"):
        chunked_cross_entropy(hidden, weight, targets, mask, chunk, vocab_major, bias=bias.astype(jnp.bfloat16))


def test_model_chunked_loss_with_bias_matches_unchunked(bias_recipe):
    model = _model(router_recipe=bias_recipe)
    model.head_bias[...] = _random_bias(model.cfg.vocab_size)
    batch = _batch(model.cfg.vocab_size)
    graphdef, params, extra = nnx.split(model, nnx.Param, ...)
    chunked = _model(router_recipe=bias_recipe, loss_chunk_tokens=10)
    chunked_def = nnx.split(chunked, nnx.Param, ...)[0]

    def loss_and_grads(gdef):
        fn = lambda p: lm_loss(nnx.merge(gdef, p, extra), batch)[0]
        return jax.jit(jax.value_and_grad(fn))(params)

    loss, grads = loss_and_grads(graphdef)
    c_loss, c_grads = loss_and_grads(chunked_def)
    np.testing.assert_allclose(c_loss, loss, rtol=1e-6)
    for (name, g), (_, c) in zip(nnx.to_flat_state(grads), nnx.to_flat_state(c_grads)):
        scale = float(jnp.max(jnp.abs(g[...])))
        np.testing.assert_allclose(c[...], g[...], rtol=2e-5, atol=2e-5 * scale, err_msg=str(name))
    assert float(jnp.max(jnp.abs(c_grads["head_bias"][...]))) > 0


def test_unigram_log_prior():
    windows = np.array([[0, 1, 1, 3], [2, 1, 3, 3]], np.uint16)  # targets: 1 1 3 / 1 3 3 (the first is an input)
    prior = unigram_log_prior(PackedSequences(windows, seq_len=3), vocab_size=5)
    counts = np.array([0, 3, 0, 3, 0]) + 1.0
    np.testing.assert_allclose(prior, np.log(counts / counts.sum()), rtol=1e-6)
    assert prior.dtype == np.float32
    np.testing.assert_array_equal(unigram_log_prior(SyntheticSequences(5, 3), 5), np.zeros(5, np.float32))
    with pytest.raises(ValueError, match="vocab_size=3 but the data holds token id 3"):
        unigram_log_prior(PackedSequences(windows, seq_len=3), vocab_size=3)
    with pytest.raises(TypeError, match="source must be PackedSequences"):
        unigram_log_prior(windows, vocab_size=5)


# ------------------------------------------------------------------ zero_init_out_proj: the projections back into
# the residual stream start at zero, so every block starts as the identity; nothing else changes and training moves
# them off zero

OUT_PROJECTIONS = ("wo", "w_down")


def _flat_params(model):
    return {tuple(str(p) for p in path): leaf[...] for path, leaf in nnx.to_flat_state(nnx.state(model, nnx.Param))}


def _is_out(path):
    return any(name in path for name in OUT_PROJECTIONS)


@pytest.mark.parametrize("moe_path", ["ragged", "dense_cf"])
def test_zero_init_blocks_start_as_identity_and_nothing_else_changes(moe_path, monkeypatch):
    cfg = get_config("tiny", moe_path=moe_path, dtype="float32")
    plain = DeepSeekModel(cfg, rngs=nnx.Rngs(0))
    zero = DeepSeekModel(cfg.replace(router_recipe=router_recipe_with(monkeypatch, zero_init_out_proj=True)),
                         rngs=nnx.Rngs(0))
    plain_params, zero_params = _flat_params(plain), _flat_params(zero)
    assert plain_params.keys() == zero_params.keys()
    outs = [path for path in zero_params if _is_out(path)]
    # attention + SwiGLU wo in the dense and MoE stacks and the MTP block, the experts' w_down
    assert len(outs) >= 5 and any("w_down" in p for p in outs) and any("mtp" in p for p in outs)
    for path, value in zero_params.items():
        if _is_out(path):
            np.testing.assert_array_equal(value, 0.0, err_msg=str(path))
            assert float(jnp.max(jnp.abs(plain_params[path]))) > 0
        else:
            np.testing.assert_array_equal(value, plain_params[path], err_msg=str(path))
    inputs = jax.random.randint(jax.random.key(1), (2, 16), 0, cfg.vocab_size)
    expected = zero.logits(zero.final_norm(zero.embed(inputs)))  # every block the identity
    np.testing.assert_allclose(zero(inputs).logits, expected, rtol=1e-5, atol=1e-6)


def test_training_moves_the_zero_projections(monkeypatch):
    cfg = get_config("tiny", moe_path="ragged", dtype="float32",
                     router_recipe=router_recipe_with(monkeypatch, zero_init_out_proj=True))
    model = DeepSeekModel(cfg, rngs=nnx.Rngs(0))
    tokens = jax.random.randint(jax.random.key(1), (2, 17), 0, cfg.vocab_size)
    batch = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}
    optimizer = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)
    for _ in range(2):  # step 1 moves the last wo (its input is non-zero); step 2 the ones behind it
        grads = nnx.grad(lambda m: lm_loss(m, batch)[0])(model)
        optimizer.update(model, grads)
    for path, value in _flat_params(model).items():
        if _is_out(path) and "mtp" not in path:
            assert float(jnp.max(jnp.abs(value))) > 0, path


def test_zero_init_out_proj_validation_and_presets():
    with pytest.raises(TypeError, match="ModelConfig.zero_init_out_proj expects bool, got 1"):
        get_config("tiny", zero_init_out_proj=1)
    assert all(not get_config(name).router.zero_init_out_proj for name in ("tiny", "small", "deepseek_v3_671b"))
    assert get_config("reduced").router.zero_init_out_proj  # the "short_run" recipe


# remat_policy "dots_experts_attention": under "dots_no_batch" the routed experts' grouped GEMMs (FFI calls, not
# dots) run a second time in the backward pass to rebuild their outputs; this policy saves those outputs (named
# in `turbo_moe.ops.expert_block.expert_ffn`), so the compiled step holds fewer grouped-GEMM calls.
def compiled_hlo(cfg) -> str:
    model = DeepSeekModel(cfg, rngs=nnx.Rngs(0))
    graphdef, state = nnx.split(model)

    def loss(state, batch):
        return lm_loss(nnx.merge(graphdef, state), batch)[0]

    return jax.jit(jax.grad(loss)).lower(state, make_batch(cfg, seed=1)).compile().as_text()


@pytest.mark.parametrize("path", ["dense_cf", pytest.param("turbo", marks=requires_turbo)])
def test_policy_keeps_loss_and_grads(path):
    base = dict(dtype="float32", moe_path=path, capacity_factor=8.0)
    batch = make_batch(micro_config(**base), seed=1)
    (ref_loss, _), ref_grads = loss_and_grads(DeepSeekModel(micro_config(**base), rngs=nnx.Rngs(0)), batch)
    cfg = micro_config(**base, remat_policy="dots_experts_attention")
    (loss, _), grads = loss_and_grads(DeepSeekModel(cfg, rngs=nnx.Rngs(0)), batch)
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-6)
    for g, r in zip(jax.tree.leaves(grads), jax.tree.leaves(ref_grads)):
        np.testing.assert_allclose(g, r, rtol=1e-5, atol=1e-7)


@requires_turbo
@pytest.mark.parametrize("expert_backward, rebuilt", [("autodiff", 4), ("block", 2)])
def test_policy_does_not_run_the_expert_gemms_again(expert_backward, rebuilt, monkeypatch):
    # the model runs the expert block; the ops' own VJPs ("autodiff") through the path's reference argument
    if expert_backward == "autodiff":
        model_paths_with(monkeypatch, expert_backward="autodiff")
    # forward + data gradient use the same FFI target (with the SwiGLU kernels, on GPUs, the block's gate/up forward
    # is the fused one with SwiGLU); the weight gradient has its own
    gemm_calls = lambda hlo: len(re.findall(r'custom_call_target="turbo_moe_grouped_gemm(_swiglu)?"', hlo))
    counts = {policy: gemm_calls(compiled_hlo(micro_config(moe_path="turbo", remat_policy=policy)))
              for policy in ("none", "dots_no_batch", "dots_experts_attention")}
    # Two MoE blocks (the MoE layer and the MTP block), two GEMMs each: 2 x 2 forward + 2 x 2 data gradient.
    assert counts["none"] == 8, counts
    # + the forward GEMMs rebuilt in the backward pass: all 4 for autodiff; the block's backward needs no down
    # GEMM output (turbo_moe.ops.expert_block), so only the 2 gate/up ones
    assert counts["dots_no_batch"] == 8 + rebuilt, counts
    assert counts["dots_experts_attention"] == 8, counts


@requires_turbo
def test_policy_does_not_run_the_routing_again(monkeypatch):
    """The routing's int32 results are saved too (the router's picks, the permute's row index, the group sizes):
    under "dots_experts_attention" the backward pass runs neither the permute nor the router's selection (here
    causal centering + the sequence load penalty's chunk walk) a second time, as with no remat at all."""
    def counts(policy, penalty):
        recipe = router_recipe_with(monkeypatch, center_causal=True, seq_load_penalty=penalty, seq_load_chunk=4)
        cfg = micro_config(moe_path="turbo", remat_policy=policy, router_recipe=recipe)
        hlo = compiled_hlo(cfg)
        return (len(re.findall(r'custom_call_target="turbo_moe_permute"', hlo)), len(re.findall(r"compare\(", hlo)))

    permutes = {policy: counts(policy, 0.1)[0] for policy in ("none", "dots_no_batch", "dots_experts_attention")}
    assert permutes["dots_no_batch"] > permutes["none"], permutes  # rebuilt there (else the test shows nothing)
    assert permutes["dots_experts_attention"] == permutes["none"], permutes
    # the compare ops the penalty's walk adds: once per MoE block without remat, and no more with the policy
    walk = {policy: counts(policy, 0.1)[1] - counts(policy, 0.0)[1] for policy in ("none", "dots_experts_attention")}
    assert walk["none"] > 0 and walk["dots_experts_attention"] == walk["none"], walk


def test_unknown_policy_is_rejected():
    with pytest.raises(ValueError, match="remat_policy"):
        micro_config(remat_policy="dots_experts")


def test_fp8_experts_quantised_once_change_no_bit(monkeypatch):
    """turbo_fp8 quantises every layer's expert weights once before the scan (`quantize_stacked_experts`): the loss,
    the loads and every gradient are those of quantising at each use (the same blocks; the gradient reaches the
    weights), under `reduced`'s remat policy (the backward's recomputation reads the blocks made before the scan)."""
    cfg = _config(moe_path="turbo_fp8", d_model=128, moe_ffn_dim=128, remat_policy="dots_experts_attention")
    once_loss, once_metrics, once_grads = _loss_and_grads(cfg)
    monkeypatch.setattr(stack, "quantize_stacked_experts", lambda blocks, state: state)
    loss, metrics, grads = _loss_and_grads(cfg)
    np.testing.assert_array_equal(once_loss, loss)
    np.testing.assert_array_equal(once_metrics["expert_load"], metrics["expert_load"])
    assert len(grads) == len(once_grads)
    for (name, g), (once_name, c) in zip(grads, once_grads):
        assert name == once_name and c[...].dtype == g[...].dtype
        np.testing.assert_array_equal(c[...], g[...], err_msg=str(name))
    assert any("w_gate_up" in str(name) and float(jnp.abs(g[...]).max()) > 0 for name, g in once_grads)


def test_only_the_routed_experts_are_quantised_for_all_layers():
    """`quantize_stacked_experts` turns exactly the routed experts' stacked weights into Fp8Weights of every layer;
    the MTP block's are made the same way (`prepared_weights`)."""
    cfg = _config(moe_path="turbo_fp8", d_model=128, moe_ffn_dim=128)
    model = DeepSeekModel(cfg, rngs=nnx.Rngs(0))
    _, state = nnx.split(model.moe_layers.blocks)
    quantised = stack.quantize_stacked_experts(model.moe_layers.blocks, state)
    leaves = {path: var.get_value() for path, var in nnx.to_flat_state(quantised)}
    w8 = leaves[("ffn", "experts", "w_gate_up")]
    assert isinstance(w8, Fp8Weights)
    n_layers = w8.master.shape[0]
    assert w8.q_nk.shape == (n_layers, cfg.n_experts, 2 * cfg.moe_ffn_dim, cfg.d_model)
    assert w8.q_kn.dtype == jnp.float8_e4m3fn and w8.scale.shape == (n_layers, cfg.n_experts, 1, 2)
    assert not isinstance(leaves[("attn", "wo", "kernel")], Fp8Weights)
    # the MTP block (one unstacked MoE block) is prepared the same way: cast once, its experts quantised once
    mtp = model.mtp[0].block
    assert mtp.is_moe
    prepared = stack.prepared_weights(cfg, mtp, nnx.split(mtp)[1], mtp.is_moe)
    leaves = {path: var.get_value() for path, var in nnx.to_flat_state(prepared)}
    w8 = leaves[("ffn", "experts", "w_down")]
    assert isinstance(w8, Fp8Weights) and w8.master.dtype == jnp.dtype(cfg.dtype)
    assert w8.q_nk.shape == (cfg.n_experts, cfg.d_model, cfg.moe_ffn_dim)
    assert leaves[("attn", "wo", "kernel")].dtype == jnp.dtype(cfg.dtype)
