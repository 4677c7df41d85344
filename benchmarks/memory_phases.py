"""Device memory at each phase of a run's start (not a test): which program sets a training run's peak.

    python benchmarks/memory_phases.py --out FILE.json '<TrainConfig JSON>'

One process per config (the device's peak counter never goes down): bytes in use and the peak after
the init program, after the train step's compile, and after the first and the third step, with the init and
train programs' compiled memory. Why: `master_weights="split"` shrank the train step's compiled memory by
3.98 GB but raised the run's peak by 1.05 GB on an H200 (experiments/NOTES.md, issue 14, calls 106-107).
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import jax

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from benchmarks._provenance import provenance  # noqa: E402


def device_bytes() -> dict:
    stats = jax.local_devices()[0].memory_stats() or {}
    return {k: stats.get(k) for k in ("bytes_in_use", "peak_bytes_in_use")}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("config", help="a TrainConfig dict as JSON")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    from turbo_moe.data import BatchIterator, load_dataset
    from turbo_moe.train import TrainConfig
    from turbo_moe.train import metrics as M
    from turbo_moe.train.step import device_batch, make_mesh, program_for

    tc = TrainConfig.from_dict({"progress": False, **json.loads(args.config)})
    cfg = tc.model_config()
    seq = tc.resolved_seq_len
    mesh = make_mesh(expert_parallel=tc.expert_parallel)
    program = program_for(tc, cfg, mesh)
    record = {"config": json.loads(args.config), "provenance": provenance(), "phases": {}}
    phases = record["phases"]
    phases["start"] = device_bytes()
    key = jax.random.key(tc.seed)
    init_compiled = program.init.compile(key)
    record["init_compiled_memory"] = M.compiled_memory(init_compiled)
    record["init_choice"] = program.init.last_choice
    state = jax.block_until_ready(program.init(key))
    phases["after_init"] = device_bytes()
    dataset = load_dataset(tc.dataset, seq_len=seq, vocab_size=cfg.vocab_size, data_dir=tc.data_dir)
    global_batch = tc.per_device_batch * jax.device_count()
    batches = BatchIterator(dataset.train, global_batch, seed=tc.seed)
    batch = device_batch(batches.batch_at(0), mesh)
    compiled = program.train.lower(state, batch).compile()
    record["train_compiled_memory"] = M.compiled_memory(compiled)
    phases["after_train_compile"] = device_bytes()
    for step in range(3):
        state, metrics = compiled(state, device_batch(batches.batch_at(step), mesh))
        jax.block_until_ready((state, metrics))
        if step in (0, 2):
            phases[f"after_step_{step + 1}"] = device_bytes()
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(record, default=str, indent=1))
    print(json.dumps({"master_weights": tc.resolved().master_weights, "phases": phases,
                      "init_compiled_total": record["init_compiled_memory"].get("total_bytes"),
                      "train_compiled_total": record["train_compiled_memory"].get("total_bytes")}))


if __name__ == "__main__":
    main()
