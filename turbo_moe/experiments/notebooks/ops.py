"""What ``01_ops`` shows: our grouped GEMM against ``jax.lax.ragged_dot`` (values, gradients, compiled
memory, timing) and the permute/unpermute round trip, on one routed MoE problem.

A problem is T tokens of width H routed top-k over E experts, each expert a (H, F) matrix:
``permute`` sorts the T*k token copies by expert, the grouped GEMM multiplies each expert's rows by its
weight, ``unpermute`` brings rows back and sums the k copies with their router weights.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
import pandas as pd

from turbo_moe.ops import grouped_gemm, permute, unpermute

ROUTINGS = ("uniform", "skewed", "empty_groups")
DTYPES = ("float32", "bfloat16", "float16")
# Max |ours - ragged_dot| / max|ragged_dot| allowed per dtype (both accumulate in f32; outputs round).
TOLERANCE = {"float32": 1e-5, "bfloat16": 2e-2, "float16": 2e-3}


@dataclasses.dataclass(frozen=True)
class Problem:
    x: jax.Array  # (T, H) tokens
    expert_ids: jax.Array  # (T, k) int32
    weights: jax.Array  # (T, k) float32 router weights, rows sum to 1
    w: jax.Array  # (E, H, F) expert weights
    num_experts: int
    routing: str

    @property
    def shape_text(self) -> str:
        t, h = self.x.shape
        e, _, f = self.w.shape
        return f"T={t} k={self.expert_ids.shape[1]} H={h} F={f} E={e} ({self.routing})"


def _positive_int(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"parameter {name}: must be a positive int, got {value!r}")
    return value


def make_problem(
    num_tokens: int, hidden: int, ffn: int, num_experts: int, top_k: int, *,
    dtype: str = "float32", routing: str = "uniform", seed: int = 0,
) -> Problem:
    """A random routed problem. ``routing``: uniform | skewed (Zipf-like) | empty_groups (half unused)."""
    for name, value in (("num_tokens", num_tokens), ("hidden", hidden), ("ffn", ffn),
                        ("num_experts", num_experts), ("top_k", top_k)):
        _positive_int(name, value)
    if top_k > num_experts:
        raise ValueError(f"parameter top_k: {top_k} > num_experts={num_experts}")
    if dtype not in DTYPES:
        raise ValueError(f"parameter dtype: expected one of {DTYPES}, got {dtype!r}")
    if routing not in ROUTINGS:
        raise ValueError(f"parameter routing: expected one of {ROUTINGS}, got {routing!r}")
    rng = np.random.default_rng(seed)
    experts = np.arange(num_experts)
    if routing == "empty_groups":
        experts = experts[: max(top_k, num_experts // 2)]
    prob = 1.0 / (np.arange(len(experts)) + 1.0) ** (1.2 if routing == "skewed" else 0.0)
    prob = prob / prob.sum()
    # k distinct experts per token, drawn with the routing's preference.
    ids = np.stack([rng.choice(experts, size=top_k, replace=False, p=prob) for _ in range(num_tokens)])
    weights = rng.random((num_tokens, top_k)).astype(np.float32) + 0.1
    weights /= weights.sum(axis=1, keepdims=True)
    dt = jnp.dtype(dtype)
    x = jnp.asarray(rng.standard_normal((num_tokens, hidden)), dt)  # (T, H)
    w = jnp.asarray(rng.standard_normal((num_experts, hidden, ffn)) / np.sqrt(hidden), dt)  # (E, H, F)
    return Problem(x, jnp.asarray(ids, jnp.int32), jnp.asarray(weights), w, num_experts, routing)


def _impls() -> dict[str, Callable]:
    return {"turbo grouped_gemm": grouped_gemm, "jax.lax.ragged_dot": jax.lax.ragged_dot}


def _sorted_inputs(p: Problem):
    x_sorted, group_sizes, _ = permute(p.x, p.expert_ids, p.num_experts)  # (T*k, H), (E,)
    return x_sorted, group_sizes


def _loss_fn(gemm: Callable) -> Callable:
    """A scalar of the GEMM output, so that jax.grad gives both dgrad (lhs) and wgrad (rhs)."""
    def loss(lhs, rhs, group_sizes):
        out = gemm(lhs, rhs, group_sizes, preferred_element_type=jnp.float32)  # (T*k, F)
        return jnp.sum(jnp.sin(out))
    return loss


def compare_with_ragged_dot(p: Problem) -> pd.DataFrame:
    """Forward, dgrad and wgrad of our grouped GEMM against jax.lax.ragged_dot on the same inputs."""
    lhs, group_sizes = _sorted_inputs(p)
    results = {}
    for name, gemm in _impls().items():
        out = gemm(lhs, p.w, group_sizes, preferred_element_type=jnp.float32)
        d_lhs, d_rhs = jax.grad(_loss_fn(gemm), argnums=(0, 1))(lhs, p.w, group_sizes)
        results[name] = {"forward": out, "dgrad (d lhs)": d_lhs, "wgrad (d rhs)": d_rhs}
    ours, ref = results["turbo grouped_gemm"], results["jax.lax.ragged_dot"]
    tol = TOLERANCE[str(p.x.dtype)]
    rows = []
    for part in ours:
        a, b = np.asarray(ours[part], np.float32), np.asarray(ref[part], np.float32)
        err = float(np.max(np.abs(a - b))) / max(float(np.max(np.abs(b))), 1e-30)
        rows.append({"output": part, "shape": str(a.shape), "max rel. error": err, "tolerance": tol,
                     "agrees": err <= tol})
    return pd.DataFrame(rows).set_index("output")


def compiled_memory(p: Problem) -> pd.DataFrame:
    """XLA's memory analysis of the compiled forward+backward of each implementation (bytes)."""
    lhs, group_sizes = _sorted_inputs(p)
    rows = []
    for name, gemm in _impls().items():
        step = jax.jit(jax.value_and_grad(_loss_fn(gemm), argnums=(0, 1)))
        mem = step.lower(lhs, p.w, group_sizes).compile().memory_analysis()
        row = {"implementation": name}
        for field in ("argument_size_in_bytes", "output_size_in_bytes", "temp_size_in_bytes"):
            row[field.replace("_size_in_bytes", " (MiB)")] = getattr(mem, field, float("nan")) / 2**20
        rows.append(row)
    return pd.DataFrame(rows).set_index("implementation")


