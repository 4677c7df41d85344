"""Shared helpers for the model tests: whether the turbo ops load, and a tiny-config factory."""

import pytest

from turbo_moe.model import get_config

try:
    import turbo_moe.ops  # noqa: F401

    TURBO_IMPORT_ERROR = None
except Exception as err:  # the FFI library may not be built yet
    TURBO_IMPORT_ERROR = f"{type(err).__name__}: {err}"

requires_turbo = pytest.mark.skipif(
    TURBO_IMPORT_ERROR is not None, reason=f"turbo_moe.ops cannot be imported ({TURBO_IMPORT_ERROR})")

ALL_PATHS = ["dense_cf", "ragged", pytest.param("turbo", marks=requires_turbo)]


def micro_config(**overrides):
    """tiny with one dense + one MoE layer + an MoE MTP block: the cheapest model that has every part."""
    return get_config("tiny", n_layers=2, max_seq_len=16, **overrides)


def router_recipe_with(monkeypatch, **values):
    """The name of a router recipe registered for this test only: DeepSeek-V3's with `values` (RouterRecipe's
    attributes) changed, where a test needs one mechanism alone or a chunk shorter than a tiny sequence (the
    recipes a user names are the fixed table of turbo_moe.model.router_recipes)."""
    import dataclasses

    from turbo_moe.model import router_recipes

    name = "test:" + ",".join(f"{key}={value}" for key, value in sorted(values.items()))
    monkeypatch.setitem(router_recipes._RECIPES, name,
                        dataclasses.replace(router_recipes.ROUTER_RECIPES["deepseek_v3"], **values))
    return name


def model_paths_with(monkeypatch, **variant):
    """The model's MoE layers with their one-device path built as `moe_path_fn(path, capacity_factor, **variant)`:
    a test reference such as `expert_backward="autodiff"` or `swiglu_impl="kernel"`, where the model always runs the
    defaults (the expert block, "auto" SwiGLU)."""
    from turbo_moe.model import moe_layer
    from turbo_moe.model.paths import moe_path_fn

    monkeypatch.setattr(moe_layer, "moe_path_fn",
                        lambda path, capacity_factor: moe_path_fn(path, capacity_factor, **variant))
