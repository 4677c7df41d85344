"""The MoE paths: one table mapping (moe_path, ep_exchange) to its (exchange, GEMM set) pair.

A path lays the token copies out by expert (the exchange), runs the experts' SwiGLU FFN with a GEMM set
(`turbo_moe.ops.GEMM_SETS`), and brings the outputs back. One device (or one data-parallel shard) uses the
ONE_DEVICE rows; under a mesh with an `expert` axis, `expert_parallel.ep_moe_path` uses the row of the
configured `ep_exchange`, whose exchange wraps the one-device one. Adding a path is one row per ep_exchange
here plus its exchange (`exchanges.py`, `ep_exchange.py`) or GEMM set (`turbo_moe/ops/gemm_sets.py`), and its
name in `config.MOE_PATHS`.

The experts behind the permute exchange run as one op, `ops.expert_block` (permute -> FFN -> unpermute with one
VJP); the other exchanges hand their rows to `ops.expert_ffn`. `expert_stage` makes that choice, here only.

For accounting: `MOE_PATHS` (the path names), `DROPLESS_PATHS`, `expert_capacity` (dense_cf's slots).
"""

from __future__ import annotations

import functools
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp

from turbo_moe.model import ep_exchange as ep
from turbo_moe.model import exchanges
from turbo_moe.model.config import EP_EXCHANGES, MOE_PATHS, check_moe_path, resolve_moe_path
from turbo_moe.model.exchanges import Stage, expert_capacity  # noqa: F401  (expert_capacity: for accounting)
from turbo_moe.model.experts import ExpertStats, ExpertWeights, routed_load
from turbo_moe.model.router import Routing
from turbo_moe.ops.expert_block import expert_block, expert_ffn
from turbo_moe.ops.gemm_sets import GEMM_SETS, GemmSet

ONE_DEVICE = "one_device"  # the ep_exchange column of the rows used without expert parallelism


class PathRow(NamedTuple):
    exchange: str  # a one-device exchange: key of LOCAL_EXCHANGES
    ep_wrapper: str | None  # the expert-parallel exchange around it: key of EP_WRAPPERS (None: one device)
    gemm: str  # key of ops.GEMM_SETS


PATHS: dict[tuple[str, str], PathRow] = {
    # (moe_path, ep_exchange):                  exchange     EP wrapper            GEMM set
    ("dense_cf", ONE_DEVICE):           PathRow("capacity", None,                "einsum"),
    ("dense_cf", "deepep"):             PathRow("capacity", "all_to_all",        "einsum"),
    ("dense_cf", "ragged_all_to_all"):  PathRow("capacity", "all_to_all",        "einsum"),
    ("ragged", ONE_DEVICE):             PathRow("sort",     None,                "ragged_dot"),
    ("ragged", "deepep"):               PathRow("sort",     "ragged_all_to_all", "ragged_dot"),
    ("ragged", "ragged_all_to_all"):    PathRow("sort",     "ragged_all_to_all", "ragged_dot"),
    ("turbo", ONE_DEVICE):              PathRow("permute",  None,                "turbo"),
    ("turbo", "deepep"):                PathRow("permute",  "deepep",            "turbo"),
    ("turbo", "ragged_all_to_all"):     PathRow("permute",  "ragged_all_to_all", "turbo"),
    ("pallas", ONE_DEVICE):             PathRow("permute",  None,                "pallas"),
    ("pallas", "deepep"):               PathRow("permute",  "deepep",            "pallas"),
    ("pallas", "ragged_all_to_all"):    PathRow("permute",  "ragged_all_to_all", "pallas"),
    ("turbo_fp8", ONE_DEVICE):          PathRow("permute",  None,                "fp8"),
    ("turbo_fp8", "deepep"):            PathRow("permute",  "deepep",            "fp8"),
    ("turbo_fp8", "ragged_all_to_all"): PathRow("permute",  "ragged_all_to_all", "fp8"),
}
DROPLESS_PATHS = tuple(p for p in MOE_PATHS if PATHS[(p, ONE_DEVICE)].exchange != "capacity")

LOCAL_EXCHANGES = {
    "sort": lambda **_: exchanges.sort_exchange,
    "permute": lambda **_: exchanges.permute_exchange,
    "capacity": lambda *, seq_len, capacity_factor, **_: functools.partial(
        exchanges.capacity_exchange, seq_len=seq_len, capacity_factor=capacity_factor),
}
EP_WRAPPERS = {"ragged_all_to_all": ep.ragged_all_to_all, "deepep": ep.deepep, "all_to_all": ep.all_to_all}

if set(PATHS) != {(p, e) for p in MOE_PATHS for e in (ONE_DEVICE,) + EP_EXCHANGES}:
    raise ImportError(f"turbo_moe.model.paths.PATHS must have one row per (moe_path, ep_exchange) of {MOE_PATHS} "
                      f"x {(ONE_DEVICE,) + EP_EXCHANGES}")
if {row.gemm for row in PATHS.values()} - set(GEMM_SETS):
    raise ImportError(f"turbo_moe.model.paths.PATHS names GEMM sets outside ops.GEMM_SETS {tuple(GEMM_SETS)}")


