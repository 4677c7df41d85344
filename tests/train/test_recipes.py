"""Each preset's optimizer recipe: what `learning_rate` / `warmup_steps` left None mean, and that a set value wins."""

import pytest

from turbo_moe.model import PRESET_NAMES, get_config
from turbo_moe.train import TrainConfig, learning_rate_schedule
from turbo_moe.train.recipes import DEEPSEEK_V3, RECIPES, SHORT_RUN


def test_deepseek_v3_and_its_slices_take_the_papers_learning_rate():
    tc = TrainConfig(model="deepseek_v3_671b", model_overrides={"n_layers": 2, "n_dense_layers": 1, "d_model": 3584}, steps=12)
    assert tc.optimizer.learning_rate is None and tc.optimizer.warmup_steps is None  # the recipe's, not a number
    assert (tc.learning_rate, tc.warmup_steps) == (2.2e-4, 12)  # shorter than Adam's 20-step horizon: all of it
    assert TrainConfig(model="deepseek_v3_671b", steps=100).warmup_steps == 20  # 10% would be fewer than 20
    assert TrainConfig(model="deepseek_v3_671b", steps=1000).warmup_steps == 100  # 10%
    assert TrainConfig(model="deepseek_v3_671b", steps=100_000).warmup_steps == 2000  # the paper's 2K steps
    # a run split into invocations warms up over its whole schedule's share
    assert TrainConfig(model="deepseek_v3_671b", steps=12, lr_schedule_steps=500).warmup_steps == 50
    # AdamW as published (arXiv 2412.19437, 4.2), the same for every preset
    assert (tc.adam_b1, tc.adam_b2, tc.weight_decay, tc.grad_clip, tc.min_lr_ratio) == (0.9, 0.95, 0.1, 1.0, 0.1)
    schedule = learning_rate_schedule(tc)
    assert float(schedule(0)) == 0.0 and float(schedule(6)) == pytest.approx(1.1e-4)


def test_small_presets_keep_theirs_and_a_set_value_wins():
    for preset in ("tiny", "small", "reduced"):
        tc = TrainConfig(model=preset, steps=50)
        assert (tc.learning_rate, tc.warmup_steps) == (3e-3, 10)
    assert TrainConfig(model="tiny", steps=4).warmup_steps == 4  # a run shorter than the warm-up: all of it
    mine = TrainConfig(model="deepseek_v3_671b", steps=12, learning_rate=1e-3, warmup_steps=0)
    assert (mine.learning_rate, mine.warmup_steps) == (1e-3, 0)
    assert TrainConfig.from_dict({"model": "deepseek_v3_671b", "learning_rate": None}).learning_rate == 2.2e-4
    # a ModelConfig given whole has no preset name: the short-run recipe (name the preset to get its own)
    assert TrainConfig(model=get_config("deepseek_v3_671b", n_layers=4)).learning_rate == SHORT_RUN.learning_rate
    assert set(RECIPES) == set(PRESET_NAMES) and RECIPES["deepseek_v3_671b"] is DEEPSEEK_V3


def test_the_recipe_follows_the_model_and_the_run_records_numbers():
    tiny = TrainConfig(model="tiny", steps=20)
    moved = tiny.replace(model="deepseek_v3_671b")  # None travels, so the new preset's recipe applies
    assert moved.learning_rate == 2.2e-4 and moved.warmup_steps == 20
    resolved = moved.resolved("cpu")
    assert (resolved.optimizer.learning_rate, resolved.optimizer.warmup_steps) == (2.2e-4, 20)
    record = resolved.to_dict()
    assert (record["learning_rate"], record["warmup_steps"]) == (2.2e-4, 20)
    assert TrainConfig.from_dict(record) == resolved  # the record rebuilds the run it describes
    with pytest.raises(ValueError, match="TrainConfig.learning_rate"):
        TrainConfig(learning_rate=-1.0)
