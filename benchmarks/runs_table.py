"""Tidy CSV (+ optional figure) from `train_once.py` run records: one row per run, with its switches,
throughput, the router's regime over the timed steps, measured vs predicted memory, and provenance.

    python benchmarks/runs_table.py experiments/results/step_cuts_h200 --csv experiments/results/step_cuts_h200.csv
    python benchmarks/runs_table.py experiments/results/full_deepseek_h200 \\
        --csv experiments/results/full_deepseek_h200.csv --figure experiments/figures/full_deepseek_h200.png

Switches are the run's own: the record's provenance holds its TrainConfig and ModelConfig as resolved when it ran
(`config`, `model_config`); a record without them gives what its config set explicitly. A switch found in neither
(a record older than the switch) is left empty and named in `switches_not_recorded`: today's default may not be what
that run did.

Measured memory is XLA's buffer assignment of the compiled train step (`compiled_total_bytes`): the
process-wide peak counter (`peak_memory_bytes`) never resets, so after the first run of a process it
reports the largest run so far. Predicted memory is `accounting.memory_prediction` of the run's config.
"""
from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _records import write_csv  # noqa: E402

GIB = 2**30
SWITCHES = ("remat_policy", "moments_dtype", "adam_mu_dtype", "adam_nu_dtype", "adam_nu_rounding",
            "cast_params_before_scan", "cast_params_in_update", "master_weights", "optimizer_state_memory",
            "scan_outputs_uninitialized", "loss_chunk_tokens", "logits_dtype", "param_dtype",
            "learning_rate", "capacity_factor", "n_experts", "n_layers", "mtp_depth", "router_recipe", "router_center_causal",
            "router_seq_load_penalty", "router_topk_impl", "attention_impl", "expert_backward", "swiglu_impl",
            "embedding_grad")


_SHORT = {"remat_policy": "remat", "moments_dtype": "moments", "adam_mu_dtype": "mu", "adam_nu_dtype": "nu",
          "adam_nu_rounding": "nu_round", "cast_params_before_scan": "cast", "cast_params_in_update": "cast_update", "master_weights": "master",
          "optimizer_state_memory": "opt_state", "scan_outputs_uninitialized": "uninit", "loss_chunk_tokens": "chunk", "logits_dtype": "logits",
          "param_dtype": "params", "router_recipe": "router", "router_center_causal": "center", "router_seq_load_penalty": "seqload",
          "router_topk_impl": "topk", "attention_impl": "attn", "expert_backward": "expert_bwd", "swiglu_impl": "swiglu",
          "embedding_grad": "emb_grad"}


# A valued switch's setting that means "off" (its default), left out of the figure's labels like False.
_OFF = {"master_weights": "float32", "optimizer_state_memory": "device"}


def _switch_label(key: str, value) -> str:
    """' cast' for a switch that is on, '' for one that is off, ' remat=full' for a valued one."""
    if value in (None, False, 0, "", "False", "0") or (isinstance(value, float) and math.isnan(value)) \
            or (key in _OFF and value == _OFF[key]):
        return ""
    return f" {_SHORT.get(key, key)}" + ("" if value in (True, "True") else f"={value}")


def _regime(history: list[dict], skip: int) -> tuple[float, str]:
    """Median max/mean expert load over the timed steps, and a word for it (top-k of E: E/k = all on k)."""
    loads = [h["load_max_over_mean"] for h in history[skip:] if math.isfinite(h.get("load_max_over_mean", math.nan))]
    if not loads:
        return math.nan, "unknown"
    load = statistics.median(loads)
    return load, "balanced (<= 2)" if load <= 2.0 else ("skewed (2-5)" if load <= 5.0 else "collapsed (> 5)")


def _resolved(config: dict):
    """The run's TrainConfig and ModelConfig with every default filled in."""
    from turbo_moe.train import TrainConfig

    tc = TrainConfig.from_record({"progress": False, **config})
    return tc, tc.model_config()


