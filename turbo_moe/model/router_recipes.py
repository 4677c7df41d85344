"""The router recipes: `ModelConfig.router_recipe` names one, and the model reads its values (`ModelConfig.router`).

A recipe is one choice, fidelity to DeepSeek-V3's own router against balanced routing in short, high-learning-rate
runs (docs/configuration.md has the measurements), so it is one field rather than eight. The eight fields it
replaced (the balance loss's weight among them, the same in both recipes) are still read from older configs and
records: a combination equal to a recipe is that recipe (`recipe_named_by`); in a config to run any other is
refused, and a record (history, `ModelConfig.from_record`) that holds one reads as its base recipe, the other
values dropped, as removed fields are.
"""

from __future__ import annotations

import dataclasses
from types import MappingProxyType
from typing import Any, Mapping


@dataclasses.dataclass(frozen=True)
class RouterRecipe:
    # Output-head bias, a float32 (V,) Param added to the main and MTP logits. "unigram": training sets it at init
    # to the training split's log unigram frequencies, so the model need not learn them as one direction every
    # token's hidden state carries, the direction that collapses the routers in the lr warm-up
    # (docs/notes/routing.md); "none": no bias (DeepSeek-V3).
    head_bias: str
    # Zero-init the projections back into the residual stream (attention and SwiGLU `wo`, experts' `w_down`): every
    # block starts as the identity, so the router inputs are the token embeddings at every depth. With random ones,
    # the near-uniform attention of a fresh model adds nearly the same vector to every token in each layer, and the
    # routers of deep layers see tokens that look alike.
    zero_init_out_proj: bool
    # Gate kernel stored divided by this factor and multiplied back in the forward: AdamW (updates ~lr per element)
    # then moves the gate at lr * lr_scale, without touching the optimizer.
    lr_scale: float
    # "sign": b_i += rate * sign(mean - load_i) (DeepSeek-V3); "proportional": b_i += rate * (mean - load_i) / mean,
    # so an expert at 10x the mean load moves 9 steps' worth at once.
    bias_update: str
    # Causal sequence centering of the selection: top-k reads sigmoid(l_t - mean_{s<=t} l_s), each token's gate
    # logits minus the running mean of its own sequence so far (stop-gradient; combine weights unchanged). Whatever
    # every token of a sequence shares (the shared direction that collapses the routers) leaves the choice exactly;
    # past tokens only, so training and decoding agree.
    center_causal: bool
    # Causal sequence load penalty on the selection (0: off): each sequence runs through top-k in chunks of
    # `seq_load_chunk` tokens; a token's selection is lowered by this weight x max(share - 1, 0) per expert, share =
    # that expert's picks by the sequence's *earlier chunks* over its fair share k/E (with a prior of
    # SEQ_LOAD_PRIOR_TOKENS fair-share tokens; `router.seq_load_penalized_selection`). A sequence that sends most of
    # its tokens to a few experts (repeated names and lines) spreads its later tokens. Stop-gradient, combine
    # weights unchanged, past chunks only. Sequential over chunks: a parallel version moves alike tokens at once.
    seq_load_penalty: float
    # Shorter chunks react sooner; each is one more top-k in the program (the chunk loop is unrolled).
    seq_load_chunk: int
    # Weight of the auxiliary sequence-wise balance loss in the training loss (DeepSeek-V3's alpha, 1e-4).
    balance_loss_weight: float


_RECIPES = {
    # DeepSeek-V3's own router (tiny, small, deepseek_v3_671b).
    "deepseek_v3": RouterRecipe(head_bias="none", zero_init_out_proj=False, lr_scale=1.0, bias_update="sign",
                                center_causal=False, seq_load_penalty=0.0, seq_load_chunk=128,
                                balance_loss_weight=1e-4),
    # Balanced routing for short, high-learning-rate runs (reduced): no step over 2.0 max/mean load where
    # DeepSeek-V3's settings dropped 26.5% at cf 1.25 (docs/configuration.md).
    "short_run": RouterRecipe(head_bias="unigram", zero_init_out_proj=True, lr_scale=0.1, bias_update="proportional",
                              center_causal=True, seq_load_penalty=0.1, seq_load_chunk=128,
                              balance_loss_weight=1e-4),
}
ROUTER_RECIPES: Mapping[str, RouterRecipe] = MappingProxyType(_RECIPES)  # read-only: a recipe is a recorded name
ROUTER_RECIPE_NAMES = tuple(ROUTER_RECIPES)

# The ModelConfig fields a recipe replaced: old name -> (RouterRecipe attribute, the old field's type).
RECIPE_FIELDS: Mapping[str, tuple[str, str]] = MappingProxyType({
    "head_bias": ("head_bias", "str"),
    "zero_init_out_proj": ("zero_init_out_proj", "bool"),
    "router_lr_scale": ("lr_scale", "float"),
    "router_bias_update": ("bias_update", "str"),
    "router_center_causal": ("center_causal", "bool"),
    "router_seq_load_penalty": ("seq_load_penalty", "float"),
    "router_seq_load_chunk": ("seq_load_chunk", "int"),
    "balance_loss_weight": ("balance_loss_weight", "float"),
})


def _same_arithmetic(a: RouterRecipe, b: RouterRecipe) -> bool:
    """Equal, the chunk aside where the penalty is off (no chunk loop then)."""
    if a.seq_load_penalty == 0 and b.seq_load_penalty == 0:
        b = dataclasses.replace(b, seq_load_chunk=a.seq_load_chunk)
    return a == b


def recipe_named_by(base: str, old_fields: Mapping[str, Any]) -> str:
    """The recipe that the replaced fields `old_fields` (already of their old types) describe on top of recipe
    `base`; ValueError naming the fields and the recipes when no recipe has those values."""
    wanted = dataclasses.replace(ROUTER_RECIPES[base],
                                 **{RECIPE_FIELDS[name][0]: value for name, value in old_fields.items()})
    for name in (base, *ROUTER_RECIPES):
        if _same_arithmetic(ROUTER_RECIPES[name], wanted):
            return name
    recipes = "; ".join(f"{name}: " + ", ".join(f"{old}={getattr(recipe, attr)!r}" for old, (attr, _) in
                                                 RECIPE_FIELDS.items()) for name, recipe in ROUTER_RECIPES.items())
    raise ValueError(f"ModelConfig fields {sorted(old_fields)} were replaced by router_recipe, and "
                     f"{dict(old_fields)} (on top of router_recipe {base!r}) is no recipe's; the recipes are {recipes}")
