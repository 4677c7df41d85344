"""TrainConfig.master_weights="split" (what "auto" means on GPUs): the stacked layers' float32 master weights kept as
their bf16 compute copy (rounded half up) + the 16 low bits. split/join are exact; a step equals float32 masters' bit
for bit wherever no master weight sits on an exact tie (the only place the two bf16 copies differ; the reference is
`build_program(..., cast_params_in_update=True)`, float32 masters with their nearest-even bf16 copy kept in the state,
whose steps equal plain float32 masters' bit for bit); a resumed run continues exactly; checkpoints and settings of
the other layout are refused by name."""

import math

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from flax import nnx

from turbo_moe.model import get_config
from turbo_moe.train import TrainConfig, master_params, run
from turbo_moe.train.checkpoint import Checkpointer, check_resume_config
from turbo_moe.train.split_master import join, split, split_params
from turbo_moe.train.step import TrainState, build_program, make_mesh, make_optimizer

MICRO = {"n_layers": 2, "mtp_depth": 0}  # fast compiles
QUIET = 0x00400000  # float32's quiet-nan bit
_round_trip = jax.jit(lambda x: (*split(x), join(*split(x))))


@pytest.fixture(autouse=True, scope="module")
def optimised_build():
    """Bit for bit between two programs is a claim about the optimised build users run: XLA's optimisations, off for
    the rest of the suite (tests/conftest.py), are on here (with jax's in-memory caches cleared,
    which do not key on it)."""
    before = jax.config.read("jax_disable_most_optimizations")
    jax.config.update("jax_disable_most_optimizations", False)
    jax.clear_caches()
    yield
    jax.config.update("jax_disable_most_optimizations", before)
    jax.clear_caches()


def _bits(x) -> np.ndarray:
    return np.asarray(x).view(np.uint32 if np.asarray(x).dtype == np.float32 else np.uint16)


def _check_split(bits: np.ndarray, note: str = "") -> None:
    x = bits.view(np.float32)
    hi, lo, back = _round_trip(jnp.asarray(x))
    assert hi.dtype == jnp.bfloat16 and lo.dtype == jnp.uint16 and hi.shape == lo.shape == x.shape
    hi, lo, back = _bits(hi), _bits(lo), _bits(back)
    nan, tie = np.isnan(x), (bits & 0xFFFF) == 0x8000
    signalling = nan & ((bits & QUIET) == 0)
    np.testing.assert_array_equal(lo, bits & 0xFFFF, err_msg=note)
    # exact for every non-nan and every quiet nan; a signalling nan comes back quiet, nothing else changed
    np.testing.assert_array_equal(back[~signalling], bits[~signalling], err_msg=note)
    np.testing.assert_array_equal(back[signalling], bits[signalling] | QUIET, err_msg=note)
    # hi: round-to-nearest-even (ml_dtypes, not XLA) except at exact ties, where it is the truncation + 1 ulp
    with np.errstate(invalid="ignore"):  # nans
        rne = _bits(x.astype(ml_dtypes.bfloat16))
    hi_nan = (hi & 0x7FFF) > 0x7F80
    np.testing.assert_array_equal(hi_nan, nan, err_msg=note)
    np.testing.assert_array_equal(hi[nan] >> 15, bits[nan] >> 31, err_msg=note)  # a nan keeps its sign
    np.testing.assert_array_equal(hi[~nan & ~tie], rne[~nan & ~tie], err_msg=note)
    np.testing.assert_array_equal(hi[~nan & tie], (bits[~nan & tie] >> 16) + 1, err_msg=note)


def test_split_join_every_top_half_with_edge_low_halves():
    """All 65536 top halves (+-0, subnormals, normals, the largest finite, inf, nans) x low halves around the tie."""
    top = np.arange(1 << 16, dtype=np.uint32) << 16
    lows = np.array([0, 1, 0x7FFF, 0x8000, 0x8001, 0xFFFF], np.uint32)
    _check_split((top[:, None] | lows[None, :]))


def test_split_join_fresh_random_values():
    seed = np.random.SeedSequence().entropy  # fresh inputs each run (the claims hold for every float32), replayable
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 1 << 32, size=1 << 16, dtype=np.uint32)
    scale = 10.0 ** rng.integers(-44, 38, 1 << 16)  # subnormals to near the largest finite
    normal = (rng.standard_normal(1 << 16) * scale).astype(np.float32).view(np.uint32)
    _check_split(np.stack([raw, normal]), note=f"np.random.default_rng({seed})")


