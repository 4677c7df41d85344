"""AdamW with low-precision moments (DeepSeek-V3's low-precision optimizer states).

- TrainConfig.moments_dtype: both moments stored in bfloat16, validated, trained with and saved/restored by the
  orbax checkpointer with their dtype.
- The second moment in bfloat16 (a wrapper around optax's own adamw), tested on its own through the optimizer, which
  keeps the two moments' dtypes apart: the same updates as float32 nu up to the rounding of the stored moment,
  decaying with b2 = 0.95; stochastic rounding."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from turbo_moe.model import get_config
from turbo_moe.train import TrainConfig
from turbo_moe.train.checkpoint import Checkpointer, check_resume_config
from turbo_moe.train.step import _optimizer, abstract_batch, build_program, make_mesh, make_optimizer

BF16 = jnp.dtype(jnp.bfloat16)


def _adam_state(opt_state) -> optax.ScaleByAdamState:
    return next(s for s in jax.tree.leaves(opt_state, is_leaf=lambda s: isinstance(s, optax.ScaleByAdamState))
                if isinstance(s, optax.ScaleByAdamState))


def _dtypes(tree) -> set:
    return {x.dtype for x in jax.tree.leaves(tree)}


def _hand_params_and_grads(steps: int, seed: int = 0):
    """A matrix (decayed) and a vector (not), and `steps` fixed gradients over 4 decades of magnitude."""
    keys = jax.random.split(jax.random.key(seed), 3)
    params = {"w": jax.random.normal(keys[0], (16, 32)), "b": jax.random.normal(keys[1], (32,))}

    def grad(key):
        k1, k2, k3, k4 = jax.random.split(key, 4)
        scale = lambda k, shape: 10.0 ** jax.random.uniform(k, shape, minval=-3, maxval=1)  # noqa: E731
        return {"w": jax.random.normal(k1, (16, 32)) * scale(k2, (16, 32)),
                "b": jax.random.normal(k3, (32,)) * scale(k4, (32,))}

    return params, [grad(k) for k in jax.random.split(keys[2], steps)]


def _moments_tx(mu_dtype, nu_dtype, **fields) -> optax.GradientTransformation:
    """`make_optimizer` with the two moments stored in different dtypes (one field in TrainConfig; the optimizer
    keeps them apart, so that each moment's storage is tested on its own)."""
    tc = TrainConfig(**fields)
    return _optimizer(tc.learning_rate, tc.warmup_steps, tc.schedule_steps, tc.min_lr_ratio, tc.weight_decay,
                      tc.adam_b1, tc.adam_b2, tc.grad_clip, mu_dtype, nu_dtype)


def _bf16_nu(**fields) -> optax.GradientTransformation:
    return _moments_tx(None, "bfloat16", **fields)  # stored stochastically rounded


def _updates(tc: TrainConfig | optax.GradientTransformation, params, grads) -> tuple[list, list]:
    """Each step's updates and optimizer state, the parameters moved by them (eagerly, as the optimizer is)."""
    tx = make_optimizer(tc) if isinstance(tc, TrainConfig) else tc
    state = tx.init(params)
    updates_seen, states = [], []
    for g in grads:
        updates, state = tx.update(g, state, params)
        params = optax.apply_updates(params, updates)
        updates_seen.append(updates)
        states.append(state)
    return updates_seen, states


# warm-up 0 so the first update moves the parameters; no clipping so the gradients are the ones given. make_optimizer
# resolves "auto" for the device (tests/train runs on the CPU): the moments left "auto" are float32, the reference.
HAND = dict(warmup_steps=0, steps=50, learning_rate=1e-2, grad_clip=0.0)


@pytest.mark.parametrize("value", ["float16", "bf16", 16, jnp.bfloat16])
def test_moments_bad_value_names_the_field(value):
    with pytest.raises(ValueError, match=r"TrainConfig\.moments_dtype: got .*expected one of"):
        TrainConfig(moments_dtype=value)


@pytest.mark.parametrize("b2", [0.999, 0.9999, 1 - 2**-9, 1.0])
def test_bf16_nu_takes_any_b2(b2):
    # stochastically rounded, a bf16 nu decays at any b2 (round-to-nearest froze it above 1 - 2**-8)
    assert TrainConfig(moments_dtype="bfloat16", adam_b2=b2).adam_b2 == b2
    assert TrainConfig(adam_b2=b2).resolved("gpu").moments_dtype == "bfloat16"


def test_moments_round_trip_default_cache_and_resume_check():
    tc = TrainConfig(moments_dtype="bfloat16")
    assert TrainConfig.from_dict(tc.to_dict()) == tc
    # "auto": bfloat16 on GPUs (the update is memory-bound), the parameters' dtype on the CPU
    assert TrainConfig().moments_dtype == "auto" and TrainConfig().resolved("cpu").moments_dtype is None
    assert TrainConfig().resolved("gpu").moments_dtype == "bfloat16"
    assert make_optimizer(TrainConfig()) is make_optimizer(TrainConfig(moments_dtype=None))  # on the CPU: one optimizer
    assert make_optimizer(tc) is make_optimizer(TrainConfig(adam_mu_dtype="bfloat16", adam_nu_dtype="bfloat16"))
    assert make_optimizer(tc) is not make_optimizer(TrainConfig())
    with pytest.raises(ValueError, match="moments_dtype='bfloat16' in the checkpoint, None now"):
        check_resume_config({"moments_dtype": "bfloat16"}, {"moments_dtype": None})
    with pytest.raises(ValueError, match="moments_dtype=None in the checkpoint, 'float32' now"):
        check_resume_config(TrainConfig().resolved("cpu").to_dict(), TrainConfig(moments_dtype="float32").to_dict())
    check_resume_config(tc.to_dict(), tc.to_dict())
    # a checkpoint written before the moments were one field (and seq_len the model's) resumes as the same run
    old = {**tc.to_dict(), "seq_len": 32, "adam_mu_dtype": "bfloat16", "adam_nu_dtype": "bfloat16"}
    del old["moments_dtype"]
    check_resume_config(old, tc.replace(seq_len=32).to_dict())
    with pytest.raises(ValueError, match="model_overrides="):
        check_resume_config(old, tc.replace(seq_len=16).to_dict())


@pytest.mark.parametrize("mu_dtype", [None, "bfloat16"])
def test_state_keeps_nu_in_bf16_and_mu_as_asked(mu_dtype):
    params, grads = _hand_params_and_grads(3)
    _, states = _updates(_moments_tx(mu_dtype, "bfloat16", **HAND), params, grads)
    init = _moments_tx(mu_dtype, "bfloat16", **HAND).init(params)
    plain = make_optimizer(TrainConfig(**HAND)).init(params)
    assert jax.tree.structure(init) == jax.tree.structure(plain)  # only nu's dtype differs: same checkpoint names
    for state in (init, *states):
        adam = _adam_state(state)
        assert _dtypes(adam.nu) == {BF16}
        assert _dtypes(adam.mu) == {jnp.dtype(mu_dtype or jnp.float32)}
    assert _dtypes(_adam_state(plain).nu) == {jnp.dtype(jnp.float32)}


def test_first_update_is_the_float32_one_and_the_next_within_nu_rounding():
    """Optax computes each update from the new, unrounded nu; only the stored copy is rounded. So the first update
    (from nu = 0) is the float32-nu one exactly, and the second differs by the rounding of the stored
    nu_1 = (1 - b2) g^2: stochastic rounding to bf16's 8 significant bits picks a neighbour within 2^-7 relative, so
    the update (~ nu^-1/2) is within 2^-8."""
    params, grads = _hand_params_and_grads(2)
    hand = {**HAND, "weight_decay": 0.0}  # the Adam term alone: decay could cancel part of it and inflate ratios
    ref, ref_states = _updates(TrainConfig(**hand), params, grads)
    low, low_states = _updates(_bf16_nu(**hand), params, grads)
    for a, b in zip(jax.tree.leaves(ref[0]), jax.tree.leaves(low[0])):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    # the stored second moment is (1 - b2) g^2 rounded to bf16
    nus = zip(jax.tree.leaves(_adam_state(ref_states[0]).nu), jax.tree.leaves(_adam_state(low_states[0]).nu))
    for nu32, nu16 in nus:
        down = jnp.nextafter(nu32.astype(jnp.bfloat16), jnp.bfloat16(0))  # bf16 neighbours of each float32 value
        near = nu32.astype(jnp.bfloat16)
        assert bool(jnp.all((nu16 == near) | (nu16 == down) | (nu16 == jnp.nextafter(near, jnp.bfloat16(jnp.inf)))))
        assert float(jnp.max(jnp.abs(nu16.astype(jnp.float32) / nu32 - 1))) <= 2**-7
    rel = [float(jnp.max(jnp.abs(b / a - 1))) for a, b in zip(jax.tree.leaves(ref[1]), jax.tree.leaves(low[1]))]
    assert max(rel) <= 2**-8 * 1.05, rel
    assert max(rel) > 0  # the rounding is really there


def test_updates_track_float32_over_many_steps():
    params, grads = _hand_params_and_grads(30)
    hand = {**HAND, "weight_decay": 0.0}  # the Adam term alone, so element-wise ratios are meaningful
    ref, _ = _updates(_moments_tx("bfloat16", None, **hand), params, grads)
    low, _ = _updates(TrainConfig(moments_dtype="bfloat16", **hand), params, grads)
    rel = np.concatenate([np.abs(np.asarray(b / a - 1)).ravel()
                          for r, l in zip(ref, low) for a, b in zip(jax.tree.leaves(r), jax.tree.leaves(l))])
    # each stored nu is rounded within 2^-7 (unbiased) and the errors decay at b2: measured median ~0.14%, p99 ~0.8%,
    # max ~1.5%
    assert 0 < np.median(rel) < 2**-9 and np.percentile(rel, 99) < 0.01 and rel.max() < 0.025, \
        (np.median(rel), np.percentile(rel, 99), rel.max())
    # with weight decay, every step's update in norm (measured: within ~0.3%)
    ref, _ = _updates(TrainConfig(**HAND), params, grads)
    low, _ = _updates(_bf16_nu(**HAND), params, grads)
    for r, l in zip(ref, low):
        diff = optax.tree.norm(jax.tree.map(jnp.subtract, r, l))
        assert float(diff) < 0.005 * float(optax.tree.norm(r))


def test_bf16_nu_decays_with_b2_095():
    params = {"w": jnp.zeros((4, 8)), "b": jnp.zeros((8,))}
    big = jax.tree.map(lambda p: jnp.full_like(p, 100.0), params)
    zero = jax.tree.map(jnp.zeros_like, params)
    tx = _bf16_nu(adam_b2=0.95, **HAND)
    state = tx.init(params)
    _, state = tx.update(big, state, params)
    first = float(_adam_state(state).nu["w"][0, 0])
    assert first == pytest.approx(0.05 * 100.0**2, rel=2**-8)
    history = [first]
    for _ in range(20):
        _, state = tx.update(zero, state, params)
        nu = _adam_state(state).nu
        assert _dtypes(nu) == {BF16}
        history.append(float(nu["w"][0, 0]))
    assert all(b < a for a, b in zip(history, history[1:])), history  # shrinks every step
    assert history[-1] == pytest.approx(first * 0.95**20, rel=0.05)  # at b2's rate (each step rounded)


def test_float32_params_with_float32_moments_is_the_plain_optimizer():
    params, grads = _hand_params_and_grads(3)
    ref, _ = _updates(TrainConfig(**HAND), params, grads)
    same, states = _updates(TrainConfig(moments_dtype="float32", **HAND), params, grads)
    assert _dtypes(_adam_state(states[-1]).nu) == {jnp.dtype(jnp.float32)}
    for r, s in zip(ref, same):
        for a, b in zip(jax.tree.leaves(r), jax.tree.leaves(s)):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_stochastic_rounding_is_unbiased_and_exact_where_it_can_be():
    from turbo_moe.train.low_precision_adam import stochastic_round_to_bf16

    ulp = 2.0**-7  # bf16's spacing in [1, 2)
    x = jnp.full((4096,), 1.0 + 0.3 * ulp, jnp.float32)  # nearest rounding always gives 1.0
    assert float(x.astype(jnp.bfloat16)[0]) == 1.0
    draws = jnp.stack([stochastic_round_to_bf16(x, jnp.uint32(s)) for s in range(8)]).astype(jnp.float32)
    assert set(np.unique(np.asarray(draws)).tolist()) == {1.0, 1.0 + ulp}  # only the two neighbours
    assert float(draws.mean()) == pytest.approx(1.0 + 0.3 * ulp, abs=0.02 * ulp)  # unbiased (32k draws)
    exact = jnp.asarray([0.0, 1.0, 1.5, 2.0**-70 * 1.25, 2.0**100], jnp.float32)  # bf16 values stay as they are
    np.testing.assert_array_equal(np.asarray(stochastic_round_to_bf16(exact, jnp.uint32(7)), np.float32), exact)
    top = jnp.full((64,), float(jnp.nextafter(jnp.float32(2.0), jnp.float32(0.0))), jnp.float32)  # carry to 2.0
    assert set(np.unique(np.asarray(stochastic_round_to_bf16(top, jnp.uint32(1)), np.float32)).tolist()) <= {2.0 - ulp / 2, 2.0}
    a, b = (stochastic_round_to_bf16(x, jnp.uint32(3)) for _ in range(2))
    np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))  # a seed gives the same bits
    with pytest.raises(ValueError, match="expects float32"):
        stochastic_round_to_bf16(x.astype(jnp.bfloat16), jnp.uint32(0))