def path_row(moe_path: str, ep_exchange: str = ONE_DEVICE) -> PathRow:
    """The table's row for (moe_path, ep_exchange); "auto" names the device's fastest dropless path, as in a
    ModelConfig. A path name the table lacks is ModelConfig's ConfigError (`check_moe_path`); an unknown exchange, a
    ValueError naming the argument."""
    moe_path = resolve_moe_path(moe_path)
    check_moe_path(moe_path)
    row = PATHS.get((moe_path, ep_exchange))
    if row is None:
        raise ValueError(f"ep_exchange: got {ep_exchange!r}; expected one of {EP_EXCHANGES}")
    return row


def swiglu_kernels_on(moe_path: str, platform: str) -> bool:
    """Whether `moe_path`'s expert block runs the fused gate/up + SwiGLU kernels on `platform` (one device): on GPUs,
    for turbo's GEMM set behind the permute exchange (`device_gemms` with swiglu_impl "auto")."""
    row = path_row(moe_path)
    return platform == "gpu" and row.gemm == "turbo" and row.exchange == "permute"


def device_gemms(row: PathRow, moe_path: str, swiglu_impl: str = "auto") -> GemmSet:
    """The row's GEMM set as the default devices run it (decided at trace time): a ValueError naming `moe_path` when
    they cannot; the fused gate/up + SwiGLU kept with swiglu_impl "kernel", and with "auto" on GPUs only (XLA's
    SwiGLU fusion is faster on the CPU)."""
    gemms = GEMM_SETS[row.gemm]
    problem = gemms.device_problem()
    if problem:
        raise ValueError(f"moe_path={moe_path!r}: {problem}. Use moe_path='turbo' or 'ragged' here.")
    if swiglu_impl == "kernel" or (swiglu_impl == "auto" and jax.default_backend() == "gpu"):
        return gemms
    return gemms.without_fused_swiglu()


class ExpertFfn(NamedTuple):
    """The exchanges' `ffn(rows, group_sizes)`: `ops.expert_ffn` with these weights and GEMM set."""

    weights: ExpertWeights
    gemms: GemmSet

    def __call__(self, rows, group_sizes):
        return expert_ffn(rows, self.weights.w_gate_up, self.weights.w_down, group_sizes, self.gemms)


def expert_stage(exchange: str, ffn: ExpertFfn, block: bool = True, **params) -> Stage:
    """The experts behind the one-device exchange `exchange`: `ops.expert_block` for "permute" (with `block`; False
    is the test reference, the permute exchange handing its rows to `ffn`), else the exchange and `ffn`."""
    if block and exchange == "permute":
        def stage(tokens, expert_ids, combine_w, n_experts: int):
            if n_experts != ffn.weights.n_experts:
                raise ValueError(f"n_experts={n_experts} but the expert weights hold {ffn.weights.n_experts}")
            y, group_sizes = expert_block(tokens, expert_ids, combine_w, ffn.weights.w_gate_up, ffn.weights.w_down,
                                          ffn.gemms)
            return y, group_sizes.sum()
        return stage
    local = LOCAL_EXCHANGES[exchange](**params)
    return lambda tokens, expert_ids, combine_w, n_experts: local(tokens, expert_ids, combine_w, n_experts, ffn)


def build_stage(row: PathRow, ffn: ExpertFfn, block: bool = True, **params) -> Stage:
    """The row's experts behind its exchange; params: seq_len, capacity_factor (one device) and axis_name, impl,
    capacity, layout (EP). Under EP `ffn` runs this rank's experts."""
    stage = expert_stage(row.exchange, ffn, block, **params)
    if row.ep_wrapper is None:
        return stage
    local = LOCAL_EXCHANGES[row.exchange](**params)
    return EP_WRAPPERS[row.ep_wrapper](local, stage=stage, ffn=ffn, **params)


def run_stage(stage: Stage, x: jax.Array, expert_ids: jax.Array, combine_w: jax.Array,
              n_experts: int) -> tuple[jax.Array, jax.Array]:
    """x (B, S, D), expert_ids / combine_w (B, S, k) -> (y (B, S, D), copies computed () int32)."""
    b, s, d = x.shape
    k = expert_ids.shape[-1]
    y, computed = stage(x.reshape(b * s, d), expert_ids.reshape(b * s, k),
                        combine_w.reshape(b * s, k).astype(jnp.float32), n_experts)
    return y.reshape(b, s, d), computed


MoEPath = Callable[[jax.Array, Routing, ExpertWeights], "tuple[jax.Array, ExpertStats]"]


def moe_path_fn(moe_path: str, capacity_factor: float, expert_backward: str = "block",
                swiglu_impl: str = "auto") -> MoEPath:
    """The one-device path `(x (B, S, D), routing, weights) -> (y (B, S, D), ExpertStats)`. Paths with the permute
    exchange run the expert block ("block") and the fused SwiGLU kernels where the device has them ("auto"); the model
    always runs these defaults, and tests pass "autodiff" / "kernel" / "xla" as references."""
    row = path_row(moe_path)

    def run(x: jax.Array, routing: Routing, weights: ExpertWeights) -> tuple[jax.Array, ExpertStats]:
        gemms = device_gemms(row, moe_path, swiglu_impl)
        b, s, _ = x.shape
        k = routing.expert_ids.shape[-1]
        ffn = ExpertFfn(weights.astype(x.dtype), gemms)
        stage = build_stage(row, ffn, expert_backward == "block", seq_len=s, capacity_factor=capacity_factor)
        y, computed = run_stage(stage, x, routing.expert_ids, routing.weights, weights.n_experts)
        dropped = 1.0 - computed.astype(jnp.float32) / (b * s * k)
        return y, ExpertStats(routed_load(routing.expert_ids, weights.n_experts), dropped)

    return run
