"""The ``turbo-moe`` console script: ``train`` and ``launch`` (a training config, in its run folder), ``sweep``
(a notebook over a grid of parameters) and ``report`` (the figures from the results)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

# Each command's modules are imported where it runs: train/launch need the [train] extra, sweep/report the
# [notebooks] extra (a missing one is named when its command runs, and the other commands work), and the report's
# (matplotlib, seaborn, pyarrow: ~5 s) would make `turbo-moe --help` slow.
try:  # the sweep's spec and lock: [notebooks] and [train], already imported for the default kernel's name
    from turbo_moe.experiments.sweep.lock import SweepBusy
    from turbo_moe.experiments.sweep.spec import DEFAULT_KERNEL, load_spec
except ImportError:
    SweepBusy, DEFAULT_KERNEL, load_spec = None, None, None


def _add_sweep_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("sweep", help="run a notebook over a grid of parameters (resumable)")
    p.add_argument("spec", type=Path, help="sweep spec YAML, e.g. experiments/sweeps/cpu_default.yaml")
    p.add_argument("--dry-run", action="store_true", help="list the points (run/skip) and exit")
    p.add_argument("--force", action="store_true", help="re-run points that already finished")
    p.add_argument("--only", metavar="GLOB", help="run only points whose name matches this glob")
    p.add_argument("--kernel", help="Jupyter kernel name (default: the spec's, else 'turbo-moe')")
    p.add_argument("--experiments-dir", type=Path,
                   help="folder holding results/ and runs/ (default: the spec's experiments/ folder)")
    p.add_argument("--no-progress", action="store_true", help="no tqdm bar")
    p.add_argument("--budget-s", type=float, metavar="SECONDS",
                   help="start no new point after this many seconds (the rest stay pending for the next run)")
    p.add_argument("--wait", type=float, default=0.0, metavar="SECONDS",
                   help="if another sweep is writing the same results table, wait this long for it (default: "
                        "refuse at once)")


def _add_report_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("report", help="draw the report: the committed results and this machine's runs")
    p.add_argument("--experiments-dir", type=Path,
                   help="folder holding results/, store/ and runs/ (default: this clone's experiments/)")
    p.add_argument("--notebook", type=Path,
                   help="report notebook executed through papermill (default: this clone's notebooks/04_report.ipynb)")
    p.add_argument("--kernel", default=DEFAULT_KERNEL, help="Jupyter kernel name (default: turbo-moe)")
    p.add_argument("--no-notebook", action="store_true",
                   help="draw the figures in this process instead of executing the notebook")
    p.add_argument("--publish", action="store_true",
                   help="ingest results/ into the committed store/ and draw figures/ and docs/results.md from it "
                        "alone (default: ingest into runs/store/ and draw both stores into runs/report/, git-ignored)")


def _add_train_parsers(sub: argparse._SubParsersAction) -> None:
    sets = dict(action="append", default=[], metavar="KEY=VALUE",
                help="replace one config value after the file is read: a field (steps=20) or a dotted path "
                     "(model_overrides.moe_path=turbo); the value is read as YAML; repeatable")
    outputs = [
        ("--out", dict(type=Path, metavar="DIR", help="the run folder: record.json, history.csv, TensorBoard events, "
                       "checkpoint/ (default: a new runs/<config name>-<n>); resume=true continues the run in it")),
        ("--record", dict(type=Path, metavar="PATH", help="write the record (JSON) here instead of <run folder>/"
                          "record.json")),
        ("--overwrite", dict(action="store_true", help="replace the run already in --out (its record, curves, "
                             "events and checkpoint) instead of refusing")),
    ]
    p = sub.add_parser("train", help="run one training config (one process, or one of a jax.distributed job)")
    p.add_argument("config", type=Path, help="TrainConfig YAML, e.g. experiments/configs/tiny.yaml")
    p.add_argument("--set", dest="sets", **sets)
    for flag, kwargs in outputs:
        p.add_argument(flag, **kwargs)
    p = sub.add_parser("launch", help="run one training config as one process per GPU (or per CPU device group) "
                       "of this host")
    p.add_argument("config", type=Path, help="TrainConfig YAML, e.g. experiments/configs/reduced.yaml")
    p.add_argument("--set", dest="sets", **sets)
    for flag, kwargs in outputs:
        p.add_argument(flag, **kwargs)
    p.add_argument("--port", type=int, help="the coordinator's port on this host (default: a free one)")
    p.add_argument("--gpus", type=int, help="GPUs to use (the first N of CUDA_VISIBLE_DEVICES, else 0..N-1)")
    p.add_argument("--cpu-devices", type=int, metavar="K", help="no GPU: each process gets K CPU host devices")
    p.add_argument("--processes", type=int, help="processes to start (default: --gpus, one per GPU; with "
                   "--cpu-devices: 2)")
    p.add_argument("--log-dir", type=Path, help="folder for the other processes' output (default: <run folder>/logs)")


def cmd_train(args: argparse.Namespace) -> int:
    from turbo_moe.train.launch import train_from_file  # the [train] extra

    return train_from_file(args.config, args.sets, out=args.out, record=args.record, overwrite=args.overwrite)


def cmd_launch(args: argparse.Namespace) -> int:
    from turbo_moe.train.launch import launch_local  # the [train] extra

    processes = args.processes if args.processes is not None else args.gpus if args.gpus is not None else 2
    return launch_local(args.config, args.sets, processes=processes, gpus=args.gpus, cpu_devices=args.cpu_devices,
                        out=args.out, record=args.record, overwrite=args.overwrite, port=args.port,
                        log_dir=args.log_dir)


def cmd_sweep(args: argparse.Namespace) -> int:
    from turbo_moe.experiments.sweep.runner import (  # the [notebooks] extra; pandas' import (~1 s)
        SweepLayout, damaged_rows, default_experiments_dir, plan_sweep, run_sweep)

    spec = load_spec(args.spec)  # checks every point's values as the notebook would
    exp = args.experiments_dir or default_experiments_dir(spec)
    layout = SweepLayout(results_dir=exp / "results", runs_dir=exp / "runs", sweep=spec.name)
    if args.dry_run:
        planned = plan_sweep(spec, layout, force=args.force, only=args.only)
        print(f"sweep {spec.name}: notebook {spec.notebook}, kernel {args.kernel or spec.kernel}")
        trial = args.experiments_dir is None and exp.name == "trials"
        print(f"table {layout.table}" + (" (a spec outside experiments/sweeps/: a trial, kept out of the "
                                         "report; --experiments-dir chooses)" if trial else ""))
        for row in damaged_rows(layout):
            print(f"warning: {row}")
        print(f"base parameters: {spec.base}")
        print(f"{len(planned)} points ({sum(p.action == 'run' for p in planned)} to run; values checked):")
        for p in planned:
            why = f"  ({p.reason})" if p.action == "run" and p.reason not in ("new", "params changed") else ""
            print(f"  [{p.action:4s}] {p.point.name}{why}")
        return 0
    if args.budget_s is not None and not args.budget_s > 0:
        raise ValueError(f"--budget-s must be a positive number of seconds, got {args.budget_s}")
    if not args.wait >= 0:
        raise ValueError(f"--wait must be a number of seconds >= 0, got {args.wait}")
    rows = run_sweep(spec, layout=layout, force=args.force, only=args.only, kernel=args.kernel,
                     progress=not args.no_progress, budget_s=args.budget_s, wait_s=args.wait)
    return 0 if all(r["status"] != "error" for r in rows) else 1


def cmd_report(args: argparse.Namespace) -> int:
    from turbo_moe.experiments.report import report  # the [notebooks] extra; matplotlib, seaborn, pyarrow (~5 s)

    return report.report_command(args.experiments_dir, notebook=args.notebook, kernel=args.kernel,
                                 in_process=args.no_notebook, publish=args.publish)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="turbo-moe", description="Train a config (train; launch: one process per "
                                     "GPU), run notebook sweeps (papermill) and draw the report.")
    sub = parser.add_subparsers(dest="command", required=True)
    _add_sweep_parser(sub)
    _add_report_parser(sub)
    _add_train_parsers(sub)
    args = parser.parse_args(argv)
    expected: tuple[type[Exception], ...] = (ValueError, OSError)
    if args.command in ("sweep", "report") and SweepBusy is not None:
        expected += (SweepBusy,)
    try:
        return {"sweep": cmd_sweep, "report": cmd_report, "train": cmd_train, "launch": cmd_launch}[args.command](args)
    # A bad spec or argument, a busy table, a full disk or unwritable folder: one clear line, no traceback.
    except expected as exc:
        print(f"turbo-moe {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # Ctrl-C: one line, not the stack it interrupted
        print(f"turbo-moe {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