_MOMENTS = ("adam_mu_dtype", "adam_nu_dtype")  # one field, moments_dtype, since


def _moment(values: dict, name: str):
    """A moment's dtype as `values` (a config) name it: its own field in an older config, else moments_dtype."""
    return values.get(name) if any(k in values for k in _MOMENTS) else values.get("moments_dtype")


def _moment_dtype(tc, config: dict, prov: dict, name: str):
    """The dtype a run stored an AdamW moment in (`name`: one of _MOMENTS): its recorded (resolved) value, else its
    config's, where "auto" (a field added later) means what runs before it did: the parameter dtype (None)."""
    recorded = _moment(prov.get("config") or {}, name)
    if recorded not in (None, "auto"):
        return recorded
    value = _moment(config, name) if any(k in config for k in _MOMENTS) else tc.moments_dtype
    return None if value == "auto" else value


def _predicted_gib(tc, cfg, config: dict, prov: dict | None = None) -> float:
    from turbo_moe.experiments.accounting import memory_prediction

    prov = prov or {}
    pred = memory_prediction(cfg, tc.per_device_batch, tc.seq_len,
                             adam_mu_dtype=_moment_dtype(tc, config, prov, "adam_mu_dtype"),
                             adam_nu_dtype=_moment_dtype(tc, config, prov, "adam_nu_dtype"),
                             optimizer_state_memory=tc.optimizer_state_memory)
    return sum(pred.values()) / GIB


def _as_run(config: dict, prov: dict) -> tuple[dict, list[str]]:
    """The switches as the run resolved them (its provenance's ModelConfig, then TrainConfig; else what its config
    set explicitly), and the switches the record does not hold."""
    model, train = prov.get("model_config") or {}, prov.get("config") or {}
    explicit = {**config, **(config.get("model_overrides") or {})}
    found = {}
    for k in SWITCHES:
        for source in (model, train, explicit):
            if k in source or (k in _MOMENTS and "moments_dtype" in source):
                found[k] = _moment(source, k) if k in _MOMENTS else source[k]
                break
    return found, [k for k in SWITCHES if k not in found]


def row(record: dict, source: Path) -> dict:
    config, summary, prov = record["config"], record.get("summary") or {}, record.get("provenance") or {}
    tc, cfg = _resolved(config)
    merged, not_recorded = _as_run(config, prov)
    merged = {k: merged.get(k) for k in SWITCHES}
    merged["moe_path"] = (prov.get("model_config") or {}).get("moe_path", cfg.moe_path)
    skip = config.get("skip_steps_for_tgs")  # the steps the run left out of its TGS (a field until they were fixed)
    if skip is None:
        done, timed = summary.get("steps_done"), summary.get("tgs_steps")
        skip = done - timed if isinstance(done, int) and isinstance(timed, int) else 3  # the field's default
    load, regime = _regime(record.get("history") or [], skip)
    measured = summary.get("compiled_total_bytes")
    predicted = _predicted_gib(tc, cfg, config, prov)
    return {
        "run": f"{source.parent.name}/{source.stem}", "moe_path": merged.get("moe_path"), "model": config.get("model"),
        **{k: merged.get(k) for k in SWITCHES}, "switches_not_recorded": " ".join(not_recorded),
        "per_device_batch": tc.per_device_batch, "seq_len": tc.seq_len,
        "status": record.get("status"), "error": (record.get("error") or "")[:200],
        "tgs": summary.get("tgs"), "mfu": summary.get("mfu"), "step_ms": 1e3 * summary["step_time_s"]
        if summary.get("step_time_s") is not None else None, "tgs_steps": summary.get("tgs_steps"),
        "load_max_over_mean_timed": load, "routing_regime": regime,
        "dropped_fraction_mean": summary.get("dropped_fraction_mean"), "final_loss": summary.get("final_loss"),
        "measured_gib": measured / GIB if measured else None, "predicted_gib": predicted,
        "predicted_over_measured": predicted / (measured / GIB) if measured else None,
        "compile_time_s": summary.get("compile_time_s"), "init_lowering": summary.get("init_lowering"),
        "params_total": summary.get("params_total"), "flops_per_token": summary.get("flops_per_token"),
        "device": prov.get("device_kind"), "jax": prov.get("jax_version"), "commit": prov.get("git_commit"),
        "date": prov.get("date"), "config_json": json.dumps(config, sort_keys=True),
    }