def test_named_edge_cases():
    cases = {"+0": 0x00000000, "-0": 0x80000000, "largest subnormal": 0x007FFFFF, "smallest subnormal": 0x00000001,
             "subnormal tie": 0x00008000, "tie, even top": 0x3F808000, "tie, odd top": 0x3F818000,
             "below tie": 0xBF807FFF, "above tie": 0xBF808001, "largest finite": 0x7F7FFFFF,
             "-largest finite": 0xFF7FFFFF, "+inf": 0x7F800000, "-inf": 0xFF800000, "quiet nan": 0x7FC00000,
             "-quiet nan with payload": 0xFFFFFFFF, "signalling nan": 0x7F800001}
    bits = np.array(list(cases.values()), np.uint32)
    hi, lo, back = (_bits(a) for a in _round_trip(jnp.asarray(bits.view(np.float32))))
    got = dict(zip(cases, zip(hi.tolist(), lo.tolist(), back.tolist())))
    assert got["largest finite"] == (0x7F80, 0xFFFF, 0x7F7FFFFF)  # hi overflows to +inf (as RNE does), x comes back
    assert got["-largest finite"] == (0xFF80, 0xFFFF, 0xFF7FFFFF)
    assert got["tie, even top"][0] == 0x3F81 and got["tie, odd top"][0] == 0x3F82  # up where RNE gives 0x3F80, 0x3F82
    assert got["subnormal tie"][0] == 0x0001 and got["-0"] == (0x8000, 0, 0x80000000)
    assert got["signalling nan"] == (0x7FC0, 0x0001, 0x7FC00001)  # quietened, payload kept
    assert got["-quiet nan with payload"] == (0xFFFF, 0xFFFF, 0xFFFFFFFF)  # + half would carry it into +0
    assert all(b == c for name, (_, _, b), c in zip(cases, got.values(), bits.tolist()) if name != "signalling nan")


def test_wrong_inputs_are_named():
    f32, bf16, u16 = jnp.zeros(3, jnp.float32), jnp.zeros(3, jnp.bfloat16), jnp.zeros(3, jnp.uint16)
    for bad, got in ((np.zeros(3), "float64"), (bf16, "bfloat16"), (1.0, "float")):
        with pytest.raises(TypeError, match=f"split: x must be a float32 array, got {got}"):
            split(bad)
    with pytest.raises(TypeError, match="join: hi must be a bfloat16 array, got float32"):
        join(f32, u16)
    with pytest.raises(TypeError, match="join: lo must be a uint16 array, got int32"):
        join(bf16, jnp.zeros(3, jnp.int32))
    with pytest.raises(ValueError, match=r"join: hi and lo must have one shape, got \(3,\) and \(4,\)"):
        join(bf16, jnp.zeros(4, jnp.uint16))


# ------------------------------------------------------------------ the layout in the train state

def _tx():
    return make_optimizer(TrainConfig(model=get_config("tiny", **MICRO), dataset="synthetic", seq_len=16, steps=8,
                                      warmup_steps=1))


def _flat(state) -> dict:
    return {path: jax.tree.leaves(var)[0] for path, var in nnx.to_flat_state(state)}  # arrays or ShapeDtypeStructs


@pytest.mark.parametrize("fsdp", [True, False])
def test_master_low_is_laid_out_as_its_params(fsdp):
    cfg = get_config("tiny", **MICRO)
    mesh = make_mesh(jax.devices()[:8], expert_parallel=2)
    split_state = build_program(cfg, _tx(), mesh, fsdp, None, False, False, True).abstract_state
    cast_state = build_program(cfg, _tx(), mesh, fsdp, None, False, True).abstract_state
    low, params = _flat(split_state.master_low), _flat(split_state.params)
    assert set(low) == set(_flat(cast_state.compute)) and len(low) >= 4  # cast_params_in_update's weights, no others
    for path, lo in low.items():
        assert lo.dtype == jnp.uint16 and params[path].dtype == jnp.bfloat16 and lo.shape == params[path].shape
        assert lo.sharding == params[path].sharding == _flat(cast_state.params)[path].sharding, path
    assert any(not lo.sharding.is_fully_replicated for lo in low.values())  # the check is not vacuous
    for path, p in params.items():
        if path not in low:
            assert p.dtype == jnp.float32, path  # norms, the router gate, embeddings, heads: float32 as before
    assert split_state.compute is None and cast_state.master_low is None


# ------------------------------------------------------------------ the reference: float32 masters + their bf16 copy

