"""InitProgram: the init program's generator and threefry lowering choice (GPU kernel vs default), fallbacks."""
import jax
import numpy as np
import pytest

from turbo_moe.train.init_program import CPU_RNG, InitProgram, compile_on_cpu, cpu_key

ON_GPU = jax.default_backend() == "gpu"


def _init(key):
    k1, k2 = jax.random.split(key)
    return {"w": jax.random.normal(k1, (8, 5)) * 0.02, "b": jax.random.uniform(k2, (5,))}


def _assert_same(got, expected):
    for name in expected:
        np.testing.assert_array_equal(np.asarray(got[name]), np.asarray(expected[name]))


def test_bad_mode_names_the_setting():
    with pytest.raises(ValueError, match=r"InitProgram mode: must be one of \('auto', 'on', 'off'\), got 'sometimes'"):
        InitProgram(jax.jit(_init), "sometimes")
    with pytest.raises(ValueError, match="bogus"):
        InitProgram(jax.jit(_init), mode="bogus")


@pytest.mark.parametrize("mode", ["auto", "on", "off"])
def test_same_values_as_the_jitted_init_of_its_key(mode):
    program, key = InitProgram(jax.jit(_init), mode=mode), jax.random.key(3)
    drawn_from = program.program_key(key)
    expected = jax.jit(_init)(drawn_from)
    for got in (program(key), program.compile(key)(drawn_from)):
        _assert_same(got, expected)
    if ON_GPU:
        assert drawn_from is key and program.last_choice["lowering"] == ("default" if mode == "off" else "kernel")
    else:  # the CPU lowering ignores the kernel flag: the default, and says why
        assert program.last_choice == {"rng": CPU_RNG if mode == "auto" else "threefry2x32",
                                       "lowering": "default", "why": "not a GPU"}


@pytest.mark.skipif(ON_GPU, reason="the Philox generator is the CPU's choice")
def test_cpu_auto_draws_from_philox_of_the_same_seed():
    program = InitProgram(jax.jit(_init))  # mode defaults to "auto"
    for seed in (0, 3, 2**32 - 1):
        key = jax.random.key(seed)
        assert str(jax.random.key_impl(program.program_key(key))) == CPU_RNG
        assert np.array_equal(jax.random.key_data(cpu_key(key)),
                              jax.random.key_data(jax.random.key(seed, impl=CPU_RNG)))
        _assert_same(program(key), jax.jit(_init)(jax.random.key(seed, impl=CPU_RNG)))
    # Other seeds, other values; "off" keeps the threefry values of the caller's key.
    a, b = program(jax.random.key(0)), program(jax.random.key(1))
    assert not np.array_equal(np.asarray(a["w"]), np.asarray(b["w"]))
    off = InitProgram(jax.jit(_init), mode="off")(jax.random.key(0))
    _assert_same(off, jax.jit(_init)(jax.random.key(0)))
    assert not np.array_equal(np.asarray(off["w"]), np.asarray(a["w"]))
    # A key of another generator, passed explicitly, is used as given.
    rbg = jax.random.key(0, impl="rbg")
    assert program.program_key(rbg) is rbg


def test_compiled_once_per_key_kind_and_traceable():
    program = InitProgram(jax.jit(_init), mode="auto")
    key = jax.random.key(0)
    assert program.compile(key) is program.compile(jax.random.key(5))
    assert program.compile(jax.random.key(0, impl="rbg")) is not program.compile(key)
    shapes = jax.eval_shape(program, key)  # traced: no compile, the jitted init's shapes
    assert shapes["w"].shape == (8, 5) and shapes["b"].shape == (5,)


