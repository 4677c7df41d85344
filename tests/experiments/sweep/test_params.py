"""02_train's capacity_factor and train_overrides: errors name the notebook parameter (and the key)."""

import math

import pytest

from turbo_moe.experiments.sweep.params import check_capacity_factor, check_train_overrides, check_train_parameters


@pytest.mark.parametrize("value, expected", [(None, None), (math.nan, None), (2, 2.0), (1.25, 1.25)])
def test_capacity_factor_accepted(value, expected):
    assert check_capacity_factor(value) == expected


@pytest.mark.parametrize("value", ["abc", True, -1.0, 0, math.inf, [1.0]])
def test_capacity_factor_rejected_naming_it(value):
    with pytest.raises(ValueError, match="^parameter capacity_factor: must be a positive"):
        check_capacity_factor(value)


@pytest.mark.parametrize("overrides, message", [
    ({"stpes": 3}, "parameter train_overrides: unknown key 'stpes'; did you mean 'steps'?"),
    ({"remat_policy": "bogus"}, "parameter train_overrides: key 'remat_policy': ModelConfig.remat_policy"),
    ({"grad_clip": "x"}, "parameter train_overrides: key 'grad_clip': TrainConfig.grad_clip"),
    ({"skip_steps_for_tgs": 1}, "key 'skip_steps_for_tgs': TrainConfig field 'skip_steps_for_tgs' was removed"),
    ({"seed": 3}, "key 'seed' is set by the notebook parameter 'seed'"),
    ({"steps": 3}, "key 'steps' is set by the notebook parameter 'steps'"),
    (["remat_policy"], "parameter train_overrides: must be a dict"),
])
def test_train_overrides_rejected_naming_parameter_and_key(overrides, message):
    with pytest.raises(ValueError) as err:
        check_train_overrides(overrides, explicit=("seed", "seq_len"))
    assert message in str(err.value)


def test_good_parameters_pass_through():
    assert check_train_parameters(capacity_factor=None, train_overrides={"remat_policy": "full"},
                                  explicit=("seed",)) == (None, {"remat_policy": "full"})
    assert check_train_overrides(None) == {}
    # the sub-configs' fields flat, and the older spellings TrainConfig still reads
    both = {"moments_dtype": "bfloat16", "checkpoint_every": 5, "adam_mu_dtype": "bfloat16"}
    assert check_train_overrides(both) == both
