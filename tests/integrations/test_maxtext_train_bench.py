"""benchmarks/maxtext_train.py on the CPU: bad arguments stop it naming the option; each run is a row, also where it
cannot run (MaxText not installed, as in CI): then the row says why. With MaxText installed (Python 3.12), the smoke
shape trains on both GEMM kernels and their losses agree."""
from __future__ import annotations

import csv

import pytest

from tests import benchmark_script


@pytest.fixture(scope="module")
def bench():
    return benchmark_script.load("maxtext_train")


@pytest.mark.parametrize("args, option", [(["--gemms", "cublas"], "--gemms"), (["--steps", "3", "--skip", "5"], "--steps"),
                                          (["--set", "steps"], "--set")])
def test_bad_arguments_name_the_option(bench, tmp_path, capsys, args, option):
    with pytest.raises(SystemExit):
        bench.main(["--out", str(tmp_path), "--shape", "smoke", *args])
    assert option in capsys.readouterr().err


def test_every_run_is_a_row(bench, tmp_path):
    bench.main(["--out", str(tmp_path), "--shape", "smoke", "--steps", "3", "--skip", "1", "--timeout-s", "300"])
    with open(tmp_path / "maxtext_train.csv") as fh:
        rows = {r["gemms"]: r for r in csv.DictReader(fh)}
    assert set(rows) == {"maxtext", "turbo"}
    try:
        import maxtext  # noqa: F401
    except ImportError:
        for r in rows.values():
            assert r["status"] == "failed" and "maxtext" in r["error"], r
        return
    assert all(r["status"] == "ok" for r in rows.values()), rows
    assert int(rows["turbo"]["turbo_calls"]) > 0 and int(rows["maxtext"]["turbo_calls"] or 0) == 0
    assert float(rows["turbo"]["final_loss"]) == pytest.approx(float(rows["maxtext"]["final_loss"]), rel=1e-3)


def test_expert_parallel_training_runs_turbos_ep_body(bench, tmp_path):
    """MaxText's own training loop at ici_expert_parallelism=2: with turbo on, its MoE layers run turbo's EP body
    (dispatch -> experts -> combine) and train to MaxText's own loss (its run without EP: XLA:CPU has no
    ragged-all-to-all for MaxText's EP body)."""
    pytest.importorskip("maxtext", reason="maxtext is not installed")
    bench.main(["--out", str(tmp_path / "ep"), "--shape", "smoke", "--steps", "3", "--skip", "1", "--gemms", "turbo",
                "--set", "ici_expert_parallelism=2", "--timeout-s", "300"])
    bench.main(["--out", str(tmp_path / "own"), "--shape", "smoke", "--steps", "3", "--skip", "1", "--gemms",
                "maxtext", "--timeout-s", "300"])
    rows = {}
    for name in ("ep", "own"):
        with open(tmp_path / name / "maxtext_train.csv") as fh:
            (rows[name],) = list(csv.DictReader(fh))
    assert rows["ep"]["status"] == "ok" and rows["own"]["status"] == "ok", rows
    assert rows["ep"]["turbo_body"] == "ep_exchange", rows["ep"]["turbo_stats"]
    assert float(rows["ep"]["final_loss"]) == pytest.approx(float(rows["own"]["final_loss"]), rel=1e-3)
