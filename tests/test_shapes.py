"""turbo_moe.shapes: the named shapes the benchmarks and GPU tests share."""
import pytest

from turbo_moe.model import get_config
from turbo_moe.shapes import DEEPSEEK_V3, MOE_SHAPES, REDUCED


@pytest.mark.parametrize("shape, preset", [(DEEPSEEK_V3, "deepseek_v3_671b"), (REDUCED, "reduced")])
def test_preset_shapes_follow_the_model_presets(shape, preset):
    cfg = get_config(preset)
    assert (shape.d_model, shape.moe_ffn_dim, shape.n_experts, shape.top_k) == (
        cfg.d_model, cfg.moe_ffn_dim, cfg.n_experts, cfg.top_k)


def test_every_shape_is_named_by_its_key_and_routes_fewer_experts_than_it_has():
    assert {"deepseek_v3", "reduced", "qwen3_30b_a3b", "mixtral_8x7b"} <= set(MOE_SHAPES)
    for name, shape in MOE_SHAPES.items():
        assert shape.name == name and 0 < shape.top_k < shape.n_experts


def test_local_experts():
    assert DEEPSEEK_V3.local_experts(8) == 32 and REDUCED.local_experts(1) == 64
    with pytest.raises(ValueError, match="expert_parallel=3 does not divide reduced's 64 experts"):
        REDUCED.local_experts(3)