def _time(fn: Callable, *args, iters: int) -> float:
    jax.block_until_ready(fn(*args))  # compile + warm up
    start = time.perf_counter()
    for _ in range(iters):
        out = fn(*args)
    jax.block_until_ready(out)
    return (time.perf_counter() - start) / iters


def timing_table(p: Problem, iters: int = 10, progress: Callable[[str], None] | None = None) -> pd.DataFrame:
    """Milliseconds and TFLOP/s of forward and forward+backward per implementation on this device.
    ``progress`` (e.g. ``print``) hears about each measurement as it starts and ends: on a CPU the whole
    table takes a minute or more."""
    _positive_int("iters", iters)
    started = time.perf_counter()
    lhs, group_sizes = _sorted_inputs(p)
    rows_used = int(np.asarray(group_sizes).sum())
    fwd_flops = 2.0 * rows_used * p.w.shape[1] * p.w.shape[2]
    rows = []
    for name, gemm in _impls().items():
        fwd = jax.jit(lambda a, b, g, gemm=gemm: gemm(a, b, g, preferred_element_type=jnp.float32))
        train = jax.jit(jax.value_and_grad(_loss_fn(gemm), argnums=(0, 1)))
        for what, fn, flops in (("forward", fwd, fwd_flops), ("forward+backward", train, 3 * fwd_flops)):
            if progress is not None:
                progress(f"timing {name}, {what} (compile + {iters} calls) ...")
            seconds = _time(fn, lhs, p.w, group_sizes, iters=iters)
            if progress is not None:
                progress(f"  {1e3 * seconds:.3f} ms per call; {time.perf_counter() - started:.0f} s so far")
            rows.append({"implementation": name, "pass": what, "ms": 1e3 * seconds,
                         "TFLOP/s": flops / seconds / 1e12})
    table = pd.DataFrame(rows)
    table["device"] = jax.devices()[0].device_kind
    return table


def permute_round_trip(p: Problem) -> pd.DataFrame:
    """permute -> unpermute with the router weights must give back x (weights sum to 1 per token)."""
    x_sorted, group_sizes, handle = permute(p.x, p.expert_ids, p.num_experts)  # (T*k, H), (E,)
    back = unpermute(x_sorted, handle, p.weights)  # (T, H)
    expected_sizes = np.bincount(np.asarray(p.expert_ids).ravel(), minlength=p.num_experts)
    x32 = np.asarray(p.x, np.float32)
    err = float(np.max(np.abs(np.asarray(back, np.float32) - x32))) / max(float(np.max(np.abs(x32))), 1e-30)
    rows_sorted = np.asarray(p.expert_ids).ravel()[np.argsort(np.asarray(p.expert_ids).ravel(), kind="stable")]
    return pd.DataFrame({
        "check": ["group_sizes == bincount(expert_ids)", "rows sorted by expert",
                  "unpermute(permute(x), weights) == x", "empty experts"],
        "result": [bool(np.array_equal(np.asarray(group_sizes), expected_sizes)),
                   bool(np.all(np.diff(rows_sorted) >= 0)),
                   err <= TOLERANCE[str(p.x.dtype)],
                   int(np.sum(expected_sizes == 0))],
        "detail": [str(np.asarray(group_sizes).tolist()), f"{x_sorted.shape[0]} rows",
                   f"max rel. error {err:.2e}", f"of {p.num_experts}"],
    }).set_index("check")
