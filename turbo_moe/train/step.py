"""Train state, optimizer, and the pure jitted train/eval steps (data parallel over a device mesh).

The model is split once into a static graph definition and two pytrees: `params` (nnx.Param, float32
master weights updated by AdamW) and `extra` (everything else — the router biases, which the
auxiliary-loss-free rule updates outside the gradient). Compute dtype (bf16) is the model's business:
its layers cast the float32 params at use. With `TrainConfig.master_weights="split"` the stacked layers'
cast-at-use weights in `params` are their bf16 copy and `TrainState.master_low` holds the rest of the float32
master (`master_params` joins them).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P, SingleDeviceSharding

from turbo_moe.model import DeepSeekModel, ModelConfig, lm_loss, update_router_bias
from turbo_moe.model import device_choices as model_device_choices
from turbo_moe.model import normal_init
from turbo_moe.model.mesh import MESH_AXES, make_mesh  # noqa: F401  (make_mesh: re-exported)
from turbo_moe.model.router import bias_rate_at
from turbo_moe.model.sharding import state_shardings  # noqa: F401  (the train state's layout, re-exported)
from turbo_moe.model.stack import stacked_cast_paths
from turbo_moe.train import determinism
from turbo_moe.train.config import TrainConfig
from turbo_moe.train.init_program import InitProgram
from turbo_moe.train.low_precision_adam import with_adam_nu_dtype
from turbo_moe.train.offload import check_host_memory, host_shardings, on_device
from turbo_moe.train.split_master import joined_params, split_params
from turbo_moe.train import scan_outputs
from turbo_moe.train.scan_outputs import LoweredWithUninitializedScans

# The mesh (turbo_moe.model.mesh): tokens are split over every device; the training states are sharded by the
# logical axes their parameters declare (turbo_moe.model.sharding: ZeRO-3 / FSDP).
BATCH_AXES = MESH_AXES  # tokens are split over every device


class TrainState(NamedTuple):
    step: jax.Array  # () int32, optimizer updates applied so far
    params: Any  # nnx.State of nnx.Param (float32; "split": bf16 at master_low's paths, see `master_params`)
    extra: Any  # nnx.State of non-Param variables (router biases)
    opt_state: Any  # optax state (TrainConfig.optimizer_state_memory="host": in pinned host memory between steps)
    # TrainConfig.cast_params_in_update: the stacked layers' cast-at-use weights in the compute dtype (an nnx.State
    # with a subset of params' paths), written by each update and read by the next forward pass; None otherwise.
    # Derived from params: not checkpointed (`Program.refresh_compute` rebuilds it after a restore).
    compute: Any = None
    # TrainConfig.master_weights="split": the low 16 bits (uint16) of the float32 master weights whose bf16 compute
    # copy (the top 16, rounded) stands in `params` at those paths (turbo_moe.train.split_master). Not derived from
    # params: checkpointed, and laid out as the params it completes (state_shardings reads the same metadata).
    master_low: Any = None


def master_params(state: TrainState):
    """The float32 master weights of `state` whatever `TrainConfig.master_weights` is: read these, not
    `state.params`, to export or inspect the weights ("split" keeps bf16 there)."""
    return state.params if state.master_low is None else joined_params(state.params, state.master_low)


class ComputeCast(NamedTuple):
    """Which weights `TrainConfig.cast_params_in_update` keeps cast (state paths) and to what dtype; with `split`
    (`TrainConfig.master_weights="split"`) params holds the bf16 copy itself and `master_low` the rest of float32."""

    paths: frozenset
    dtype: Any
    split: bool = False


def compute_copy(params, cast: ComputeCast):
    """nnx.State of the leaves of `params` at `cast.paths`, cast to `cast.dtype`."""
    return nnx.from_flat_state([(path, var.replace(var[...].astype(cast.dtype)))
                                for path, var in nnx.to_flat_state(params) if path in cast.paths])


def with_compute(params, compute):
    """`params` with `compute`'s leaves in place of theirs: what the forward pass reads."""
    over = dict(nnx.to_flat_state(compute))
    return nnx.from_flat_state([(path, over.get(path, var)) for path, var in nnx.to_flat_state(params)])


def _in_mesh(fn: Callable, mesh: Mesh | None) -> Callable:
    """Traces `fn` with `mesh` as the ambient abstract mesh, so MoE layers run per device (shard_map)."""
    if mesh is None or mesh.size == 1:
        return fn

    @functools.wraps(fn)
    def wrapped(*args):
        with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
            return fn(*args)

    return wrapped