@pytest.mark.skipif(ON_GPU, reason="the Philox generator is the CPU's choice")
def test_cpu_auto_falls_back_to_threefry_where_philox_does_not_lower():
    """XLA:CPU cannot lower Philox on an output sharded over devices: such an init draws from threefry, the
    values of the jitted init of the caller's key, and says why (the training loop's multi-device CPU runs)."""
    if jax.device_count() < 2:
        pytest.skip("needs 2 host devices")
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    mesh = Mesh(np.asarray(jax.devices()[:2]), ("d",))
    jitted = jax.jit(lambda key: {"w": jax.vmap(lambda k: jax.random.normal(k, (4, 8)))(jax.random.split(key, 2))},
                     out_shardings={"w": NamedSharding(mesh, PartitionSpec(None, "d"))})
    key = jax.random.key(0)
    program = InitProgram(jitted)
    _assert_same(program(key), jitted(key))
    assert program.last_choice["rng"] == "threefry2x32" and "does not lower" in program.last_choice["why"]
    compiled = InitProgram(jitted)  # the same choice through .compile()
    _assert_same(compiled.compile(key)(compiled.program_key(key)), jitted(key))


@pytest.mark.skipif(ON_GPU, reason="CPU compiler options")
def test_cpu_program_compiles_with_its_options_to_the_same_bits():
    """The CPU init is compiled with CPU_COMPILER_OPTIONS: the values of the plain jitted init, bit for bit, for
    every draw a model init makes (normal, truncated normal, uniform; stacked under vmap as scanned layers are)."""
    def init(key):
        k1, k2, k3 = jax.random.split(key, 3)
        return {"w": jax.random.normal(k1, (16, 24)) * 0.02,
                "t": jax.random.truncated_normal(k2, -2.0, 2.0, (8, 8)),
                "experts": jax.vmap(lambda k: jax.random.normal(k, (4, 12)))(jax.random.split(k3, 5))}

    program, key = InitProgram(jax.jit(init)), jax.random.key(11)
    _assert_same(program(key), jax.jit(init)(program.program_key(key)))
    assert program.compile(key) is program.compile(key)  # compiled once


def test_compile_on_cpu_leaves_out_options_this_xla_does_not_know():
    lowered = jax.jit(_init).lower(jax.random.key(0))
    compiled = compile_on_cpu(lowered, {"xla_no_such_option_for_this_test": True})
    _assert_same(compiled(jax.random.key(0)), jax.jit(_init)(jax.random.key(0)))
    with pytest.raises(TypeError):  # other errors still surface
        compile_on_cpu(lowered)(jax.random.key(0), "an argument too many")


@pytest.mark.skipif(ON_GPU, reason="the CPU's multi-device init")
def test_cpu_mesh_init_is_drawn_on_one_device_and_laid_out():
    """A CPU mesh of several devices draws the state with the one-device Philox program (the one-draw init a
    one-device CPU run compiles) and lays each leaf out on the mesh: the sharded threefry program compiled for
    minutes. Its values, the program's shardings, and no sharded program compiled."""
    if jax.device_count() < 4:
        pytest.skip("needs 4 host devices")
    from turbo_moe.train import TrainConfig
    from turbo_moe.train.step import make_mesh, program_for

    tc = TrainConfig(model="tiny", model_overrides={"n_layers": 2, "mtp_depth": 0}, dataset="synthetic",
                     seq_len=32).resolved()
    program = program_for(tc, tc.model_config(), make_mesh(jax.devices()[:4]))
    state, key = program.init(jax.random.key(7)), cpu_key(jax.random.key(7))
    assert program.init.last_choice["why"].endswith("drawn on one device, then laid out on the mesh")
    assert list(program.init._compiled) == ["one_device"]  # the sharded programs were never compiled
    drawn = program.init._compiled["one_device"](key)
    for got, want, abstract in zip(jax.tree.leaves(state), jax.tree.leaves(drawn),
                                   jax.tree.leaves(program.abstract_state)):
        assert got.sharding == abstract.sharding
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    assert any(not leaf.sharding.is_fully_replicated for leaf in jax.tree.leaves(state))  # really cut over the mesh
