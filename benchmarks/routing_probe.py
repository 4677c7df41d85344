"""Why does routing collapse? Per-MoE-layer router diagnostics at init and over the first training steps.

A scaled-down `reduced`-like model (same init_std, router settings and routing proportions: 64 experts in
8 groups, top-4 groups, top-6, routed scale 2.5, bias rate 1e-3, balance weight 1e-4, MTP depth 1; much
smaller d_model, depth and vocab) trains on Shakespeare or synthetic tokens with the same AdamW recipe as
`turbo_moe.train` (warm-up + cosine, clip 1, wd 0.1 on matrices; bias update after the weight update).
Each step records, for every MoE layer (MTP block included), from the router's own inputs in the
training forward:

  cos        mean pairwise cosine similarity of router inputs across the tokens of a sequence
  mean_norm  |mean of the unit router inputs| (the shared direction's share)
  spread     mean over tokens of std over experts of the sigmoid score (per-token spread)
  offset     std over experts of the token-mean score (what every token shares: an expert's "level")
  top1_same  fraction of tokens whose top-1 (biased) expert is the layer's most common top-1
  groups_same fraction of tokens whose selected group set is the most common one
  load       max/mean token copies per expert
  gap        mean score of the most loaded expert minus the mean over experts of their mean scores:
             the score distance the bias has to cover, in bias steps: gap / rate
  drift      RMS over experts of the change of their token-mean logit (score) since the previous step
             (the router weights' own speed, compared with the bias's `rate` per step)

Run (CPU, ~minutes):  nice .venv/bin/python benchmarks/routing_probe.py --steps 120 --variant baseline
Results: printed, and saved to experiments/results/routing_probe/<name>.json.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import math
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from turbo_moe.data import BatchIterator, load_dataset, unigram_log_prior
from turbo_moe.model import DeepSeekModel, get_config, lm_loss, update_router_bias
from turbo_moe.model import router as router_mod
from turbo_moe.model import stack as stack_mod
from turbo_moe.provenance import collect as collect_provenance
from turbo_moe.train import TrainConfig
from turbo_moe.train.step import make_optimizer

REPO = Path(__file__).resolve().parents[1]

# Scaled-down `reduced`: everything that decides routing is the preset's; sizes shrink.
PROBE_SIZES = dict(
    d_model=256, n_layers=4, n_dense_layers=1, dense_ffn_dim=512, moe_ffn_dim=64, n_heads=4,
    q_lora_rank=128, kv_lora_rank=64, qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32,
    vocab_size=2048, max_seq_len=256, remat_policy="none", dtype="float32", moe_path="turbo",
)


def probe_config(**overrides):
    return get_config("reduced", **{**PROBE_SIZES, **overrides})


# ------------------------------------------------------------------ per-layer statistics (in jax)
def router_stats(x, logits, expert_ids, bias, cfg, selection=None, center=None):
    """Scalar diagnostics of one router call: x (B,S,D), logits (B,S,E) f32, expert_ids (B,S,k);
    with router centering, `selection` (B,S,E) the scores top-k reads and `center` the running mean."""
    x = x.astype(jnp.float32)
    b, s, _ = x.shape
    e = cfg.n_experts
    unit = x / (jnp.linalg.norm(x, axis=-1, keepdims=True) + 1e-12)
    summed = unit.sum(1)  # (B, D)
    cos = (jnp.sum(summed * summed, -1) - s) / (s * (s - 1))  # mean pairwise cosine, (B,)
    mean_norm = jnp.linalg.norm(summed / s, axis=-1)  # (B,)
    scores = jax.nn.sigmoid(logits)  # (B, S, E)
    spread = jnp.std(scores, axis=-1).mean()
    token_mean = scores.reshape(-1, e).mean(0)  # (E,)
    offset = jnp.std(token_mean)
    load = jnp.zeros((e,), jnp.float32).at[expert_ids.reshape(-1)].add(1.0)
    select = scores if selection is None else selection
    top1 = jnp.argmax(select + bias, axis=-1).reshape(-1)
    top1_counts = jnp.zeros((e,), jnp.float32).at[top1].add(1.0)
    per_group = e // cfg.n_groups
    group_hot = jax.nn.one_hot(expert_ids // per_group, cfg.n_groups).max(-2).reshape(-1, cfg.n_groups)
    code = (group_hot * (2 ** jnp.arange(cfg.n_groups))).sum(-1).astype(jnp.int32)  # group set as bits
    code_counts = jnp.zeros((2 ** cfg.n_groups,), jnp.float32).at[code].add(1.0)
    hot = jnp.argmax(load)
    return dict(
        cos=cos.mean(), mean_norm=mean_norm.mean(), spread=spread, offset=offset,
        top1_same=top1_counts.max() / top1.size, groups_same=code_counts.max() / code.size,
        load=load.max() / load.mean(), gap=token_mean[hot] - token_mean.mean(),
        mean_logit=logits.reshape(-1, e).mean(0), mean_score=token_mean,
        bias_range=bias.max() - bias.min(), load_vec=load,
        # what selection reads: std over experts of the token-mean selection score (levels left), and
        # the mean over experts of its std over tokens (what tells tokens apart), vs the bias range
        sel_offset=jnp.std(select.reshape(-1, e).mean(0)), sel_token_std=jnp.std(select.reshape(-1, e), 0).mean(),
        center_resid=(jnp.linalg.norm(x.reshape(-1, x.shape[-1]).mean(0) - center)
                      / (jnp.linalg.norm(x.reshape(-1, x.shape[-1]).mean(0)) + 1e-12)
                      if center is not None and center.shape[-1] == x.shape[-1] else jnp.float32(jnp.nan)),
    )


class _MethodRecorder:
    """Swaps `owner.<name>` for `self.wrap(original)` inside a `with` block; the wrapped method sends one
    dict of statistics per call to the host (ordered callbacks: program order). `take()` returns one step's
    rows and checks their count."""

    def __init__(self, owner, name: str, per_step: int, what: str):
        self.owner, self.name, self.per_step, self.what = owner, name, per_step, what
        self.rows: list[dict] = []
        self._orig = getattr(owner, name)

    def _store(self, stats):
        self.rows.append({k: np.asarray(v) for k, v in stats.items()})

    def wrap(self, orig):
        raise NotImplementedError

    def __enter__(self):
        setattr(self.owner, self.name, self.wrap(self._orig))
        return self

    def __exit__(self, *exc):
        setattr(self.owner, self.name, self._orig)

    def take(self):
        rows, self.rows = self.rows, []
        if len(rows) != self.per_step:
            raise RuntimeError(f"expected {self.per_step} {self.what} calls per step, got {len(rows)}")
        return rows


class Recorder(_MethodRecorder):
    """Router.__call__ -> `router_stats` of every router call: the MoE stack's layers, then the MTP blocks,
    i.e. the row order of `expert_load`."""

    def __init__(self, n_layers: int):
        super().__init__(router_mod.Router, "__call__", n_layers, "router")

    def wrap(self, orig):
        def patched(router, x):
            routing = orig(router, x)
            logits = jnp.einsum("...d,de->...e", x.astype(jnp.float32), router.gate())
            selection = center = None
            if router.cfg.router_center_ema > 0:  # as Router.__call__ selects
                center = jax.lax.stop_gradient(router.center[...])
                selection = router_mod.centered_selection(x, logits, router.gate(), center)
            stats = router_stats(jax.lax.stop_gradient(x), jax.lax.stop_gradient(logits), routing.expert_ids,
                                 jax.lax.stop_gradient(router.bias[...]), router.cfg, selection, center)
            jax.debug.callback(self._store, stats, ordered=True)
            return routing

        return patched


def _shared(v):
    """|token-mean of v| / RMS over tokens of |v|, per sequence, averaged: 1 when every token carries the
    same vector, ~1/sqrt(S) for independent ones. v (B, S, D)."""
    v = v.astype(jnp.float32)
    mean = v.mean(1)  # (B, D)
    return (jnp.linalg.norm(mean, axis=-1) / (jnp.sqrt(jnp.mean(jnp.sum(v * v, -1), 1)) + 1e-12)).mean()


def _cos(a, b):
    return jnp.sum(a * b, -1) / (jnp.linalg.norm(a, axis=-1) * jnp.linalg.norm(b, axis=-1) + 1e-12)


def block_stats(x, attn_out, ffn_in, ffn_out):
    """Which sub-layer writes the shared direction: x the block's input (B,S,D), attn_out the attention
    delta, ffn_in the normalised FFN input (the router's input in a MoE block), ffn_out the FFN delta."""
    x, a, y = (t.astype(jnp.float32) for t in (x, attn_out, ffn_out))
    mid = x + a
    out = mid + y
    m_mid, m_out = mid.mean(1), out.mean(1)  # (B, D)
    rms = lambda t: jnp.sqrt(jnp.mean(t * t))
    dim_share = (m_out ** 2).max(-1) / (jnp.sum(m_out ** 2, -1) + 1e-12)  # shared direction in one dim?
    peak = jnp.abs(out).max() / (jnp.median(jnp.abs(out)) + 1e-12)  # massive activations
    return dict(
        shared_in=_shared(x), shared_attn=_shared(a), shared_mid=_shared(mid), shared_ffn_in=_shared(ffn_in),
        shared_ffn=_shared(y), shared_out=_shared(out),
        rms_in=rms(x), rms_attn=rms(a), rms_ffn=rms(y),
        # how much of the residual's token-mean each delta's token-mean supplies (projection / |mean|)
        attn_along=(jnp.sum(a.mean(1) * m_mid, -1) / (jnp.sum(m_mid * m_mid, -1) + 1e-12)).mean(),
        ffn_along=(jnp.sum(y.mean(1) * m_out, -1) / (jnp.sum(m_out * m_out, -1) + 1e-12)).mean(),
        cos_attn_mean_in=_cos(a.mean(1), x.mean(1)).mean(), top_dim_share=dim_share.mean(), peak_ratio=peak,
    )


class BlockRecorder(_MethodRecorder):
    """DecoderBlock.__call__ (same computation, no named scopes) -> `block_stats` of every block, dense, MoE
    and MTP, in program order."""

    def __init__(self, n_blocks: int):
        super().__init__(stack_mod.DecoderBlock, "__call__", n_blocks, "block")

    def wrap(self, orig):
        def patched(block, x, cos, sin):
            a = block.attn(block.attn_norm(x), cos, sin)
            mid = x + a
            ffn_in = block.ffn_norm(mid)
            y, stats = block.ffn(ffn_in) if block.is_moe else (block.ffn(ffn_in), None)
            sg = jax.lax.stop_gradient
            jax.debug.callback(self._store, block_stats(sg(x), sg(a), sg(ffn_in), sg(y)), ordered=True)
            return mid + y, stats

        return patched


# ------------------------------------------------------------------ training (mirrors turbo_moe.train.step)
def make_step(graphdef, tx, bias_schedule):
    def step_fn(params, extra, opt_state, batch, step):
        grad_fn = nnx.value_and_grad(lm_loss, argnums=nnx.DiffState(0, nnx.Param), has_aux=True)
        forward = nnx.merge(graphdef, params, extra)
        (_, metrics), grads = grad_fn(forward, batch)
        updates, opt_state = tx.update(grads, opt_state, params)
        params = optax.apply_updates(params, updates)
        model = nnx.merge(graphdef, params, nnx.split(forward, nnx.Param, ...)[2])  # router centering state
        update_router_bias(model, jax.lax.stop_gradient(metrics["expert_load"]), bias_schedule(step))
        _, _, extra = nnx.split(model, nnx.Param, ...)
        return params, extra, opt_state, metrics

    return jax.jit(step_fn)


VARIANTS = {
    # name: (model overrides, bias-rate schedule builder (cfg, steps) -> step -> rate)
    "baseline": ({}, None),
    "rate1e-2": ({"router_bias_rate": 1e-2}, None),
    "bal1e-2": ({"balance_loss_weight": 1e-2}, None),
    "bal1e-3": ({"balance_loss_weight": 1e-3}, None),
    "router_fanin": ({"router_init_std": 256 ** -0.5}, None),  # d_model ** -0.5 at the probe's d_model
}


def run_probe(args):
    overrides = dict(VARIANTS[args.variant][0]) if args.variant in VARIANTS else {}
    for item in args.override or []:
        key, value = item.split("=", 1)
        try:
            overrides[key] = json.loads(value)
        except json.JSONDecodeError:
            overrides[key] = value
    router_mod.CENTER_SPACE = args.center_space
    cfg = probe_config(**overrides)
    tc = TrainConfig(model=cfg, steps=args.steps, learning_rate=args.lr, warmup_steps=args.warmup,
                     lr_schedule_steps=max(args.schedule_steps, args.steps, args.warmup), per_device_batch=args.batch, seq_len=args.seq, progress=False, eval_batches=0)
    tx = make_optimizer(tc)
    rate_fn = _rate_schedule(args, cfg)
    data = load_dataset(args.dataset, seq_len=args.seq, vocab_size=cfg.vocab_size)
    batches = BatchIterator(data.train, args.batch, seed=args.seed)
    model = DeepSeekModel(cfg, rngs=nnx.Rngs(args.seed))
    if cfg.head_bias == "unigram":  # as turbo_moe.train does at init
        model.head_bias[...] = jnp.asarray(unigram_log_prior(data.train, cfg.vocab_size))
    graphdef, params, extra = nnx.split(model, nnx.Param, ...)
    opt_state = tx.init(params)
    recorder = Recorder(cfg.n_router_layers)
    blocks = BlockRecorder(cfg.n_layers + cfg.mtp_depth) if args.block_stats else contextlib.nullcontext()
    history = []
    prev_logit = None
    t0 = time.time()
    with recorder, blocks:
        step_fn = make_step(graphdef, tx, rate_fn)
        for step in range(args.steps):
            batch = {k: jnp.asarray(v) for k, v in batches.batch_at(step).items()}
            params, extra, opt_state, metrics = step_fn(params, extra, opt_state, batch, jnp.int32(step))
            ce = float(metrics["ce_loss"])
            jax.effects_barrier()
            layers = recorder.take()
            rows = []
            for li, st in enumerate(layers):
                logit = st["mean_logit"]
                drift = float(np.sqrt(np.mean((logit - prev_logit[li]) ** 2))) if prev_logit is not None else math.nan
                drift_score = (float(np.sqrt(np.mean((st["mean_score"] - prev_score[li]) ** 2)))
                               if prev_logit is not None else math.nan)
                rows.append({k: float(v) for k, v in st.items() if np.ndim(v) == 0} | {
                    "drift_logit": drift, "drift_score": drift_score,
                    "mean_score": [round(float(v), 5) for v in st["mean_score"]],
                    "load_vec": [int(v) for v in st["load_vec"]]})
            prev_logit = [st["mean_logit"] for st in layers]
            prev_score = [st["mean_score"] for st in layers]
            history.append({"step": step, "ce": ce, "rate": float(rate_fn(step)), "layers": rows})
            if args.block_stats:
                history[-1]["blocks"] = [{k: float(v) for k, v in r.items()} for r in blocks.take()]
            if step % args.print_every == 0 or step == args.steps - 1:
                _print_row(history[-1], time.time() - t0)
    if args.floor_batches:
        history.append({"floor": routing_floor(graphdef, params, extra, batches, args.steps, args.floor_batches)})
    return cfg, tc, history


def routing_floor(graphdef, params, extra, batches, first, n):
    """The batch-to-batch part of the imbalance: the trained weights and bias frozen, max/mean load per
    router row on `n` batches the run did not train on (steps first .. first + n - 1 of the same stream).
    A perfectly adjusted bias cannot remove this part; T1 counts it at every step."""
    model = nnx.merge(graphdef, params, extra)

    @nnx.jit
    def loads(model, batch):
        load = lm_loss(model, batch)[1]["expert_load"]  # (rows, E)
        return load.max(-1) / load.mean(-1)

    rows = [np.asarray(loads(model, {k: jnp.asarray(v) for k, v in batches.batch_at(first + i).items()}))
            for i in range(n)]
    worst = np.array([r.max() for r in rows])
    print(f"floor over {n} unseen batches (frozen weights and bias): worst row mean {worst.mean():.3f}, "
          f"p90 {np.quantile(worst, 0.9):.3f}, max {worst.max():.3f}, batches with a row > 2.0: {(worst > 2).mean():.1%}")
    return {"batches": n, "first_step": first, "load_per_row": [[round(float(v), 4) for v in r] for r in rows],
            "worst_mean": float(worst.mean()), "worst_max": float(worst.max()), "frac_over_2": float((worst > 2).mean())}


def _rate_schedule(args, cfg):
    if args.bias_schedule == "constant":
        return lambda step: cfg.router_bias_rate
    if args.bias_schedule == "module":  # the pure schedule in turbo_moe.model.router (if present)
        return lambda step: router_mod.bias_rate_at(cfg, step)
    raise ValueError(args.bias_schedule)


def _print_row(row, elapsed):
    cols = ("cos", "spread", "offset", "top1_same", "load", "gap", "bias_range", "sel_offset", "sel_token_std",
            "center_resid")
    print(f"step {row['step']:4d} ce {row['ce']:.3f} rate {row['rate']:.1e} ({elapsed:.0f}s)")
    for li, r in enumerate(row["layers"]):
        print("   L%d " % li + " ".join(f"{c} {r[c]:.3f}" for c in cols))
    bcols = ("shared_in", "shared_attn", "shared_ffn_in", "shared_ffn", "shared_out", "attn_along", "ffn_along",
             "rms_in", "rms_attn", "rms_ffn", "top_dim_share", "peak_ratio")
    for bi, r in enumerate(row.get("blocks", [])):
        print("   B%d " % bi + " ".join(f"{c} {r[c]:.3f}" for c in bcols))
    sys.stdout.flush()


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--variant", default="baseline")
    p.add_argument("--override", action="append", help="ModelConfig field=value (JSON value)")
    p.add_argument("--bias-schedule", default="constant", choices=("constant", "module"))
    p.add_argument("--dataset", default="shakespeare")
    p.add_argument("--steps", type=int, default=120)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--warmup", type=int, default=40)
    p.add_argument("--schedule-steps", type=int, default=400,
                   help="cosine horizon (400: the GPU check's run; a shorter probe sees its first part)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--center-space", default="project", choices=("project", "input"),
                   help="what router_center_ema's running mean is taken of (router.CENTER_SPACE)")
    p.add_argument("--gzip", action="store_true", help="write <name>.json.gz (the per-step history is ~1 MB)")
    p.add_argument("--print-every", type=int, default=10)
    p.add_argument("--floor-batches", type=int, default=0,
                   help="after training, max/mean load on this many unseen batches with weights and bias frozen")
    p.add_argument("--block-stats", action="store_true",
                   help="also record, per block, which sub-layer (attention / FFN) writes the shared direction")
    p.add_argument("--name", default=None)
    p.add_argument("--out-dir", default=str(REPO / "experiments/results/routing_probe"))
    args = p.parse_args(argv)
    cfg, tc, history = run_probe(args)
    name = args.name or f"{args.variant}_{args.dataset}_s{args.seed}"
    out = Path(args.out_dir) / (f"{name}.json.gz" if args.gzip else f"{name}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    try:
        provenance = collect_provenance()
    except Exception as err:  # noqa: BLE001  (minutes of probe history must not be lost to a provenance bug)
        provenance = {"provenance_error": repr(err)}
    text = json.dumps({
        "name": name, "args": vars(args), "model_config": cfg.to_dict(), "train_config": tc.to_dict(),
        **provenance, "history": history, "summary": summarize(history),
    }, indent=1, default=str)
    if args.gzip:
        import gzip
        out.write_bytes(gzip.compress(text.encode(), mtime=0))
    else:
        out.write_text(text)
    print(json.dumps(summarize(history), indent=1))
    print("saved", out)


def summarize(history):
    """Per layer: load at step 0, max load over the run and the step it happened, mean load over
    windows, steps from which load stays <= 2."""
    floor = [h["floor"] for h in history if "floor" in h]
    history = [h for h in history if "layers" in h]
    n_layers = len(history[0]["layers"])
    out = {"floor": {k: v for k, v in floor[0].items() if k != "load_per_row"}} if floor else {}
    for li in range(n_layers):
        load = np.array([h["layers"][li]["load"] for h in history])
        after = np.where(load > 2.0)[0]
        out[f"L{li}"] = {
            "load_step0": round(float(load[0]), 3), "load_max": round(float(load.max()), 3),
            "load_argmax": int(load.argmax()),
            "load_last10": round(float(load[-10:].mean()), 3),
            "first_step_all_after_le_2": int(after[-1] + 1) if len(after) else 0,
            "cos_step0": round(history[0]["layers"][li]["cos"], 3),
            "cos_last": round(history[-1]["layers"][li]["cos"], 3),
            "gap_max": round(float(max(h["layers"][li]["gap"] for h in history)), 4),
            "drift_score_median": round(float(np.nanmedian([h["layers"][li]["drift_score"] for h in history])), 5),
            "drift_score_max": round(float(np.nanmax([h["layers"][li]["drift_score"] for h in history])), 5),
        }
    return out


if __name__ == "__main__":
    main()
