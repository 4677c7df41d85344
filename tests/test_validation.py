"""turbo_moe.validation: both configs raise one error type that names the field, its value and what it allows."""
import pickle

import pytest

from turbo_moe.model import get_config
from turbo_moe.train.config import OptimizerConfig, TrainConfig
from turbo_moe.validation import Checks, ConfigError, ConfigTypeError


@pytest.mark.parametrize("build, config, field, value, allowed", [
    (lambda: get_config("tiny", top_k=0), "ModelConfig", "top_k", 0, "a positive int"),
    (lambda: get_config("tiny", dtype="int8"), "ModelConfig", "dtype", "int8",
     "one of ('bfloat16', 'float16', 'float32')"),
    (lambda: get_config("tiny", top_k=9), "ModelConfig", "top_k", 9, "<= n_experts=8"),
    (lambda: get_config("gigantic"), "ModelConfig", "preset", "gigantic", None),
    (lambda: get_config("tiny", not_a_field=1), "ModelConfig", "not_a_field", 1, None),
    (lambda: TrainConfig(learning_rate=-1.0), "TrainConfig", "learning_rate", -1.0,
     "a positive finite number or None"),
    (lambda: OptimizerConfig(master_weights="bf16"), "TrainConfig", "master_weights", "bf16",
     "one of ('auto', 'float32', 'split')"),
    (lambda: TrainConfig(per_device_batch=0), "TrainConfig", "per_device_batch", 0, "a positive int"),
])
def test_both_configs_raise_one_structured_error(build, config, field, value, allowed):
    with pytest.raises(ConfigError) as caught:
        build()
    error = caught.value
    assert isinstance(error, ValueError)  # existing `except ValueError` keep catching it
    assert (error.config, error.field, error.value) == (config, field, value)
    assert allowed is None or error.allowed == allowed
    assert str(error).count("\n") == 0 and (field in str(error))


def test_a_value_of_the_wrong_type_is_also_a_type_error():
    with pytest.raises(ConfigTypeError) as caught:
        get_config("tiny", drop_tokens="yes")
    assert isinstance(caught.value, TypeError) and isinstance(caught.value, ConfigError)
    assert (caught.value.field, caught.value.value, caught.value.allowed) == ("drop_tokens", "yes", "a bool")
    assert str(caught.value) == "ModelConfig.drop_tokens expects bool, got 'yes'"


def test_checks_messages_and_pickling():
    check = Checks("DemoConfig")
    with pytest.raises(ConfigError, match=r"^DemoConfig\.steps: must be a non-negative int, got -1$"):
        check.integer("steps", -1, 0)
    with pytest.raises(ConfigError, match=r"^DemoConfig\.steps: must be a positive int, got True$"):
        check.integer("steps", True, 1)  # a bool is not an int here
    with pytest.raises(ConfigError, match=r"^DemoConfig\.rate: must be in \[0, 1\], got nan$"):
        check.number("rate", float("nan"), "in [0, 1]", lambda v: 0 <= v <= 1)
    with pytest.raises(ConfigError, match=r"^DemoConfig\.mode: got 'c'; expected one of \('a', 'b'\)$"):
        check.choice("mode", "c", ("a", "b"))
    check.choice("mode", None, ("a", None))
    check.number("rate", 0.5, "in [0, 1]", lambda v: 0 <= v <= 1)
    error = pickle.loads(pickle.dumps(ConfigTypeError("DemoConfig", "mode", 3, "a str")))
    assert type(error) is ConfigTypeError and (error.field, error.value, error.allowed) == ("mode", 3, "a str")
    assert str(error) == "DemoConfig.mode: must be a str, got 3"