def _reference_steps(cast_in_update: bool, n: int = 3):
    cfg = get_config("tiny", **MICRO)
    program = build_program(cfg, _tx(), make_mesh(jax.devices()[:1]), True, None, False, cast_in_update)
    state = program.init(jax.random.key(0))
    tokens = jax.random.randint(jax.random.key(1), (n, 2, 17), 0, cfg.vocab_size)
    losses = []
    for i in range(n):
        state, metrics = program.train(state, {"inputs": tokens[i, :, :-1], "targets": tokens[i, :, 1:]})
        losses.append(float(metrics["loss"]))
    return state, losses


def test_the_reference_steps_equal_float32_masters_and_its_copy_is_their_cast():
    """`build_program(..., cast_params_in_update=True)` keeps the stacked weights' bf16 cast in the state, written by
    each update: the same steps as plain float32 masters bit for bit, so the split tests below compare against it."""
    ref_state, ref_losses = _reference_steps(False)
    state, losses = _reference_steps(True)
    assert losses == ref_losses  # bit-identical
    for a, b in zip(jax.tree.leaves(state.params), jax.tree.leaves(ref_state.params)):
        np.testing.assert_array_equal(a, b)
    copy = nnx.to_flat_state(state.compute)
    assert ref_state.compute is None and len(copy) >= 4  # every stacked Linear kernel and both expert weights
    params = dict(nnx.to_flat_state(state.params))
    for path, var in copy:
        assert var[...].dtype == jnp.bfloat16 and params[path][...].dtype == jnp.float32, path
        np.testing.assert_array_equal(var[...], params[path][...].astype(jnp.bfloat16), err_msg=str(path))
    assert not any("router" in "/".join(map(str, p)) or "norm" in "/".join(map(str, p)) for p, _ in copy)


# ------------------------------------------------------------------ steps against float32 masters

def _base(**changes) -> TrainConfig:
    return TrainConfig(model="tiny", model_overrides=MICRO, dataset="synthetic", per_device_batch=1, seq_len=16,
                       steps=6, lr_schedule_steps=6, warmup_steps=1, eval_batches=1, eval_every=3, progress=False,
                       master_weights="split").replace(**changes)


def _programs():
    """run()'s programs for `_base()` (8 CPU devices, FSDP) with split masters and the reference (float32 masters with
    their bf16 copy in the state)."""
    tc = _base()
    cfg, mesh = tc.model_config(), make_mesh()
    return (cfg, build_program(cfg, make_optimizer(tc), mesh, True, None, False, True),
            build_program(cfg, make_optimizer(tc), mesh, True, None, False, False, True))


def _copy(tree):
    return jax.tree.map(jnp.copy, tree)  # the train steps donate their state


_CONVERTERS = {}  # id(split program) -> (program, jitted converter): compiled once


def _as_split(state: TrainState, program) -> TrainState:
    """A reference state in the split layout, laid out as `program`'s state."""
    if id(program) not in _CONVERTERS:
        paths = frozenset(_flat(program.abstract_state.master_low))

        def convert(s: TrainState) -> TrainState:
            params, low = split_params(s.params, paths)
            return TrainState(s.step, params, s.extra, s.opt_state, None, low)

        shardings = jax.tree.map(lambda a: a.sharding, program.abstract_state)
        _CONVERTERS[id(program)] = program, jax.jit(convert, out_shardings=shardings)
    return _CONVERTERS[id(program)][1](_copy(state))  # a copy: outputs may alias inputs, and train steps donate


def _with_bits(state: TrainState, program, edit) -> TrainState:
    """`state` with edit(path, bits) applied to its float32 masters' bits, its compute copy cast again."""
    def edited(path, value):
        return jnp.asarray(edit(path, _bits(value).copy()).view(np.float32))
    params = nnx.from_flat_state([(p, v.replace(edited(p, v[...]))) for p, v in nnx.to_flat_state(state.params)])
    return program.refresh_compute(state._replace(params=params))


def _assert_same(a, b, what):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y), err_msg=what)


def _batch(cfg, key):
    tokens = jax.random.randint(jax.random.key(key), (jax.device_count(), 17), 0, cfg.vocab_size)
    return {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}


