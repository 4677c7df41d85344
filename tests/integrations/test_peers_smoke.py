"""benchmarks/peers.py's CPU check (--smoke): every contender becomes a row, turbo's rows are correct against the
float32 reference, a contender that cannot run here is a row with its reason, and the files are written."""
from __future__ import annotations

import csv
import json

import numpy as np
import pytest

from tests import benchmark_script


@pytest.fixture(scope="module")
def peers():
    return benchmark_script.load("peers")


def test_smoke_rows_for_every_contender(peers, tmp_path):
    out = tmp_path / "peers"
    peers.main(["--smoke", "--shapes", "smoke_odd_G3", "--routings", "balanced,skewed", "--modes", "fwd,fwd_bwd",
                "--warmup", "0", "--reps", "1", "--tune-shapes", "", "--out", str(out)])
    rows = list(csv.DictReader(open(out.with_suffix(".csv"))))
    saved = json.loads(out.with_suffix(".json").read_text())
    key = ("shape", "routing", "mode", "contender", "status")
    assert [tuple(r[k] for k in key) for r in rows] == [tuple(r[k] for k in key) for r in saved["rows"]]
    assert saved["provenance"]["git_commit"] and saved["provenance"]["device_kind"]
    contenders = {r["contender"] for r in rows}
    assert set(peers.MOE_CONTENDERS) | {"dense"} <= contenders
    turbo = [r for r in rows if r["contender"] == "turbo"]
    assert len(turbo) == 4 and all(r["status"] == "ok" for r in turbo)
    assert all(0 <= float(r["rel_err"]) <= 2e-2 for r in turbo)  # bf16 output rounding, not zero, not large
    for r in rows:
        if r["status"] == "unavailable":
            assert r["error"], r  # says why


def test_relative_error_catches_a_wrong_gradient(peers):
    """The check the rows carry is not vacuous: a weight gradient off by 10% of one group is flagged."""
    import jax.numpy as jnp

    sizes = np.array([3, 0, 5], np.int32)
    rng = np.random.default_rng(0)
    x, w, dy = (jnp.asarray(rng.standard_normal(s), jnp.float32) for s in ((8, 4), (3, 4, 5), (8, 5)))
    y = jnp.concatenate([x[:3] @ w[0], x[3:] @ w[2]])
    dx = jnp.concatenate([dy[:3] @ w[0].T, dy[3:] @ w[2].T])
    dw = jnp.stack([x[:3].T @ dy[:3], jnp.zeros((4, 5)), x[3:].T @ dy[3:]])
    assert peers.relative_error((y, dx, dw), x, w, dy, sizes) < 1e-5
    assert peers.relative_error((y, dx, dw.at[2].multiply(1.1)), x, w, dy, sizes) > 1e-2


def test_fp8_rows_are_held_to_the_fp8_bound(peers, tmp_path):
    """turbo_fp8 runs (emulated on the CPU) where K and N are multiples of 128, with an error of FP8's size: above
    bf16's, below --fp8-tol; at other widths it is a row saying why; it is not counted as a peer."""
    out = tmp_path / "peers_fp8"
    peers.main(["--smoke", "--shapes", "smoke_fp8_G3,smoke_odd_G3", "--routings", "skewed", "--modes", "fwd,fwd_bwd",
                "--warmup", "0", "--reps", "1", "--tune-shapes", "", "--out", str(out)])
    with open(out.with_suffix(".csv")) as fh:
        rows = [r for r in csv.DictReader(fh) if r["contender"] == "turbo_fp8"]
    fp8 = {(r["shape"], r["mode"]): r for r in rows}
    for mode in ("fwd", "fwd_bwd"):
        ok = fp8[("smoke_fp8_G3", mode)]
        assert ok["status"] == "ok", ok
        assert 5e-3 < float(ok["rel_err"]) <= 0.1, ok
        odd = fp8[("smoke_odd_G3", mode)]
        assert odd["status"] == "unavailable" and "128" in odd["error"], odd
    lines = peers.summary_lines([dict(r) | {"tflops": 1.0} for r in rows if r["status"] == "ok"])
    assert "turbo_fp8" not in lines[0]  # a column of its own, not among the peers