def batch_sharding(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, P(BATCH_AXES))


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, P())


def learning_rate_schedule(tc: TrainConfig) -> optax.Schedule:
    """Linear warm-up from 0 to the peak, cosine decay to min_lr_ratio * peak at schedule_steps."""
    return _schedule(tc.learning_rate, tc.warmup_steps, tc.schedule_steps, tc.min_lr_ratio)


def _schedule(peak: float, warmup_steps: int, total_steps: int, min_lr_ratio: float) -> optax.Schedule:
    if warmup_steps >= total_steps:
        return optax.linear_schedule(0.0, peak, max(warmup_steps, 1))
    return optax.warmup_cosine_decay_schedule(init_value=0.0, peak_value=peak, warmup_steps=warmup_steps,
                                              decay_steps=total_steps, end_value=peak * min_lr_ratio)


def _decay_mask(params):
    # Decay matrices only: norms scales and vectors are not decayed (common practice, as in nanoGPT).
    return jax.tree.map(lambda p: p.ndim >= 2, params)


def make_optimizer(tc: TrainConfig) -> optax.GradientTransformation:
    """AdamW (+ global-norm clipping). The same object for the same hyper-parameters, so that
    `build_program`'s cache (keyed on it) hits across runs."""
    tc = tc.resolved()
    return _optimizer(tc.learning_rate, tc.warmup_steps, tc.schedule_steps, tc.min_lr_ratio, tc.weight_decay,
                      tc.adam_b1, tc.adam_b2, tc.grad_clip, tc.moments_dtype, tc.moments_dtype)


@functools.lru_cache(maxsize=8)
def _optimizer(peak, warmup_steps, total_steps, min_lr_ratio, weight_decay, b1, b2, grad_clip, mu_dtype=None,
               nu_dtype=None):
    # mu_dtype / nu_dtype only change how the moments are stored: optax computes the update from the unrounded ones.
    adamw = optax.adamw(_schedule(peak, warmup_steps, total_steps, min_lr_ratio), b1=b1, b2=b2, eps=1e-8,
                        mu_dtype=None if mu_dtype is None else jnp.dtype(mu_dtype),
                        weight_decay=weight_decay, mask=_decay_mask)
    if nu_dtype is not None:
        adamw = with_adam_nu_dtype(adamw, nu_dtype)
    if grad_clip > 0:
        return optax.chain(optax.clip_by_global_norm(grad_clip), adamw)
    return adamw


def _init_fn(model_cfg: ModelConfig, tx: optax.GradientTransformation, cast: ComputeCast | None = None):
    def new_model(key) -> DeepSeekModel:
        return DeepSeekModel(model_cfg, rngs=nnx.Rngs(key))

    def create(key) -> TrainState:
        _, params, extra = nnx.split(new_model(key), nnx.Param, ...)
        opt_state = tx.init(params)  # from the float32 masters in either layout: the same moments
        if cast is not None and cast.split:
            params, low = split_params(params, cast.paths)
            return TrainState(jnp.zeros((), jnp.int32), params, extra, opt_state, None, low)
        compute = None if cast is None else compute_copy(params, cast)
        return TrainState(jnp.zeros((), jnp.int32), params, extra, opt_state, compute)

    return new_model, create


def _with_one_normal_draw(create):
    """`create` with every normal parameter sliced from one draw (turbo_moe/model/normal_init.py); the draw's size
    is counted when the program is traced, so a run that never uses it pays nothing."""

    def create_one_draw(key) -> TrainState:
        with normal_init.one_draw(key, normal_init.count_normal(create, key)):
            return create(key)

    return create_one_draw


def with_head_bias(state: TrainState, values: np.ndarray) -> TrainState:
    """`state` with the output head's bias (the router recipe's `head_bias`) set to `values` (V,), laid out as
    the one it replaces (any mesh, any number of processes); the optimizer's moments stay zero."""
    if "head_bias" not in state.params:
        raise ValueError("the model has no output head bias (its router recipe's head_bias is 'none')")
    old = state.params["head_bias"][...]
    values = np.asarray(values, old.dtype)
    if values.shape != old.shape:
        raise ValueError(f"head bias values: shape {values.shape} != the head's vocabulary {old.shape}")
    params = jax.tree.map(lambda x: x, state.params)  # new containers: the caller's state is left as it was
    params["head_bias"][...] = jax.make_array_from_callback(old.shape, old.sharding, lambda index: values[index])
    return state._replace(params=params)