@pytest.mark.filterwarnings("ignore:Some donated buffers were not usable")  # refresh_compute's pass-through params
def test_steps_equal_float32_masters_away_from_ties():
    """From one state, a split step and a float32-master step (the reference) give the same losses, metrics, master
    weights and moments bit for bit (8 devices, FSDP): their forwards read the same bf16 weights except where a master sits on an
    exact tie (low bits 0x8000: split rounds up, the cast to nearest-even), so ties are moved one bit off first."""
    cfg, cast_p, split_p = _programs()
    state = cast_p.init(jax.random.key(0))
    fresh = split_p.init(jax.random.key(0))
    _assert_same(jax.jit(master_params)(fresh), state.params, "init: the same float32 masters")
    _assert_same((fresh.extra, fresh.opt_state), (state.extra, state.opt_state), "init: the same moments")
    paths = frozenset(_flat(fresh.master_low))
    hi_paths = sorted(paths)
    joined, hi_of = jax.jit(master_params), jax.jit(lambda params: split_params(params, paths)[0])  # one compile
    for i in range(3):
        state = _with_bits(state, cast_p, lambda p, b: b + ((b & 0xFFFF) == 0x8000) if p in paths else b)
        split_state = _as_split(state, split_p)
        hi, cast = _flat(split_state.params), _flat(state.compute)
        for p in hi_paths:  # the forward's weights: hi equals the cast copy once no tie is left
            np.testing.assert_array_equal(_bits(hi[p]), _bits(cast[p]), err_msg=str(p))
        batch = _batch(cfg, i)
        split_state, split_metrics = split_p.train(split_state, batch)
        state, metrics = cast_p.train(state, batch)
        _assert_same(split_metrics, metrics, f"step {i}: metrics")
        _assert_same(joined(split_state), state.params, f"step {i}: master weights")
        _assert_same((split_state.step, split_state.extra, split_state.opt_state),
                     (state.step, state.extra, state.opt_state), f"step {i}: moments, router biases")
        _assert_same(split_state.params, hi_of(state.params), f"step {i}: the stored hi")


@pytest.mark.filterwarnings("ignore:Some donated buffers were not usable")
def test_an_exact_tie_is_read_one_ulp_up():
    """A master on an exact tie: split's forward reads it one bf16 ulp above the nearest-even cast, every other weight
    as the cast does. One weight of 105k a 2**-8 relative step apart moves the loss by ~|dL/dw| * 2**-8 |w|: within
    rel 1e-5 (here not at all: the difference is lost in the rounding of the bf16 products)."""
    cfg, cast_p, split_p = _programs()
    state = cast_p.init(jax.random.key(0))
    target = ("moe_layers", "blocks", "ffn", "experts", "w_gate_up")
    state = _with_bits(state, cast_p, lambda p, b: b if p != target else np.where(
        np.arange(b.size).reshape(b.shape) == 7, (b & 0xFFFE0000) | 0x8000, b))  # even top half: RNE rounds down
    split_state = _as_split(state, split_p)
    hi, rne = _bits(_flat(split_state.params)[target]).ravel(), _bits(_flat(state.compute)[target]).ravel()
    assert hi[7] == rne[7] + 1 and np.array_equal(np.delete(hi, 7), np.delete(rne, 7))
    batch = _batch(cfg, 0)
    _, split_metrics = split_p.train(split_state, batch)
    _, metrics = cast_p.train(state, batch)
    loss, split_loss = float(metrics["loss"]), float(split_metrics["loss"])
    assert split_loss == pytest.approx(loss, rel=1e-5)


# ------------------------------------------------------------------ run, checkpoints, resume

def _restore(directory, program, tc: TrainConfig):
    """What run() does to resume: the latest step into `program`'s state, checked against `tc`."""
    ckpt = Checkpointer(directory)
    try:
        return ckpt.restore(program.abstract_state, config=tc.resolved().to_dict())  # run() records the resolved
    finally:
        ckpt.finish()


def test_resume_continues_exactly_and_other_layouts_are_refused(tmp_path):
    whole = run(_base(checkpoint_dir=str(tmp_path / "whole")))
    assert whole.status == "ok", whole.error
    ckpt = str(tmp_path / "ckpt")
    first = run(_base(steps=3, checkpoint_dir=ckpt, checkpoint_every=3))
    assert first.status == "ok", first.error
    resumed = run(_base(checkpoint_dir=ckpt, resume=True))
    assert resumed.status == "ok", resumed.error
    assert resumed.summary["resumed_from_step"] == 3
    # bit for bit: hi, lo and the moments are saved as they are, and the steps are deterministic on the CPU
    assert resumed.losses() == whole.losses()
    evals = [[r["eval_loss"] for r in result.history] for result in (resumed, whole)]
    np.testing.assert_array_equal(*evals)  # eval reads hi, as the forward does (NaN where not evaluated)
    assert np.isfinite(evals[0]).sum() == 2
    tc = _base()
    program = build_program(tc.model_config(), make_optimizer(tc), make_mesh(), True, None, False, False, True)
    final, record = _restore(tmp_path / "whole", program, tc)
    again, _ = _restore(ckpt, program, tc)
    assert record["step"] == 6 and int(final.step) == 6
    _assert_same(final, again, "the final states")
    assert {x.dtype for x in jax.tree.leaves(final.master_low)} == {jnp.dtype(jnp.uint16)}

    # the other layout: refused by name before the state is read, and nothing set aside as damaged
    plain = tc.replace(master_weights="float32")
    other = build_program(plain.model_config(), make_optimizer(plain), make_mesh())
    with pytest.raises(ValueError, match="master_weights='split' in the checkpoint, 'float32' now.*resume with its "
                                         "master_weights"):
        _restore(ckpt, other, plain)
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == ["3", "6"]
    # a record from before the field existed ran float32 masters
    with pytest.raises(ValueError, match="master_weights='float32' in the checkpoint, 'split' now"):
        check_resume_config({"seed": 0}, tc.to_dict())
    check_resume_config({"seed": 0}, plain.to_dict())


