"""The kernels the model picks by device where no config field names one: the attention kernel, the expert block's
fused SwiGLU kernels and the router's top-k kernel. Each is decided by the module that runs it (`layers`, `paths`,
`router`); `device_choices` gathers them so that a run's record says what ran."""
from __future__ import annotations

from typing import Any

from turbo_moe.model.config import ModelConfig
from turbo_moe.model.layers import attention_kernel
from turbo_moe.model.paths import swiglu_kernels_on
from turbo_moe.model.router import topk_kernel_on


def device_choices(cfg: ModelConfig, platform: str) -> dict[str, Any]:
    """What the model runs on one device of `platform` ("cpu", "gpu", ...): {"attention": "xla" | "cudnn" |
    "cudnn_unpadded", "swiglu_kernels": bool, "router_topk_kernel": bool}."""
    return {"attention": attention_kernel(cfg.dtype, platform),
            "swiglu_kernels": swiglu_kernels_on(cfg.moe_path, platform),
            "router_topk_kernel": topk_kernel_on(platform)}