def test_stochastic_nu_tracks_float32_where_nearest_runs_low():
    """A large gradient, then small ones: near its new level each step moves nu by less than half a bf16 ulp, so
    round-to-nearest would leave it where it is (stuck more than 5% off the float32 moment); the stochastically
    rounded bf16 nu follows on average."""
    params = {"w": jnp.zeros((64, 64))}
    grads = [{"w": jnp.full((64, 64), 10.0)}] + [{"w": jnp.full((64, 64), 1.2)}] * 150
    final = {}
    fields = {**HAND, "steps": 200, "adam_b2": 0.99}
    for name, tx in {"float32": make_optimizer(TrainConfig(**fields)), "bfloat16": _bf16_nu(**fields)}.items():
        _, states = _updates(tx, params, grads)
        final[name] = np.asarray(_adam_state(states[-1]).nu["w"], np.float32)
    ref = float(final["float32"].mean())
    assert final["bfloat16"].mean() == pytest.approx(ref, rel=0.01)  # unbiased
    assert final["bfloat16"].std() > 0  # each element rounded on its own


def test_stochastic_bf16_nu_decays_at_b2s_rate():
    tc = TrainConfig(moments_dtype="bfloat16", adam_b2=0.999)  # round-to-nearest froze nu at this b2
    assert TrainConfig.from_dict(tc.to_dict()) == tc
    params = {"w": jnp.zeros((4, 8))}
    tx = make_optimizer(tc)
    state = tx.init(params)
    _, state = tx.update({"w": jnp.full((4, 8), 100.0)}, state, params)
    before = float(np.asarray(_adam_state(state).nu["w"], np.float32).mean())
    for _ in range(20):
        _, state = tx.update({"w": jnp.zeros((4, 8))}, state, params)
    after = float(np.asarray(_adam_state(state).nu["w"], np.float32).mean())
    assert after == pytest.approx(before * 0.999**20, rel=2e-3)  # decays at b2's rate on average


