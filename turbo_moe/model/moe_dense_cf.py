"""Kept for existing imports: dense_cf's capacity formula lives in `turbo_moe.model.exchanges` (the
capacity-slot exchange) and is re-exported by `turbo_moe.model.paths`, the MoE path table."""

from turbo_moe.model.exchanges import expert_capacity  # noqa: F401
