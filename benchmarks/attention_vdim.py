"""cuDNN flash attention for MLA's head dims: v zero-padded to d_qk (what the model does) vs v at its own width, and
all three padded to 128 (--pad-to).

MLA's queries/keys are wider than its values (`reduced`: 64 + 32 = 96 vs 64). `jax.nn.dot_product_attention`
wants one head dim for q, k and v, so `turbo_moe.model.layers.causal_attention` pads v with zeros and
slices the output; cuDNN itself accepts d_v != d_qk (jax's cuDNN entry point checks only d_q == d_k). This
script checks the unpadded call against a float32 reference and times both, forward and forward+backward.

    python benchmarks/attention_vdim.py --out results.json [--batch 8 --seq 2048 --heads 16 --dqk 96 --dv 64]
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _provenance import provenance  # noqa: E402


def padded(q, k, v):
    width = q.shape[-1]
    v_pad = jnp.pad(v, [(0, 0)] * 3 + [(0, width - v.shape[-1])])
    out = jax.nn.dot_product_attention(q, k, v_pad, scale=q.shape[-1] ** -0.5, is_causal=True,
                                       implementation="cudnn")
    return out[..., :v.shape[-1]]


def padded_to(width):
    """q, k and v zero-padded to `width` (cuDNN's most-tuned head dim is 128): more FLOPs, maybe a faster kernel."""
    def attend(q, k, v):
        pad = lambda t: jnp.pad(t, [(0, 0)] * 3 + [(0, width - t.shape[-1])])
        out = jax.nn.dot_product_attention(pad(q), pad(k), pad(v), scale=q.shape[-1] ** -0.5, is_causal=True,
                                           implementation="cudnn")
        return out[..., :v.shape[-1]]
    return attend


def unpadded(q, k, v):
    from jax._src.cudnn.fused_attention_stablehlo import MaskType, dot_product_attention

    return dot_product_attention(q, k, v, scale=q.shape[-1] ** -0.5, mask_type=MaskType.CAUSAL)


def reference(q, k, v):
    q, k, v = (t.astype(jnp.float32) for t in (q, k, v))
    s = jnp.einsum("bqhd,bkhd->bhqk", q, k) * q.shape[-1] ** -0.5
    mask = jnp.tril(jnp.ones((q.shape[1], k.shape[1]), bool))
    p = jax.nn.softmax(jnp.where(mask, s, -jnp.inf), axis=-1)
    return jnp.einsum("bhqk,bkhd->bqhd", p, v)


def inputs(batch, seq, heads, dqk, dv, seed=0):
    ks = jax.random.split(jax.random.key(seed), 4)
    q, k = (jax.random.normal(key, (batch, seq, heads, dqk), jnp.bfloat16) for key in ks[:2])
    v = jax.random.normal(ks[2], (batch, seq, heads, dv), jnp.bfloat16)
    g = jax.random.normal(ks[3], (batch, seq, heads, dv), jnp.bfloat16)
    return q, k, v, g


def fwd_bwd(attend):
    def loss(q, k, v, g):
        return jnp.sum(attend(q, k, v).astype(jnp.float32) * g.astype(jnp.float32))
    return jax.jit(jax.grad(loss, argnums=(0, 1, 2)))


def timed(fn, args, reps):
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--dqk", type=int, default=96)
    p.add_argument("--dv", type=int, default=64)
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--pad-to", type=int, default=128, help="the 'padded_to' case's head dim (0: no such case)")
    args = p.parse_args(argv)
    record = {"script": "benchmarks/attention_vdim.py", "parameters": vars(args) | {"out": str(args.out)},
              **provenance()}

    # Correctness on a smaller problem against float32: outputs and all three gradients.
    q, k, v, g = inputs(2, 512, args.heads, args.dqk, args.dv, seed=1)
    checks = {}
    ref_out = reference(q, k, v)
    ref_grads = fwd_bwd(reference)(q, k, v, g)
    cases = (("padded", padded), ("unpadded", unpadded))
    if args.pad_to > max(args.dqk, args.dv):
        cases += ((f"padded_to_{args.pad_to}", padded_to(args.pad_to)),)
    for name, attend in cases:
        try:
            out = jax.jit(attend)(q, k, v).astype(jnp.float32)
            grads = fwd_bwd(attend)(q, k, v, g)
        except Exception as exc:  # cuDNN may refuse the shape: a finding, recorded
            checks[name] = {"error": f"{type(exc).__name__}: {str(exc)[:500]}"}
            continue
        rel = lambda a, b: float(jnp.max(jnp.abs(a.astype(jnp.float32) - b)) / jnp.max(jnp.abs(b)))
        checks[name] = {"out_max_rel_err": rel(out, ref_out),
                        **{f"d{n}_max_rel_err": rel(a, b) for n, a, b in zip("qkv", grads, ref_grads)}}
    record["checks_vs_float32"] = checks

    q, k, v, g = inputs(args.batch, args.seq, args.heads, args.dqk, args.dv)
    # causal: half the score matrix; fwd 2 matmuls (QK^T, PV), bwd 5 (dV, dP, dS->dQ, dK, and QK^T again)
    flops_fwd = args.batch * args.heads * args.seq ** 2 * (args.dqk + args.dv)  # 2 * (1/2 causal) * ...
    timings = {}
    for name, attend in cases:
        if "error" in checks[name]:
            continue
        fwd = timed(jax.jit(attend), (q, k, v), args.reps)
        both = timed(fwd_bwd(attend), (q, k, v, g), args.reps)
        timings[name] = {"fwd_ms": fwd * 1e3, "fwd_bwd_ms": both * 1e3,
                         "useful_fwd_tflops": flops_fwd / fwd / 1e12}
        print(f"{name:9s} fwd {fwd * 1e3:7.3f} ms  fwd+bwd {both * 1e3:7.3f} ms  checks {checks[name]}", flush=True)
    record["timings"] = timings
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(record, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
