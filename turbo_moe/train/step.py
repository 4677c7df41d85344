"""Train state, optimizer, and the pure jitted train/eval steps (data parallel over a device mesh).

The model is split once into a static graph definition and two pytrees: `params` (nnx.Param, float32
master weights updated by AdamW) and `extra` (everything else — the router biases, which the
auxiliary-loss-free rule updates outside the gradient). Compute dtype (bf16) is the model's business:
its layers cast the float32 params at use.
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from turbo_moe.model import DeepSeekModel, ModelConfig, lm_loss, update_router_bias
from turbo_moe.train.config import TrainConfig

# Mesh axes: data parallel now; an `expert` axis (size 1 here) is reserved for expert parallelism,
# so batch and parameter specs already name it.
MESH_AXES = ("data", "expert")
BATCH_AXES = ("data", "expert")  # tokens are split over every device


class TrainState(NamedTuple):
    step: jax.Array  # () int32, optimizer updates applied so far
    params: Any  # nnx.State of nnx.Param (float32)
    extra: Any  # nnx.State of non-Param variables (router biases)
    opt_state: Any  # optax state


def make_mesh(devices: list | None = None) -> Mesh:
    """(n_devices, 1) mesh over ("data", "expert")."""
    devices = jax.devices() if devices is None else devices
    return Mesh(np.asarray(devices).reshape(len(devices), 1), MESH_AXES)


def batch_sharding(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, P(BATCH_AXES))


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, P())


def learning_rate_schedule(tc: TrainConfig) -> optax.Schedule:
    """Linear warm-up from 0 to the peak, cosine decay to min_lr_ratio * peak at schedule_steps."""
    peak = tc.learning_rate
    if tc.warmup_steps >= tc.schedule_steps:
        return optax.linear_schedule(0.0, peak, max(tc.warmup_steps, 1))
    return optax.warmup_cosine_decay_schedule(
        init_value=0.0, peak_value=peak, warmup_steps=tc.warmup_steps,
        decay_steps=tc.schedule_steps, end_value=peak * tc.min_lr_ratio)


def _decay_mask(params):
    # Decay matrices only: norms scales and vectors are not decayed (common practice, as in nanoGPT).
    return jax.tree.map(lambda p: p.ndim >= 2, params)


def make_optimizer(tc: TrainConfig) -> optax.GradientTransformation:
    adamw = optax.adamw(learning_rate_schedule(tc), b1=tc.adam_b1, b2=tc.adam_b2, eps=1e-8,
                        weight_decay=tc.weight_decay, mask=_decay_mask)
    if tc.grad_clip > 0:
        return optax.chain(optax.clip_by_global_norm(tc.grad_clip), adamw)
    return adamw


def init_state(model_cfg: ModelConfig, tx: optax.GradientTransformation, seed: int, mesh: Mesh):
    """Initialise the model and optimizer, replicated over the mesh. Returns (graphdef, TrainState)."""
    def new_model() -> DeepSeekModel:
        return DeepSeekModel(model_cfg, rngs=nnx.Rngs(seed))

    def create() -> TrainState:
        _, params, extra = nnx.split(new_model(), nnx.Param, ...)
        return TrainState(jnp.zeros((), jnp.int32), params, extra, tx.init(params))

    graphdef = nnx.split(nnx.eval_shape(new_model), nnx.Param, ...)[0]  # structure only, no allocation
    abstract = jax.eval_shape(create)
    sharding = jax.tree.map(lambda _: replicated(mesh), abstract)
    # Initialising under jit with out_shardings puts every leaf on every device without a host copy.
    state = jax.jit(create, out_shardings=sharding)()
    return graphdef, state


def _merge(graphdef, params, extra) -> DeepSeekModel:
    return nnx.merge(graphdef, params, extra)


def make_train_step(graphdef, tx: optax.GradientTransformation, bias_rate: float) -> Callable:
    """(state, batch) -> (state, metrics). batch: {"inputs","targets"} (B, S) int32, sharded on B."""

    def train_step(state: TrainState, batch: dict):
        def loss_fn(params):
            loss, metrics = lm_loss(_merge(graphdef, params, state.extra), batch)
            return loss, metrics

        (_, metrics), grads = jax.value_and_grad(loss_fn, has_aux=True)(state.params)
        updates, opt_state = tx.update(grads, state.opt_state, state.params)
        params = optax.apply_updates(state.params, updates)
        # Aux-loss-free balancing: bias moves by sign(mean load - load) after the weight update.
        model = _merge(graphdef, params, state.extra)
        update_router_bias(model, jax.lax.stop_gradient(metrics["expert_load"]), bias_rate)
        _, _, extra = nnx.split(model, nnx.Param, ...)
        metrics = {**metrics, "grad_norm": optax.global_norm(grads)}
        return TrainState(state.step + 1, params, extra, opt_state), metrics

    return train_step


def make_eval_step(graphdef) -> Callable:
    """(state, batch) -> metrics (no update). The reported eval loss is the main-head cross-entropy."""

    def eval_step(state: TrainState, batch: dict):
        _, metrics = lm_loss(_merge(graphdef, state.params, state.extra), batch)
        return {"ce_loss": metrics["ce_loss"], "loss": metrics["loss"]}

    return eval_step


def jit_steps(graphdef, tx, bias_rate: float, state: TrainState, mesh: Mesh):
    """Jitted train step (state donated) and eval step with explicit shardings."""
    state_sharding = jax.tree.map(lambda x: x.sharding, state)
    data_sharding = {"inputs": batch_sharding(mesh), "targets": batch_sharding(mesh)}
    train = jax.jit(make_train_step(graphdef, tx, bias_rate), in_shardings=(state_sharding, data_sharding),
                    out_shardings=(state_sharding, replicated(mesh)), donate_argnums=0)
    evaluate = jax.jit(make_eval_step(graphdef), in_shardings=(state_sharding, data_sharding),
                       out_shardings=replicated(mesh))
    return train, evaluate


def abstract_batch(global_batch: int, seq_len: int, mesh: Mesh) -> dict:
    spec = jax.ShapeDtypeStruct((global_batch, seq_len), jnp.int32, sharding=batch_sharding(mesh))
    return {"inputs": spec, "targets": spec}


def device_batch(batch: dict, mesh: Mesh) -> dict:
    """This process's numpy share of the global batch -> global jax arrays sharded over the mesh."""
    sharding = batch_sharding(mesh)
    return {k: jax.make_array_from_process_local_data(sharding, v) for k, v in batch.items()}
