"""DeepSeek-V3-style MoE decoder in Flax NNX with interchangeable MoE paths (`MOE_PATHS`: dense_cf, ragged,
turbo, pallas; `turbo_moe.model.paths` maps each to its exchange and expert GEMM).

    from turbo_moe.model import get_config, DeepSeekModel, lm_loss, count_params
    cfg = get_config("tiny", moe_path="ragged")
    model = DeepSeekModel(cfg, rngs=nnx.Rngs(0))
"""

from turbo_moe.model.accounting import count_params, flops_per_token
from turbo_moe.model.config import MOE_PATHS, PRESET_NAMES, ModelConfig, get_config
from turbo_moe.model.device_kernels import device_choices
from turbo_moe.model.experts import ExpertStats, ExpertWeights
from turbo_moe.model.model import DeepSeekModel, ModelOutput, MoEStats, lm_loss, update_router_bias
from turbo_moe.model.moe_layer import moe_path_fn
from turbo_moe.model.router import RouterBias, Routing
from turbo_moe.model.router_recipes import ROUTER_RECIPES, RouterRecipe

__all__ = [
    "MOE_PATHS", "PRESET_NAMES", "ModelConfig", "get_config", "DeepSeekModel", "ModelOutput", "MoEStats",
    "lm_loss", "update_router_bias", "count_params", "flops_per_token", "RouterBias", "Routing",
    "ExpertWeights", "ExpertStats", "moe_path_fn", "ROUTER_RECIPES", "RouterRecipe", "device_choices",
]
