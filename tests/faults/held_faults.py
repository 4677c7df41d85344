"""The eleven faults tests/FAULTS.md already held before the campaign existed (rows 1-9): locks, SIGKILL and
resume, full disks, typos, long names, damaged rows, int64 ids, umask, YAML, resume mismatch, checkpoint fallback."""

from __future__ import annotations

import os
import signal
from pathlib import Path


from turbo_moe.experiments.store import results
from turbo_moe.experiments.sweep.lock import SweepLock
from turbo_moe.experiments.sweep.spec import spec_from_dict

from harness import (Outcome, _checkpointer, _save, _Sweep, child, cli_run,
                     count_rows, refused_restore, spec_file, toy_notebook)


def held_lock(root: Path, o: Outcome) -> str:
    sweep = _Sweep(root)
    sweep.layout.results_dir.mkdir(parents=True)
    spec = spec_file(root, f"notebook: {sweep.spec.notebook}\nname: toy\ngrid: {{x: [1, 2]}}\n")
    with SweepLock(sweep.layout.table):
        rc, _, err = cli_run(["sweep", str(spec), "--experiments-dir", str(root), "--kernel", "python3"], o)
    assert rc == 2 and f"pid {os.getpid()}" in err and len(err.strip().splitlines()) == 1, err
    return "second sweep refused in one line naming the holder's pid"


def held_sigkill_and_resume(root: Path, o: Outcome) -> str:
    code = """
        import json, os, signal, sys
        from pathlib import Path
        sys.path.insert(0, %r)
        from harness import _Sweep
        sweep = _Sweep(Path(sys.argv[1]), n=3)
        def killer(p):
            if p["x"] == 2 and not (Path(sys.argv[1]) / "killed").exists():
                (Path(sys.argv[1]) / "killed").touch()
                os.kill(os.getpid(), signal.SIGKILL)
            return {"status": "ok", "summary": {"tgs": 1.0}}
        sweep.records = {2: killer}
        sweep.run()
    """ % str(Path(__file__).parent)
    first = child(code, str(root))
    assert first.returncode == -signal.SIGKILL, first.stderr[-500:]
    again = child(code, str(root))
    assert again.returncode == 0, again.stderr[-800:]
    sweep = _Sweep(root)
    count_rows(sweep, ["x-1", "x-2", "x-3"], o)
    assert list(sweep.table()["point"]) == ["x-1", "x-2", "x-3"]
    assert not list(sweep.layout.results_dir.rglob("*.partial"))
    return "SIGKILL in point 2: point 1's row kept, re-run does 2 and 3, no partial left"


def held_full_disk_table(root: Path, o: Outcome) -> str:
    sweep = _Sweep(root, n=2)
    sweep.run()
    before = sweep.layout.table.read_text()
    saved = results.write_atomic

    def disk_full(path, write):
        raise OSError(28, "No space left on device", str(path))

    results.write_atomic = disk_full
    try:
        sweep.spec = spec_from_dict({"name": "toy", "notebook": str(sweep.spec.notebook), "grid": {"x": [1, 2, 3]}})
        try:
            sweep.run()
            raise AssertionError("the sweep went on without its table")
        except OSError as exc:
            message = str(exc)
    finally:
        results.write_atomic = saved
    assert "toy.csv" in message and "x-3" in message and "runs again" in message, message
    assert sweep.layout.table.read_text() == before
    sweep.run()
    count_rows(sweep, ["x-1", "x-2", "x-3"], o)
    return "table write fails: one error naming the table and the point, earlier rows intact, re-run completes"


def held_typo(root: Path, o: Outcome) -> str:
    spec = spec_file(root, f"notebook: {toy_notebook(root)}\nbase: {{mdoe: ok}}\ngrid: {{x: [1]}}\n")
    rc, _, err = cli_run(["sweep", str(spec), "--dry-run"], o)
    assert rc == 2 and "did you mean 'mode'" in err, err
    return "rc 2, one line: unknown parameter 'mdoe', did you mean 'mode'"


