"""Small pieces the benchmark scripts share: run lists on the command line, tables written row by row."""
from __future__ import annotations

import csv
import json
from pathlib import Path


def parse_paths(text: str) -> list[tuple[str, float]]:
    """'turbo,dense_cf:1.25' -> [('turbo', 0.0), ('dense_cf', 1.25)]."""
    out = []
    for item in text.split(","):
        name, _, cf = item.strip().partition(":")
        out.append((name, float(cf) if cf else 0.0))
    return out


def write_csv(rows: list[dict], table: Path) -> None:
    """Rewrite `table` with every row so far (called after each case: nothing finished is lost)."""
    fields = list(dict.fromkeys(k for r in rows for k in r))
    with open(table, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=fields)
        writer.writeheader()
        writer.writerows(rows)


def write_table_and_record(rows: list[dict], table: Path, params: str) -> None:
    """`table` (CSV) and `table`.json rewritten with every row so far, each row led by the provenance columns (device,
    jax version, commit, date), the JSON also holding the exact parameters and the GEMM library's build."""
    from turbo_moe.provenance import TABLE_COLUMNS
    from turbo_moe.provenance import collect as collect_provenance

    prov = collect_provenance()
    columns = {k: prov[k] for k in TABLE_COLUMNS}
    rows = [{**columns, **row} for row in rows]
    write_csv(rows, table)
    record = {"provenance": {**columns, "grouped_gemm": prov["grouped_gemm"], "params": params}, "rows": rows}
    table.with_suffix(".json").write_text(json.dumps(record, indent=1, default=str))


def median_ms(fn, *args, reps: int) -> float:
    """Median wall time in ms of `reps` calls of `fn(*args)`, each waited for (jax arrays; compile it before)."""
    import statistics
    import time

    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn(*args).block_until_ready()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3
