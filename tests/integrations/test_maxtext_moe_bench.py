"""benchmarks/maxtext_moe.py's CPU check: at EP=2 each contender runs in its own process and comes back as a row
(MaxText + turbo with turbo's EP body);
turbo_moe's layer runs on a (1, 2) mesh; a contender that does not import (MaxText is not installed in CI) or that
runs past its time limit is a row saying why, and the next contender still runs."""
from __future__ import annotations

import csv
from pathlib import Path

import pytest

from tests import benchmark_script


@pytest.fixture(scope="module")
def bench():
    return benchmark_script.load("maxtext_moe")


def rows_of(out: Path) -> dict[str, dict]:
    with open(out.with_suffix(".csv")) as fh:
        return {r["contender"]: r for r in csv.DictReader(fh)}


def test_isolated_contenders_at_ep2(bench, tmp_path):
    """MaxText + turbo at EP=2 runs turbo's EP body (MaxText's own sparse_matmul needs ragged-all-to-all, which
    XLA:CPU lacks: tests/integrations/test_maxtext_ep.py compares the two)."""
    out = tmp_path / "mx"
    bench.main(["--smoke", "--ep", "2", "--warmup", "0", "--reps", "1", "--contenders",
                "maxtext_sparse_turbo,maxtext_sparse_turbo_split,turbo_moe_layer", "--out", str(out)])
    rows = rows_of(out)
    ours = rows["turbo_moe_layer"]
    assert ours["status"] == "ok" and ours["ep"] == "2", ours
    assert float(ours["step_ms"]) > 0 and float(ours["step_mib"]) > 0
    try:
        import maxtext  # noqa: F401
    except ImportError:
        maxtext = None
    for contender in ("maxtext_sparse_turbo", "maxtext_sparse_turbo_split"):
        theirs = rows[contender]
        if maxtext is None:
            assert theirs["status"] == "unavailable" and "maxtext" in theirs["error"], theirs
        else:
            assert theirs["status"] == "ok", theirs
            assert theirs["turbo_body"] == "ep_exchange" and "turbo_ep:sparse_matmul=1" in theirs["turbo_stats"], \
                theirs


def test_a_contender_past_its_time_is_a_row(bench, tmp_path):
    out = tmp_path / "slow"
    bench.main(["--smoke", "--ep", "2", "--warmup", "0", "--reps", "1", "--contenders", "turbo_moe_layer",
                "--point-timeout-s", "0.5", "--out", str(out)])
    row = rows_of(out)["turbo_moe_layer"]
    assert row["status"] == "timeout" and "--point-timeout-s" in row["error"], row


def test_ep_beyond_the_devices_is_refused(bench, tmp_path):
    with pytest.raises(SystemExit):
        bench.main(["--smoke", "--ep", "999", "--out", str(tmp_path / "x")])