def held_long_names(root: Path, o: Outcome) -> str:
    sweep = _Sweep(root, n=1)
    long = {"x": 1, "mode": "m" * 250}
    sweep.spec = spec_from_dict({"name": "toy", "notebook": str(sweep.spec.notebook),
                                 "points": [{**long, "x": 1}, {**long, "x": 2}]})
    sweep.run()
    names = [p.name for p in sweep.spec.expand()]
    assert all("__h-" in n for n in names) and sweep.run() == []
    count_rows(sweep, names, o)
    return "names over 200 characters hashed; both points run once and resume"


def held_damaged_rows(root: Path, o: Outcome) -> str:
    sweep = _Sweep(root, n=3)
    sweep.run()
    text = sweep.layout.table.read_text()
    sweep.layout.table.write_text(text[:-15])  # cut inside the last row
    rows = sweep.run()
    assert [r["point"] for r in rows] == ["x-3"] and any("damaged row" in m for m in sweep.log)
    count_rows(sweep, ["x-1", "x-2", "x-3"], o)
    return "cut row reported by file and line, its point runs again, table sound"


def held_int64_ids(root: Path, o: Outcome) -> str:
    import jax.numpy as jnp
    import numpy as np

    from turbo_moe.ops import permute

    ids = np.array([[0, 2**32 + 1], [1, 2]], np.int64)
    x = jnp.ones((2, 4), jnp.float32)
    counts = np.asarray(permute(x, ids, 4)[1])
    assert int(counts.sum()) == 3 and int(counts[1]) == 1, counts  # 2**32+1 reached no expert
    return "expert id 2**32+1 drops its copy (not wrapped to expert 1)"


def held_umask(root: Path, o: Outcome) -> str:
    old = os.umask(0o027)
    try:
        results.append_row(root / "t.csv", {"sweep": "s", "point": "a", "status": "ok"})
    finally:
        os.umask(old)
    assert (root / "t.csv").stat().st_mode & 0o777 == 0o640
    return "table mode 0640 under umask 027"


def held_yaml(root: Path, o: Outcome) -> str:
    bomb = "a: &a [1,1,1,1,1,1,1,1,1,1]\n" + "".join(
        f"{c}: &{c} [{','.join(['*' + p] * 10)}]\n" for p, c in zip("abcde", "bcdef")) + "g: [" + ",".join(["*f"] * 10) + "]\n"
    for text, expect in ((bomb, "more than 100000 values"),
                         ("notebook: !!python/object/apply:os.system ['touch PWNED']\n", "constructor"),
                         ("notebook: [unclosed\n", "not valid YAML")):
        rc, _, err = cli_run(["sweep", str(spec_file(root, text)), "--dry-run"], o)
        assert rc == 2 and expect in err and len(err.strip().splitlines()) == 1, err
    assert not Path("PWNED").exists()
    return "alias bomb, python tag, bad syntax: one line each, nothing executed"


def held_resume_mismatch(root: Path, o: Outcome) -> str:

    ckpt = _checkpointer(root / "ckpt")
    _save(ckpt, 1)
    refused_restore(ckpt, {"seed": 3, "steps": 10}, "seed=0 in the checkpoint, 3 now", "resumed with another seed")
    return "resume with another seed refused naming seed"


def held_checkpoint_fallback(root: Path, o: Outcome) -> str:
    import jax.numpy as jnp

    ckpt = _checkpointer(root / "ckpt")
    _save(ckpt, 1)
    _save(ckpt, 2)
    for f in (root / "ckpt" / "2" / "state").rglob("*"):
        if f.is_file():
            f.write_bytes(b"\x00garbage")
    try:
        _, record = ckpt.restore({"w": jnp.zeros((4,))})
    finally:
        ckpt.finish()
    assert record["step"] == 1 and (root / "ckpt" / "2.damaged-0").is_dir()
    return "damaged step 2 moved aside, restored step 1"
