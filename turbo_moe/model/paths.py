"""The MoE paths: one table mapping (moe_path, ep_exchange) to its (exchange, expert GEMM) pair.

A path lays the token copies out by expert (the exchange), runs `experts.expert_ffn` with a grouped
GEMM, and brings the outputs back. One device (or one data-parallel shard) uses the ONE_DEVICE rows;
under a mesh with an `expert` axis, `expert_parallel.ep_moe_path` uses the row of the configured
`ep_exchange`, whose exchange wraps the one-device one. Adding a path is one row per ep_exchange here
plus its exchange (`exchanges.py`, `ep_exchange.py`) or GEMM (`gemms.py`), and its name in
`config.MOE_PATHS`.

For accounting: `MOE_PATHS` (the path names), `DROPLESS_PATHS`, `expert_capacity` (dense_cf's slots).
"""

from __future__ import annotations

import functools
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp

from turbo_moe.model import ep_exchange as ep
from turbo_moe.model import exchanges
from turbo_moe.model.config import EP_EXCHANGES, MOE_PATHS
from turbo_moe.model.exchanges import expert_capacity  # noqa: F401  (re-exported for accounting)
from turbo_moe.model.experts import ExpertStats, ExpertWeights, expert_ffn, routed_load
from turbo_moe.model.gemms import GEMMS, SwigluKernels, require, swiglu_kernels
from turbo_moe.model.router import Routing

ONE_DEVICE = "one_device"  # the ep_exchange column of the rows used without expert parallelism


class PathRow(NamedTuple):
    exchange: str  # a one-device exchange: key of LOCAL_EXCHANGES
    ep_wrapper: str | None  # the expert-parallel exchange around it: key of EP_WRAPPERS (None: one device)
    gemm: str  # key of gemms.GEMMS


PATHS: dict[tuple[str, str], PathRow] = {
    # (moe_path, ep_exchange):                  exchange     EP wrapper            expert GEMM
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


def path_row(moe_path: str, ep_exchange: str = ONE_DEVICE) -> PathRow:
    if moe_path not in MOE_PATHS:
        raise ValueError(f"moe_path: unknown path {moe_path!r}; expected one of {MOE_PATHS}")
    if (moe_path, ep_exchange) not in PATHS:
        raise ValueError(f"ep_exchange: got {ep_exchange!r}; expected one of {EP_EXCHANGES}")
    return PATHS[(moe_path, ep_exchange)]


def build_exchange(row: PathRow, **params) -> exchanges.Exchange:
    """The row's exchange; params: seq_len, capacity_factor (one device) and axis_name, impl, capacity, layout (EP)."""
    local = LOCAL_EXCHANGES[row.exchange](**params)
    return local if row.ep_wrapper is None else EP_WRAPPERS[row.ep_wrapper](local, **params)


def run_exchange(exchange: exchanges.Exchange, gemm: str, x: jax.Array, expert_ids: jax.Array,
                 combine_w: jax.Array, weights: ExpertWeights, n_experts: int,
                 expert_backward: str = "block", swiglu_impl: str = "auto") -> tuple[jax.Array, jax.Array]:
    """x (B, S, D), expert_ids / combine_w (B, S, k) -> (y (B, S, D), copies computed () int32)."""
    b, s, d = x.shape
    k = expert_ids.shape[-1]
    fused = swiglu_kernels(gemm, swiglu_impl)
    ffn = ExpertFfn(weights, GEMMS[gemm], expert_backward == "block", fused)
    y, computed = exchange(x.reshape(b * s, d), expert_ids.reshape(b * s, k),
                           combine_w.reshape(b * s, k).astype(jnp.float32), n_experts, ffn)
    return y.reshape(b, s, d), computed


class ExpertFfn(NamedTuple):
    """The exchanges' `ffn(rows, group_sizes)`: `experts.expert_ffn` with these weights and grouped GEMM.
    With `block`, the permute exchange runs permute -> experts -> unpermute as `expert_block.expert_block`."""

    weights: ExpertWeights
    gemm: Callable
    block: bool = False
    swiglu_kernels: SwigluKernels | None = None  # the block's SwiGLU kernels' GEMM calls (gemms.SWIGLU_KERNELS)

    def __call__(self, rows, group_sizes):
        return expert_ffn(rows, self.weights, group_sizes, self.gemm)


MoEPath = Callable[[jax.Array, Routing, ExpertWeights], "tuple[jax.Array, ExpertStats]"]


def moe_path_fn(moe_path: str, capacity_factor: float, expert_backward: str = "block",
                swiglu_impl: str = "auto") -> MoEPath:
    """The one-device path `(x (B, S, D), routing, weights) -> (y (B, S, D), ExpertStats)`. Paths with the permute
    exchange run the expert block ("block") and the SwiGLU kernels where the device has them ("auto"); the model always
    runs these defaults, and tests pass "autodiff" / "kernel" / "xla" as references."""
    row = path_row(moe_path)

    def run(x: jax.Array, routing: Routing, weights: ExpertWeights) -> tuple[jax.Array, ExpertStats]:
        require(row.gemm, moe_path)
        b, s, _ = x.shape
        k = routing.expert_ids.shape[-1]
        exchange = build_exchange(row, seq_len=s, capacity_factor=capacity_factor)
        y, computed = run_exchange(exchange, row.gemm, x, routing.expert_ids, routing.weights,
                                   weights.astype(x.dtype), weights.n_experts, expert_backward, swiglu_impl)
        dropped = 1.0 - computed.astype(jnp.float32) / (b * s * k)
        return y, ExpertStats(routed_load(routing.expert_ids, weights.n_experts), dropped)

    return run
