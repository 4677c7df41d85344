"""Each model preset's optimizer recipe: the peak learning rate and warm-up a run takes where `TrainConfig` leaves
`learning_rate` / `warmup_steps` None (their default). A value the user sets wins; `TrainConfig.resolved()` writes the
recipe's values into the config a run executes and records.

The rest of AdamW's settings are DeepSeek-V3's for every preset (`OptimizerConfig`'s defaults: beta1 0.9, beta2 0.95,
weight decay 0.1, global-norm clip 1.0, decay to 0.1 x the peak).
"""

from __future__ import annotations

import dataclasses
import math

from turbo_moe.model.config import PRESET_NAMES


@dataclasses.dataclass(frozen=True)
class OptimizerRecipe:
    """A peak learning rate and its linear warm-up: `warmup_steps`, or in a shorter run `warmup_fraction` of its
    schedule but at least `min_warmup_steps` (or the whole of a run shorter than that)."""

    learning_rate: float
    warmup_steps: int
    warmup_fraction: float
    min_warmup_steps: int
    source: str  # where the numbers come from, in words

    def warmup_for(self, schedule_steps: int) -> int:
        """The warm-up of a schedule of `schedule_steps` steps."""
        fitted = max(math.ceil(self.warmup_fraction * schedule_steps), self.min_warmup_steps)
        return max(1, min(self.warmup_steps, schedule_steps, fitted))


# DeepSeek-V3 (arXiv 2412.19437, section 4.2): AdamW, the learning rate rising linearly to 2.2e-4 over the first 2K
# steps, then constant, then a cosine decay to 2.2e-5. Our schedule decays from the warm-up's end (no constant phase).
# A run shorter than 20K steps warms up over its first 10%, but over no fewer than AdamW's second-moment horizon,
# 1 / (1 - beta2) = 20 steps (all of a shorter run): at the exact widths a 2-step warm-up rose the loss from 11.9 to
# 16.7 before it fell (one H200, campaign full_deepseek_exact_h200_warmup2; docs/notes/full-deepseek.md).
DEEPSEEK_V3 = OptimizerRecipe(learning_rate=2.2e-4, warmup_steps=2000, warmup_fraction=0.1, min_warmup_steps=20,
                              source="DeepSeek-V3 (arXiv 2412.19437, 4.2): peak 2.2e-4 after 2K warm-up steps")
# The small presets' short runs (thousands of steps at most): a higher peak, 10 warm-up steps (all of a shorter run).
SHORT_RUN = OptimizerRecipe(learning_rate=3e-3, warmup_steps=10, warmup_fraction=1.0, min_warmup_steps=1,
                            source="this project's short-run recipe for the small presets: peak 3e-3, 10 warm-up "
                                   "steps")

RECIPES: dict[str, OptimizerRecipe] = {"tiny": SHORT_RUN, "small": SHORT_RUN, "reduced": SHORT_RUN,
                                       "deepseek_v3_671b": DEEPSEEK_V3}
if set(RECIPES) != set(PRESET_NAMES):
    raise ImportError(f"turbo_moe.train.recipes.RECIPES must name every model preset {PRESET_NAMES}, got "
                      f"{tuple(RECIPES)}")


def optimizer_recipe(model) -> OptimizerRecipe:
    """The recipe of `model` (`TrainConfig.model`): its preset's; a ModelConfig given whole takes the short-run recipe
    (name the preset, with model_overrides, to get the preset's)."""
    return RECIPES[model] if isinstance(model, str) and model in RECIPES else SHORT_RUN