def init_state(model_cfg: ModelConfig, tx: optax.GradientTransformation, seed: int, mesh: Mesh,
               fsdp: bool = True):
    """Initialise the model and optimizer over the mesh (state_shardings). Returns (graphdef, TrainState)."""
    program = build_program(model_cfg, tx, mesh, fsdp)
    return program.graphdef, program.init(jax.random.key(seed))


def _merge(graphdef, params, extra) -> DeepSeekModel:
    return nnx.merge(graphdef, params, extra)


def make_train_step(graphdef, tx: optax.GradientTransformation,
                    bias_rate: float | Callable[[jax.Array], jax.Array], cast: ComputeCast | None = None,
                    offloaded: TrainState | None = None) -> Callable:
    """(state, batch) -> (state, metrics). batch: {"inputs","targets"} (B, S) int32, sharded on B. `offloaded`: the
    state's shardings when part of it lives in host memory (turbo_moe.train.offload), brought over for the update."""

    def train_step(state: TrainState, batch: dict):
        # nnx.value_and_grad (not jax's) so the model's nnx.remat blocks see a consistent trace context;
        # DiffState restricts the gradient to nnx.Param (router biases are not trained by gradient).
        grad_fn = nnx.value_and_grad(lm_loss, argnums=nnx.DiffState(0, nnx.Param), has_aux=True)
        split = cast is not None and cast.split
        params_in = state.params if cast is None or split else with_compute(state.params, state.compute)
        forward = _merge(graphdef, params_in, state.extra)
        (_, metrics), grads = grad_fn(forward, batch)
        with jax.named_scope("optimizer"):
            if offloaded is not None:  # after the backward pass: the copies need not sit beside its activations
                state = on_device(state, offloaded)
            master = master_params(state)  # "split": joined in the update's fused pass, never stored as float32
            if cast is not None:  # the compute copy's gradients, as the cast's transpose gives them: in float32
                grads = jax.tree.map(lambda g, p: g.astype(p.dtype), grads, master)
            updates, opt_state = tx.update(grads, state.opt_state, master)
            params, low = optax.apply_updates(master, updates), None
            if split:  # the same pass writes hi (the next forward's weights), lo and the moments
                params, low = split_params(params, cast.paths)
            compute = None if cast is None or split else compute_copy(params, cast)  # fused with the update's pass
        # Aux-loss-free balancing: the bias moves toward the mean load (the recipe's bias_update) after the weight update.
        # Non-Param state as the forward left it (router_center_ema's running means; else state.extra).
        model = _merge(graphdef, params, nnx.split(forward, nnx.Param, ...)[2])
        rate = bias_rate(state.step) if callable(bias_rate) else bias_rate  # the schedule of router.bias_rate_at
        with jax.named_scope("router"):
            update_router_bias(model, jax.lax.stop_gradient(metrics["expert_load"]), rate)
        _, _, extra = nnx.split(model, nnx.Param, ...)
        with jax.named_scope("optimizer"):
            metrics = {**metrics, "grad_norm": optax.tree.norm(grads)}
        return TrainState(state.step + 1, params, extra, opt_state, compute, low), metrics

    return train_step


def make_eval_step(graphdef) -> Callable:
    """(state, batch) -> metrics (no update). The reported eval loss is the main-head cross-entropy.

    It reads `state.params` as the train step's forward does: with master_weights="split" the stacked weights' bf16
    copy (round half up; the float32 path's cast rounds to nearest-even, the two differ only at exact ties)."""

    def eval_step(state: TrainState, batch: dict):
        _, metrics = lm_loss(_merge(graphdef, state.params, state.extra), batch)
        return {"ce_loss": metrics["ce_loss"], "loss": metrics["loss"]}

    return eval_step


@dataclasses.dataclass(frozen=True)
class Program:
    """Everything jitted for one (model config, optimizer, mesh): built once, reused across runs.

    Reuse matters for notebooks and sweeps that call `run` repeatedly with the same shapes: the jitted
    functions keep their trace and executable caches, so later runs skip tracing and compilation.
    """

    graphdef: Any
    init: Callable  # InitProgram: key -> TrainState, laid out by state_shardings
    train: Callable  # (state, batch) -> (state, metrics), state donated
    evaluate: Callable  # (state, batch) -> {"ce_loss", "loss"}
    abstract_state: Any  # TrainState of ShapeDtypeStructs with shardings: compile before init has run
    # state -> state with its compute copy cast again from params (after a checkpoint restore); None without one
    refresh_compute: Callable | None = None


