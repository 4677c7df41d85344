"""Named MoE layer shapes: the widths and expert counts that benchmarks and tests measure at, one line a model.

A shape is the routed-expert part of a model's MoE layer, what the expert GEMMs and the exchange see:
  d_model       the tokens' width: gate/up's K, down's N
  moe_ffn_dim   one expert's hidden width: gate's (and up's) N, down's K; a fused gate_up GEMM is 2 x this wide
  n_experts     routed experts (G of the grouped GEMM with every expert on one device)
  top_k         experts per token: a layer of T tokens sends T x top_k rows to the experts

`deepseek_v3` and `reduced` are read from the model presets of the same names (turbo_moe/model/config.py), so they
follow the model; the others are the published configs (config.json) of those models. A new shape is one line here.

    from turbo_moe.shapes import DEEPSEEK_V3
    rows = 4096 * DEEPSEEK_V3.top_k            # the GEMM's M for 4096 tokens
    DEEPSEEK_V3.local_experts(8)               # 32: the experts of one device at expert parallelism 8
"""
from __future__ import annotations

import dataclasses

from turbo_moe.model.config import get_config


@dataclasses.dataclass(frozen=True)
class MoEShape:
    name: str
    title: str
    d_model: int
    moe_ffn_dim: int
    n_experts: int
    top_k: int

    def local_experts(self, expert_parallel: int) -> int:
        """The experts each device holds when `expert_parallel` devices split them."""
        if self.n_experts % expert_parallel:
            raise ValueError(f"expert_parallel={expert_parallel} does not divide {self.name}'s {self.n_experts} experts")
        return self.n_experts // expert_parallel


def _from_preset(name: str, preset: str, title: str) -> MoEShape:
    cfg = get_config(preset)
    return MoEShape(name, title, cfg.d_model, cfg.moe_ffn_dim, cfg.n_experts, cfg.top_k)


DEEPSEEK_V3 = _from_preset("deepseek_v3", "deepseek_v3_671b", "DeepSeek-V3 (671B)")
REDUCED = _from_preset("reduced", "reduced", "turbo_moe `reduced` preset")
DEEPSEEK_V2_LITE = MoEShape("deepseek_v2_lite", "DeepSeek-V2-Lite", 2048, 1408, 64, 6)
QWEN3_30B_A3B = MoEShape("qwen3_30b_a3b", "Qwen3-30B-A3B", 2048, 768, 128, 8)
MIXTRAL_8X7B = MoEShape("mixtral_8x7b", "Mixtral 8x7B", 4096, 14336, 8, 2)
GPT_OSS_120B = MoEShape("gpt_oss_120b", "gpt-oss-120b", 2880, 2880, 128, 4)

MOE_SHAPES: dict[str, MoEShape] = {s.name: s for s in (DEEPSEEK_V3, REDUCED, DEEPSEEK_V2_LITE, QWEN3_30B_A3B,
                                                        MIXTRAL_8X7B, GPT_OSS_120B)}