# both moments in bfloat16 (DeepSeek-V3's recipe): trained and checkpointed together

def test_bf16_moments_train_and_checkpoint_with_their_dtype(tmp_path):
    cfg = get_config("tiny", n_layers=2, mtp_depth=0)  # fast compile
    tc = TrainConfig(model=cfg, dataset="synthetic", seq_len=16, steps=4, warmup_steps=1, moments_dtype="bfloat16")
    want_nu = jnp.dtype(jnp.bfloat16)
    mesh = make_mesh(jax.devices()[:1])
    program = build_program(cfg, make_optimizer(tc), mesh)
    state = program.init(jax.random.key(0))
    for adam in (_adam_state(state.opt_state), _adam_state(program.abstract_state.opt_state)):  # the step's layout too
        assert {x.dtype for x in jax.tree.leaves(adam.mu)} == {jnp.dtype(jnp.bfloat16)}
        assert {x.dtype for x in jax.tree.leaves(adam.nu)} == {want_nu}

    tokens = jax.random.randint(jax.random.key(1), (2, 17), 0, cfg.vocab_size)
    batch = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}
    compiled = program.train.lower(program.abstract_state, abstract_batch(2, 16, mesh)).compile()
    for _ in range(3):
        state, metrics = compiled(state, batch)
        assert np.isfinite(float(metrics["loss"]))
    adam = _adam_state(state.opt_state)
    assert {x.dtype for x in jax.tree.leaves(adam.mu)} == {jnp.dtype(jnp.bfloat16)}
    assert {x.dtype for x in jax.tree.leaves(adam.nu)} == {want_nu}
    assert any(float(jnp.abs(x.astype(jnp.float32)).max()) > 0 for x in jax.tree.leaves(adam.mu))
    assert all(float(x.astype(jnp.float32).min()) >= 0 for x in jax.tree.leaves(adam.nu))
    assert any(float(x.astype(jnp.float32).max()) > 0 for x in jax.tree.leaves(adam.nu))

    ckpt = Checkpointer(tmp_path / "ckpt")
    ckpt.save(3, state, {"step": 3, "config": tc.to_dict()})
    assert ckpt.finish() is None
    restored, record = Checkpointer(tmp_path / "ckpt").restore(program.abstract_state, config=tc.to_dict())
    assert record["step"] == 3
    for a, b in zip(jax.tree.leaves(state), jax.tree.leaves(restored)):
        assert a.dtype == b.dtype and a.shape == b.shape
        np.testing.assert_array_equal(np.asarray(a.astype(jnp.float32)), np.asarray(b.astype(jnp.float32)))
    state, metrics = compiled(restored, batch)  # the restored state runs the same executable
    assert np.isfinite(float(metrics["loss"]))
    with pytest.raises(ValueError, match="moments_dtype='bfloat16' in the checkpoint, None now"):  # another dtype
        Checkpointer(tmp_path / "ckpt").restore(program.abstract_state, config=tc.replace(moments_dtype=None).to_dict())