def compiler_options(gpu_autotune_level: int | None, deterministic: bool = False,
                     platform: str | None = None) -> dict | None:
    """Per-program XLA options on `platform` (default: JAX's backend). On the GPU, autotune level 0 skips timing GEMM
    variants at compile time: faster compiles, much slower steps without an autotune cache (docs/configuration.md);
    `deterministic` (TrainConfig.deterministic): XLA's deterministic ops (turbo_moe.train.determinism)."""
    platform = platform or jax.default_backend()
    options = determinism.compiler_options(deterministic, platform)
    if gpu_autotune_level is not None and platform == "gpu":
        options["xla_gpu_autotune_level"] = gpu_autotune_level
    return options or None


def compute_cast(model_cfg: ModelConfig, abstract_model: nnx.Module, split: bool = False) -> ComputeCast:
    """TrainConfig.cast_params_in_update's paths and dtype (with `split`, master_weights="split"'s); refused where the
    model computes in its parameter dtype."""
    dtype = jnp.dtype(model_cfg.dtype)
    if split and (dtype != jnp.bfloat16 or jnp.dtype(model_cfg.param_dtype) != jnp.float32):
        raise ValueError(f"TrainConfig.master_weights='split' keeps float32 master weights as a bfloat16 compute copy "
                         f"+ 16 low bits: it needs ModelConfig.dtype 'bfloat16' and param_dtype 'float32', got "
                         f"{model_cfg.dtype!r} and {model_cfg.param_dtype!r}")
    if dtype == jnp.dtype(model_cfg.param_dtype):
        raise ValueError(f"TrainConfig.cast_params_in_update: the model computes in its parameter dtype "
                         f"({model_cfg.param_dtype}): there is nothing to cast (use float32 params with a "
                         f"bfloat16/float16 compute dtype, or turn it off)")
    return ComputeCast(frozenset(stacked_cast_paths(abstract_model, dtype)), dtype, split)


@functools.lru_cache(maxsize=4)
def build_program(model_cfg: ModelConfig, tx: optax.GradientTransformation, mesh: Mesh,
                  fsdp: bool = True, gpu_autotune_level: int | None = None,
                  scan_outputs_uninitialized: bool | None = None, cast_params_in_update: bool = False,
                  split_master: bool = False, offload_optimizer: bool = False, deterministic: bool = False) -> Program:
    """The jitted programs of one configuration; `split_master` is `TrainConfig.master_weights == "split"`,
    `offload_optimizer` `TrainConfig.optimizer_state_memory == "host"` (turbo_moe.train.offload), `deterministic`
    `TrainConfig.deterministic` (turbo_moe.train.determinism).
    scan_outputs_uninitialized None: on GPU meshes wherever this JAX allows it (`scan_outputs.supported`), as runs do;
    cast_params_in_update: a test reference for the split layout (runs never set it)."""
    if not isinstance(split_master, bool) or not isinstance(cast_params_in_update, bool):
        raise TypeError(f"build_program: cast_params_in_update and split_master must be bools, got "
                        f"{cast_params_in_update!r} and {split_master!r}")
    if not isinstance(offload_optimizer, bool):
        raise TypeError(f"build_program: offload_optimizer must be a bool, got {offload_optimizer!r}")
    if offload_optimizer:
        check_host_memory(mesh)
    if split_master and cast_params_in_update:
        raise ValueError("build_program: split_master (TrainConfig.master_weights='split') already keeps the bf16 "
                         "compute copy in the state: pass cast_params_in_update=False")
    platform = mesh.devices.flat[0].platform
    options = compiler_options(gpu_autotune_level, deterministic, platform)
    key = jax.random.key(0)
    abstract_model = nnx.eval_shape(lambda: DeepSeekModel(model_cfg, rngs=nnx.Rngs(key)))  # no allocation
    cast = compute_cast(model_cfg, abstract_model, split_master) if cast_params_in_update or split_master else None
    new_model, create = _init_fn(model_cfg, tx, cast)
    graphdef = nnx.split(abstract_model, nnx.Param, ...)[0]
    shapes = jax.eval_shape(create, key)
    state_sharding = state_shardings(shapes, mesh, fsdp=fsdp)
    offloaded = host_shardings(state_sharding, shapes) if offload_optimizer else None
    state_sharding = state_sharding if offloaded is None else offloaded  # where the state lives between steps
    abstract_state = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                                  shapes, state_sharding)
    data_sharding = {"inputs": batch_sharding(mesh), "targets": batch_sharding(mesh)}
    # Initialising under jit with out_shardings puts every leaf on every device without a host copy.
    one_device = None
    if platform == "cpu" and mesh.size > 1:  # CPU meshes: drawn on one device, laid out (offloaded leaves too)
        one_device = jax.jit(_with_one_normal_draw(create), compiler_options=options,
                             out_shardings=SingleDeviceSharding(jax.local_devices()[0]))
    init = InitProgram(jax.jit(create, out_shardings=state_sharding, compiler_options=options), devices=mesh.size,
                       one_draw=jax.jit(_with_one_normal_draw(create), out_shardings=state_sharding,
                                        compiler_options=options),
                       one_device=one_device, shardings=state_sharding)
    bias_rate = functools.partial(bias_rate_at, model_cfg)
    train = jax.jit(_in_mesh(make_train_step(graphdef, tx, bias_rate, cast, offloaded), mesh),
                    in_shardings=(state_sharding, data_sharding),
                    out_shardings=(state_sharding, replicated(mesh)), donate_argnums=0, compiler_options=options)
    evaluate = jax.jit(_in_mesh(make_eval_step(graphdef), mesh), in_shardings=(state_sharding, data_sharding),
                       out_shardings=replicated(mesh), compiler_options=options)
    if scan_outputs_uninitialized is None:
        scan_outputs_uninitialized = uninitialized_scans_here(mesh)
    if scan_outputs_uninitialized:
        train, evaluate = LoweredWithUninitializedScans(train), LoweredWithUninitializedScans(evaluate)
    if deterministic and platform == "gpu":  # cuDNN attention's backward marked deterministic before XLA compiles it
        train = determinism.DeterministicAttention(train)
    refresh = None
    if cast is not None and not cast.split:
        refresh = jax.jit(lambda state: state._replace(compute=compute_copy(state.params, cast)),
                          out_shardings=state_sharding, donate_argnums=0, compiler_options=options)
    return Program(graphdef, init, train, evaluate, abstract_state, refresh)


