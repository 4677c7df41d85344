"""InitProgram: the init program's threefry lowering choice (GPU kernel vs default) and its fallbacks."""
import jax
import numpy as np
import pytest

from turbo_moe.train.init_program import InitProgram


def _init(key):
    k1, k2 = jax.random.split(key)
    return {"w": jax.random.normal(k1, (8, 5)) * 0.02, "b": jax.random.uniform(k2, (5,))}


def test_bad_mode_names_the_setting(monkeypatch):
    with pytest.raises(ValueError, match="TURBO_MOE_INIT_THREEFRY_KERNEL"):
        InitProgram(jax.jit(_init), "sometimes")
    monkeypatch.setenv("TURBO_MOE_INIT_THREEFRY_KERNEL", "bogus")
    with pytest.raises(ValueError, match="bogus"):
        InitProgram(jax.jit(_init))


@pytest.mark.parametrize("mode", ["auto", "on", "off"])
def test_same_values_as_the_jitted_init(mode):
    program, key = InitProgram(jax.jit(_init), mode), jax.random.key(3)
    expected = jax.jit(_init)(key)
    for got in (program(key), program.compile(key)(key)):
        for name in expected:
            np.testing.assert_array_equal(np.asarray(got[name]), np.asarray(expected[name]))
    if jax.default_backend() != "gpu":  # the CPU lowering ignores the flag: the default, and says why
        assert program.last_choice == {"lowering": "default", "why": "not a GPU"}
    else:
        assert program.last_choice["lowering"] == ("default" if mode == "off" else "kernel")


def test_compiled_once_per_key_kind_and_traceable():
    program = InitProgram(jax.jit(_init), "auto")
    key = jax.random.key(0)
    assert program.compile(key) is program.compile(key)
    assert program.compile(jax.random.key(0, impl="rbg")) is not program.compile(key)
    shapes = jax.eval_shape(program, key)  # traced: no compile, the jitted init's shapes
    assert shapes["w"].shape == (8, 5) and shapes["b"].shape == (5,)
