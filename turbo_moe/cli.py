"""The ``turbo-moe`` console script: ``turbo-moe sweep SPEC.yaml`` and ``turbo-moe report``."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from turbo_moe.experiments.spec import DEFAULT_KERNEL


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
    p = sub.add_parser("report", help="draw the report figures from experiments/results/")
    p.add_argument("--experiments-dir", type=Path, default=Path("experiments"),
                   help="folder holding results/ and figures/ (default: ./experiments)")
    p.add_argument("--notebook", type=Path, default=Path("notebooks/04_report.ipynb"),
                   help="report notebook executed through papermill")
    p.add_argument("--kernel", default=DEFAULT_KERNEL, help="Jupyter kernel name (default: turbo-moe)")
    p.add_argument("--no-notebook", action="store_true",
                   help="draw the figures in this process instead of executing the notebook")


def cmd_sweep(args: argparse.Namespace) -> int:
    from turbo_moe.experiments.runner import (
        SweepLayout, damaged_rows, default_experiments_dir, plan_sweep, run_sweep)
    from turbo_moe.experiments.spec import load_spec

    spec = load_spec(args.spec)
    exp = args.experiments_dir or default_experiments_dir(spec)
    layout = SweepLayout(results_dir=exp / "results", runs_dir=exp / "runs", sweep=spec.name)
    if args.dry_run:
        planned = plan_sweep(spec, layout, force=args.force, only=args.only)
        print(f"sweep {spec.name}: notebook {spec.notebook}, kernel {args.kernel or spec.kernel}")
        print(f"table {layout.table}")
        for row in damaged_rows(layout):
            print(f"warning: {row}")
        print(f"base parameters: {spec.base}")
        print(f"{len(planned)} points ({sum(p.action == 'run' for p in planned)} to run):")
        for p in planned:
            print(f"  [{p.action:4s}] {p.point.name}")
        return 0
    if args.budget_s is not None and not args.budget_s > 0:
        raise ValueError(f"--budget-s must be a positive number of seconds, got {args.budget_s}")
    if not args.wait >= 0:
        raise ValueError(f"--wait must be a number of seconds >= 0, got {args.wait}")
    rows = run_sweep(spec, layout=layout, force=args.force, only=args.only, kernel=args.kernel,
                     progress=not args.no_progress, budget_s=args.budget_s, wait_s=args.wait)
    return 0 if all(r["status"] != "error" for r in rows) else 1


def cmd_report(args: argparse.Namespace) -> int:
    from turbo_moe.experiments import report

    results_dir, figures_dir = args.experiments_dir / "results", args.experiments_dir / "figures"
    if args.no_notebook:
        built = report.build_report(results_dir, figures_dir)
    else:
        out = args.experiments_dir / "runs" / "report" / "04_report.ipynb"
        built = report.run_report_notebook(args.notebook, out, results_dir, figures_dir, kernel=args.kernel)
    for line in built.lines():
        print(line)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="turbo-moe", description="Run notebook sweeps (papermill) and draw the report.")
    sub = parser.add_subparsers(dest="command", required=True)
    _add_sweep_parser(sub)
    _add_report_parser(sub)
    args = parser.parse_args(argv)
    from turbo_moe.experiments.lock import SweepBusy

    try:
        return {"sweep": cmd_sweep, "report": cmd_report}[args.command](args)
    # A bad spec or argument, a busy table, a full disk or unwritable folder: one clear line, no traceback.
    except (ValueError, SweepBusy, OSError) as exc:
        print(f"turbo-moe {args.command}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