def test_run_matches_float32_masters_up_to_ties():
    """run() with split masters against float32 masters (8 devices, FSDP): the state holds as many bytes (bf16 hi + 16
    low bits for each float32 master), and the losses are equal until a master lands on an exact tie (one in 65536 a
    weight a step, ~1.6 a step here), which the forwards read one bf16 ulp apart; later steps carry that on. Seen over
    6 steps, seeds 0-3: at most 6.3e-6 relative here, 3.1e-5 on one device; so rel 2e-4. A wrong join, split or
    gradient cast moves every weight (the exact per-step test above catches anything smaller)."""
    split_run = run(_base(eval_batches=0))
    plain_run = run(_base(eval_batches=0, master_weights="float32"))
    assert split_run.status == plain_run.status == "ok", (split_run.error, plain_run.error)
    assert split_run.losses() == pytest.approx(plain_run.losses(), rel=2e-4)
    assert (split_run.provenance["config"]["master_weights"],
            plain_run.provenance["config"]["master_weights"]) == ("split", "float32")
    low = _flat(_programs()[2].abstract_state.master_low)
    assert sum(2 * math.prod(x.sharding.shard_shape(x.shape)) for x in low.values()) > 0
    args = [r.summary["compiled_memory"]["argument_size_in_bytes"] for r in (plain_run, split_run)]
    assert args[0] == args[1]


# ------------------------------------------------------------------ settings

@pytest.mark.parametrize("changes, message", [
    (dict(master_weights="bf16"),
     r"TrainConfig.master_weights: got 'bf16'; expected one of \('auto', 'float32', 'split'\)"),
    (dict(master_weights=None), "TrainConfig.master_weights: got None"),
    (dict(master_weights=True), "TrainConfig.master_weights: got True"),
    (dict(master_weights="split", model_overrides={"dtype": "float32"}),
     "TrainConfig.master_weights: 'split' .* needs the model's dtype 'bfloat16' and param_dtype 'float32', got "
     "'float32' and 'float32'"),
    (dict(master_weights="split", model_overrides={"dtype": "float16"}), "TrainConfig.master_weights: .*'float16'"),
    (dict(master_weights="split", model_overrides={"param_dtype": "bfloat16"}),
     "TrainConfig.master_weights: .*got 'bfloat16' and 'bfloat16'"),
])
def test_bad_settings_are_named(changes, message):
    with pytest.raises(ValueError, match=message):
        TrainConfig(model="tiny", **changes)


def test_good_settings_round_trip():
    tc = TrainConfig(model="tiny", master_weights="split")
    assert TrainConfig.from_dict(tc.to_dict()) == tc and TrainConfig().master_weights == "auto"
    # "auto": split where the GPU runs a bf16 model with float32 params, float32 masters otherwise
    assert TrainConfig(model="tiny").resolved("gpu").master_weights == "split"
    assert TrainConfig(model="tiny").resolved("cpu").master_weights == "float32"
    assert TrainConfig(model="tiny", model_overrides={"dtype": "float32"}).resolved("gpu").master_weights == "float32"
    assert tc.resolved("cpu").master_weights == "split"  # an explicit choice stays


def test_build_program_refuses_bad_combinations():
    mesh = make_mesh(jax.devices()[:1])
    with pytest.raises(ValueError, match="master_weights='split' .* needs ModelConfig.dtype 'bfloat16'"):
        build_program(get_config("tiny", dtype="float32"), _tx(), mesh, True, None, False, False, True)
    with pytest.raises(ValueError, match="split_master .* pass cast_params_in_update=False"):
        build_program(get_config("tiny", **MICRO), _tx(), mesh, True, None, False, True, True)
    with pytest.raises(TypeError, match="split_master must be bools, got .* and 'split'"):
        build_program(get_config("tiny", **MICRO), _tx(), mesh, True, None, False, False, "split")