def uninitialized_scans_here(mesh: Mesh) -> bool:
    """Scan outputs left uninitialised: on one-GPU meshes (elsewhere `lax.empty` is zeros anyway) where this JAX
    allows. On a mesh of several devices XLA partitions the unsharded `AllocateBuffer` as a buffer of the global
    shape cut by a dynamic slice: each device then copies its whole shard (and holds the global buffer), which costs
    more than the zero fill it replaces (docs/expert-parallel.md)."""
    return uninitialized_scans_on(mesh.devices.flat[0].platform, mesh.devices.size)


def uninitialized_scans_on(platform: str, devices: int) -> bool:
    return platform == "gpu" and devices == 1 and scan_outputs.supported()


def device_choices(model_cfg: ModelConfig, platform: str | None = None, devices: int = 1) -> dict[str, Any]:
    """What the device-dependent defaults resolve to on `platform` (default: JAX's backend) with a mesh of `devices`,
    for the run's record: two runs that differ in one of these differ in this dict, not only in the device name."""
    platform = platform or jax.default_backend()
    return {"platform": platform, **model_device_choices(model_cfg, platform),
            "scan_outputs_uninitialized": uninitialized_scans_on(platform, devices)}


def program_for(tc: TrainConfig, model_cfg: ModelConfig, mesh: Mesh) -> Program:
    """`build_program` with every program switch of `tc` (resolved for the mesh's devices): the one place a new
    switch is passed on."""
    platform = mesh.devices.flat[0].platform
    tc = tc.resolved(platform)
    if platform == "gpu":
        determinism.check_xla_flags(tc.deterministic)
    return build_program(model_cfg, make_optimizer(tc), mesh, tc.fsdp, None, None, False, tc.master_weights == "split",
                         tc.optimizer_state_memory == "host", tc.deterministic)


def abstract_batch(global_batch: int, seq_len: int, mesh: Mesh) -> dict:
    spec = jax.ShapeDtypeStruct((global_batch, seq_len), jnp.int32, sharding=batch_sharding(mesh))
    return {"inputs": spec, "targets": spec}


def device_batch(batch: dict, mesh: Mesh) -> dict:
    """This process's numpy share of the global batch -> global jax arrays sharded over the mesh."""
    sharding = batch_sharding(mesh)
    return {k: jax.make_array_from_process_local_data(sharding, v) for k, v in batch.items()}