def figure(rows: list[dict], path: Path, title: str = "") -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    # the switches that differ between the rows name each bar (those the label already shows aside)
    varying = [k for k in SWITCHES if k not in ("learning_rate", "capacity_factor")
               and len({str(r.get(k)) for r in rows}) > 1]
    labels = [f"{r['moe_path']}" + (f" cf {r['capacity_factor']}" if r["moe_path"] == "dense_cf" else "")
              + f" b{r['per_device_batch']}" + (f" lr {r['learning_rate']:g}" if r.get("learning_rate") else "")
              + "".join(_switch_label(k, r.get(k)) for k in varying)
              + ("" if r["status"] == "ok" else f" ({r['status']})") for r in rows]
    fig, axes = plt.subplots(1, 3, figsize=(14, 4.2 + 0.045 * max(map(len, labels))))
    x = range(len(rows))
    axes[0].bar(x, [r["tgs"] or 0 for r in rows], color="tab:blue")
    axes[0].set_ylabel("tokens / GPU / s")
    axes[1].bar(x, [100 * (r["mfu"] or 0) for r in rows], color="tab:green")
    axes[1].set_ylabel("MFU %")
    width = 0.4
    axes[2].bar([i - width / 2 for i in x], [r["measured_gib"] or 0 for r in rows], width, label="measured (XLA)")
    axes[2].bar([i + width / 2 for i in x], [r["predicted_gib"] or 0 for r in rows], width, label="predicted")
    axes[2].set_ylabel("GiB per device")
    axes[2].legend(fontsize=8)
    for ax in axes:
        ax.set_xticks(list(x), labels, fontsize=7, rotation=55, ha="right")
    devices = ", ".join(sorted({f"{r['device']}, jax {r['jax']}" for r in rows}))
    axes[0].set_title(f"{devices}; commits {', '.join(sorted({str(r['commit']) for r in rows}))}", fontsize=7, loc="left")
    regimes = "; ".join(sorted({f"{r['routing_regime']}" for r in rows})) + " routing over the timed steps"
    failed = [f"{r['moe_path']}: {r['status']}" for r in rows if r["status"] != "ok"]
    fig.suptitle("\n".join(filter(None, [title, regimes + ("; " + ", ".join(failed) if failed else "")])), fontsize=9)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    print(f"saved {path}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("dirs", nargs="+", help="folders of train_once records (*.json with config/summary)")
    ap.add_argument("--csv", required=True)
    ap.add_argument("--figure", default=None)
    ap.add_argument("--title", default="", help="first line of the figure's title (what was run)")
    args = ap.parse_args()
    rows = []
    for folder in args.dirs:
        for path in sorted(Path(folder).glob("*.json")):
            record = json.loads(path.read_text())
            if "config" in record:
                rows.append(row(record, path))
    if not rows:
        raise SystemExit(f"no train_once records (*.json with a 'config') in {args.dirs}")
    write_csv(rows, Path(args.csv))
    for r in rows:
        print({k: (round(v, 3) if isinstance(v, float) else v) for k, v in r.items()
               if k in ("run", "moe_path", "status", "tgs", "mfu", "step_ms", "routing_regime",
                        "measured_gib", "predicted_gib")})
    if args.figure:
        ok = [r for r in rows if r["status"] == "ok"]
        figure(ok + [r for r in rows if r["status"] != "ok"] if ok else rows, Path(args.figure), args.title)


if __name__ == "__main__":
    main()
