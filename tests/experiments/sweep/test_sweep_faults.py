"""Faults a careless user or a crashing tool inflicts on a sweep: a second sweep of the same table,
damaged CSVs, over-long names, misspelled parameters, bad YAML, umask, a full disk's error message.
(tests/FAULTS.md lists them with their results.)"""

import json
import os
import subprocess
import sys
import textwrap
import time
import warnings

import pytest

from turbo_moe import cli
from turbo_moe.experiments.store import results
from turbo_moe.experiments.sweep import runner
from turbo_moe.experiments.sweep.lock import SweepBusy, SweepLock, lock_path
from turbo_moe.experiments.sweep.runner import SweepLayout, classify_error, plan_sweep, run_sweep
from turbo_moe.experiments.sweep.spec import MAX_NAME_CHARS, load_spec, spec_from_dict

CHILD = textwrap.dedent("""
    import json, sys, time
    from pathlib import Path
    from turbo_moe.experiments.sweep import runner
    from turbo_moe.experiments.sweep.lock import SweepBusy
    from turbo_moe.experiments.sweep.spec import spec_from_dict

    notebook, root, wait_s, tag = sys.argv[1:5]

    def fake_execute(spec, params, notebook_out, kernel):  # the first sweep's points wait for a go
        deadline = time.monotonic() + 60
        while tag == "first" and not (Path(root) / "go").exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        json.dump({"status": "ok", "summary": {"tgs": float(params["x"])}, "by": tag},
                  open(params["result_json"], "w"))
        return "ok", None

    runner.execute_notebook, runner.check_kernel = fake_execute, lambda name: None
    spec = spec_from_dict({"name": "toy", "notebook": notebook, "grid": {"x": [1, 2, 3, 4]}})
    layout = runner.SweepLayout(results_dir=Path(root) / "results", runs_dir=Path(root) / "runs", sweep="toy")
    try:
        rows = runner.run_sweep(spec, layout=layout, progress=False, wait_s=float(wait_s), log=lambda m: None)
    except SweepBusy as exc:
        print(exc)
        sys.exit(3)
    print(json.dumps([r["point"] for r in rows]))
""")


def _start(tmp_path, toy_notebook, wait_s, tag):
    script = tmp_path / "child.py"
    script.write_text(CHILD)
    return subprocess.Popen([sys.executable, str(script), str(toy_notebook), str(tmp_path), str(wait_s), tag],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def test_second_sweep_of_the_same_table_refuses_or_waits_and_nothing_is_lost(tmp_path, toy_notebook):
    """Two processes sweep the same spec at once: the second refuses naming the first (or, with a
    wait, runs after it and finds every point finished); every point has one ok row and its record."""
    first = _start(tmp_path, toy_notebook, 0, "first")
    lock = lock_path(tmp_path / "results" / "toy.csv")
    deadline = time.monotonic() + 60
    while not (lock.exists() and lock.read_text()) and first.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    refused = _start(tmp_path, toy_notebook, 0, "second")
    waiting = _start(tmp_path, toy_notebook, 60, "third")
    out_refused, _ = refused.communicate(timeout=120)  # while the first is still in its first point
    time.sleep(0.5)
    (tmp_path / "go").touch()
    out_first, err_first = first.communicate(timeout=120)
    out_waiting, err_waiting = waiting.communicate(timeout=120)
    assert first.returncode == 0, err_first
    assert json.loads(out_first) == ["x-1", "x-2", "x-3", "x-4"]
    assert refused.returncode == 3 and f"pid {first.pid}" in out_refused and "--wait" in out_refused
    assert waiting.returncode == 0 and json.loads(out_waiting) == [], err_waiting  # all finished by then
    table = results.read_table(tmp_path / "results" / "toy.csv")
    assert list(table["point"]) == ["x-1", "x-2", "x-3", "x-4"] and set(table["status"]) == {"ok"}
    for x in (1, 2, 3, 4):
        assert json.loads((tmp_path / "results" / "toy" / f"x-{x}.json").read_text())["by"] == "first"
    assert not list((tmp_path / "results").rglob("*.partial"))


def test_lock_is_released_and_names_its_holder(tmp_path):
    table = tmp_path / "t.csv"
    with SweepLock(table):
        assert json.loads(lock_path(table).read_text())["pid"] == os.getpid()
        with pytest.raises(SweepBusy, match=f"pid {os.getpid()}"):
            with SweepLock(table):  # a second open file of the same lock: refused like another process
                pass
        start = time.monotonic()
        with pytest.raises(SweepBusy, match=r"waited 0 s|waited"):
            with SweepLock(table, wait_s=0.3, poll_s=0.05):
                pass
        assert time.monotonic() - start >= 0.3
    with SweepLock(table):  # released on exit
        pass
    with pytest.raises(ValueError, match="wait_s"):
        SweepLock(table, wait_s=-1)


def test_partial_record_name_is_per_process(toy_notebook, tmp_path, monkeypatch):
    layout = SweepLayout(results_dir=tmp_path / "results", runs_dir=tmp_path / "runs", sweep="toy")
    spec = spec_from_dict({"name": "toy", "notebook": str(toy_notebook), "points": [{"x": 1}]})
    stale = layout.record(spec.expand()[0]).with_name("x-1.json.99999999.partial")
    stale.parent.mkdir(parents=True)
    stale.write_text(json.dumps({"status": "ok", "summary": {"tgs": 123.0}}))  # a dead sweep's leftover
    seen = []

    def fake_execute(spec_, params, notebook_out, kernel):
        seen.append(params["result_json"])
        return "ok", None  # writes no record: the stale one must not count

    monkeypatch.setattr(runner, "execute_notebook", fake_execute)
    monkeypatch.setattr(runner, "check_kernel", lambda name: None)
    (row,) = run_sweep(spec, layout=layout, progress=False)
    assert seen[0].endswith(f"x-1.json.{os.getpid()}.partial")
    assert row["status"] == "error" and "wrote no record" in row["error"] and not stale.exists()


def _ok_execute(spec_, params, notebook_out, kernel):
    json.dump({"status": "ok", "summary": {"tgs": float(params["x"])}}, open(params["result_json"], "w"))
    return "ok", None


@pytest.fixture
def fake_sweep(toy_notebook, tmp_path, monkeypatch):
    monkeypatch.setattr(runner, "execute_notebook", _ok_execute)
    monkeypatch.setattr(runner, "check_kernel", lambda name: None)
    layout = SweepLayout(results_dir=tmp_path / "results", runs_dir=tmp_path / "runs", sweep="toy")
    spec = spec_from_dict({"name": "toy", "notebook": str(toy_notebook), "grid": {"x": [1, 2, 3]},
                           "base": {"mode": "a long error text\nwith a second line"}})
    return spec, layout


def _cut_inside_row(text, row, offset):
    """The text cut ``offset`` characters into data row ``row`` (1-based; rows may span lines)."""
    starts = [i + 1 for i, ch in enumerate(text) if ch == "\n" and text[i + 1:i + 5] == "toy,"]
    return text[:starts[row - 1] + offset]


@pytest.mark.parametrize("cut", ["mid_field", "inside_quotes", "last_field"])
def test_truncated_table_reports_file_and_line_and_reruns_the_point(fake_sweep, cut, capsys):
    spec, layout = fake_sweep
    run_sweep(spec, layout=layout, progress=False)
    text = layout.table.read_text()
    offset = {"mid_field": 9, "inside_quotes": text.split("\n")[1].index('"') + 5,
              "last_field": len(text.rstrip("\n").split("\n")[-1]) - 3}[cut]
    layout.table.write_text(_cut_inside_row(text, 3, offset))  # the row of x-3 is cut short
    table, damaged = results.scan_table(layout.table)
    assert list(table["point"]) == ["x-1", "x-2"] and len(damaged) == 1
    line = text[:text.index("\ntoy,x-3")].count("\n") + 2
    assert damaged[0].line == line and str(layout.table) in str(damaged[0])
    with pytest.warns(results.DamagedTableWarning, match=f"toy.csv line {line}: damaged row"):
        results.read_table(layout.table)
    # The CLI's dry run names the damage; the sweep runs the point again and the table is whole.
    assert [p.action for p in plan_sweep(spec, layout)] == ["skip", "skip", "run"]
    logs = []
    rows = run_sweep(spec, layout=layout, progress=False, log=logs.append)
    assert [r["point"] for r in rows] == ["x-3"]
    assert any(f"line {line}: damaged row" in m for m in logs)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the rewritten table is sound
        final = results.read_table(layout.table)
    assert list(final["point"]) == ["x-1", "x-2", "x-3"] and final["tgs"].tolist() == [1.0, 2.0, 3.0]
    assert "toy.csv line" in layout.table.with_name("toy.csv.damaged").read_text()  # the damaged text kept


def test_garbage_row_and_report_survive(fake_sweep, tmp_path):
    spec, layout = fake_sweep
    run_sweep(spec, layout=layout, progress=False)
    with open(layout.table, "a") as f:
        f.write("toy,x-9,abc,okk\n\x00\x00garbage\n")
    with pytest.warns(results.DamagedTableWarning):
        frame = results.load_results(layout.results_dir)  # what the report reads
    assert sorted(frame["point"]) == ["x-1", "x-2", "x-3"]
    (layout.results_dir / "empty.csv").write_text("")
    (layout.results_dir / "binary.csv").write_bytes(b"\xff\xfe\x00bad")
    with pytest.raises(ValueError, match="binary.csv"):
        results.load_results(layout.results_dir)


def test_over_long_names_are_hashed_and_resume(toy_notebook, tmp_path, monkeypatch, capsys):
    overrides = [{"n_layers": n, "hidden_size": 2048, "moe_intermediate_size": 1408, "n_experts": 64,
                  "top_k": 6, "n_shared_experts": 2, "routed_scaling_factor": 2.5, "q_lora_rank": 512,
                  "kv_lora_rank": 256, "rope_theta": 10000.0} for n in (2, 3)]
    bundles = [{"model_overrides": o, "moe_path": "turbo"} for o in overrides]
    raw = {"name": "toy", "notebook": str(toy_notebook), "grid": {"cfg": bundles, "x": [1]}}
    points = spec_from_dict(raw).expand()
    names = [p.name for p in points]
    assert all(len(n) == MAX_NAME_CHARS for n in names) and len(set(names)) == 2
    assert names == [p.name for p in spec_from_dict(raw).expand()]  # deterministic
    assert names[0].startswith("model_overrides-") and "__h-" in names[0]
    short = spec_from_dict({**raw, "grid": {"x": [1]}, "base": {"model_overrides": overrides[0]}}).expand()
    assert short[0].name == "x-1"  # short names are unchanged (committed tables keep resuming)
    monkeypatch.setattr(runner, "execute_notebook", _ok_execute)
    monkeypatch.setattr(runner, "check_kernel", lambda name: None)
    layout = SweepLayout(results_dir=tmp_path / "results", runs_dir=tmp_path / "runs", sweep="toy")
    spec = spec_from_dict(raw)
    assert [r["status"] for r in run_sweep(spec, layout=layout, progress=False)] == ["ok", "ok"]
    assert run_sweep(spec, layout=layout, progress=False) == []  # resumed: nothing left to run
    assert (layout.results_dir / "toy" / f"{names[0]}.json").exists()


def test_misspelled_parameter_is_an_error_before_anything_runs(tmp_path, toy_notebook, capsys):
    spec_file = tmp_path / "typo.yaml"
    spec_file.write_text(f"notebook: {toy_notebook}\nbase: {{stpes: 3}}\ngrid: {{x: [1, 2]}}\n")
    assert cli.main(["sweep", str(spec_file), "--dry-run"]) == 2
    err = capsys.readouterr().err
    assert "unknown parameter(s) 'stpes' (in base; did you mean 'steps'?)" in err and len(err.splitlines()) == 1
    with pytest.raises(ValueError, match=r"'y' \(in points\[1\]\)"):
        spec_from_dict({"name": "s", "notebook": str(toy_notebook), "points": [{"x": 1}, {"y": 2}]})
    with pytest.raises(ValueError, match=r"'colour' \(in grid axis 'path' value \[0\]\)"):
        spec_from_dict({"name": "s", "notebook": str(toy_notebook), "grid": {"path": [{"colour": 1}]}})


def test_notebook_without_parameters_cell_or_result_json(tmp_path, toy_notebook):
    nb = json.loads(toy_notebook.read_text())
    nb["cells"][0]["metadata"]["tags"] = []
    (tmp_path / "untagged.ipynb").write_text(json.dumps(nb))
    with pytest.raises(ValueError, match="no cell tagged 'parameters'"):
        spec_from_dict({"name": "s", "notebook": str(tmp_path / "untagged.ipynb"), "grid": {"x": [1]}})
    nb["cells"][0]["metadata"]["tags"] = ["parameters"]
    nb["cells"][0]["source"] = "x = 1"
    (tmp_path / "norecord.ipynb").write_text(json.dumps(nb))
    with pytest.raises(ValueError, match="no parameter 'result_json'"):
        spec_from_dict({"name": "s", "notebook": str(tmp_path / "norecord.ipynb"), "grid": {"x": [1]}})
    spec_from_dict({"name": "s", "notebook": str(tmp_path / "norecord.ipynb"), "grid": {"x": [1]}, "record": False})


@pytest.mark.parametrize("text, message", [
    ("notebook: [unclosed\n", "is not valid YAML: "),
    ("notebook: !!python/object/apply:os.system ['touch PWNED']\n", "could not determine a constructor"),
    ("base: {a: 1}\n  bad indent: 2\n", "is not valid YAML: "),
    ("a: &a [1,1,1,1,1,1,1,1,1,1]\nb: &b [*a,*a,*a,*a,*a,*a,*a,*a,*a,*a]\nc: &c [*b,*b,*b,*b,*b,*b,*b,*b,*b,*b]\n"
     "d: &d [*c,*c,*c,*c,*c,*c,*c,*c,*c,*c]\ne: &e [*d,*d,*d,*d,*d,*d,*d,*d,*d,*d]\n"
     "f: &f [*e,*e,*e,*e,*e,*e,*e,*e,*e,*e]\ng: [*f,*f,*f,*f,*f,*f,*f,*f,*f,*f]\n", "more than 100000 values"),
])
def test_bad_yaml_is_one_line(tmp_path, text, message, capsys):
    spec_file = tmp_path / "bad.yaml"
    spec_file.write_text(text)
    start = time.monotonic()
    assert cli.main(["sweep", str(spec_file), "--dry-run"]) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1 and "bad.yaml" in err
    assert time.monotonic() - start < 5 and not (tmp_path / "PWNED").exists()


def test_too_many_points_is_refused(toy_notebook):
    with pytest.raises(ValueError, match="at most 10000"):
        spec_from_dict({"name": "s", "notebook": str(toy_notebook), "grid": {"x": list(range(200)), "mode": list(range(200))}})


@pytest.mark.parametrize("umask, mode", [(0o022, 0o644), (0o027, 0o640), (0o002, 0o664)])
def test_tables_are_created_with_the_umask(tmp_path, umask, mode):
    old = os.umask(umask)
    try:
        results.append_row(tmp_path / "t.csv", {"sweep": "s", "point": "a", "status": "ok"})
        results.append_row(tmp_path / "t.csv", {"sweep": "s", "point": "b", "status": "ok"})
    finally:
        os.umask(old)
    assert (tmp_path / "t.csv").stat().st_mode & 0o777 == mode


@pytest.mark.parametrize("message, status", [
    ("RESOURCE_EXHAUSTED: Error writing local file: No space left on device [OS error: 28]", "error"),
    ("OSError: [Errno 122] Disk quota exceeded: '/ckpt/2'", "error"),
    ("RESOURCE_EXHAUSTED: Out of memory while trying to allocate 1 bytes", "oom"),
])
def test_full_disk_is_not_oom(message, status):
    assert classify_error(RuntimeError(message))[0] == status


def test_unpreparable_point_is_an_error_row_not_an_abort(fake_sweep):
    spec, layout = fake_sweep
    layout.runs_dir.mkdir(parents=True)
    (layout.runs_dir / "toy").write_text("a file where the folder should be")
    rows = run_sweep(spec, layout=layout, progress=False)
    assert [r["status"] for r in rows] == ["error"] * 3 and "cannot prepare" in rows[0]["error"]


def test_spec_loader_rejects_huge_file(tmp_path):
    spec_file = tmp_path / "huge.yaml"
    spec_file.write_text("description: " + "x" * (1 << 20) + "\n")
    with pytest.raises(ValueError, match="limited to"):
        load_spec(spec_file)


def test_every_cut_of_a_real_table_keeps_only_intact_rows(tmp_path):
    """Cut the committed cpu_default table at many offsets inside its last two rows: the rows read back are always
    exactly the original rows before the cut, and the cut row (if any) is reported, never half-read."""
    from pathlib import Path

    from turbo_moe.experiments.store import migration_check

    # The committed cpu_default table, as the runner wrote it, rebuilt from the results store.
    source = tmp_path / "cpu_default.csv"
    store_dir = Path(__file__).parents[3] / "experiments" / "store"
    migration_check.rebuild_table(store_dir, "cpu_default", "cpu_default.csv").to_csv(source, index=False)
    text = source.read_text()
    full, _ = results.scan_table(source)
    lines = text.rstrip("\n").split("\n")
    assert len(lines) == len(full) + 1  # one line per row in this table
    region = len(text) - len(lines[-1]) - len(lines[-2]) - 2
    table = tmp_path / "cut.csv"
    # 40 offsets spread over the two rows, and each row's end (a cut there leaves a complete table).
    ends = [i + 1 for i in range(region, len(text)) if text[i] == "\n"]
    for cut in sorted({*range(region, len(text), max(1, (len(text) - region) // 40)), *ends}):
        table.write_text(text[:cut])
        sound, damaged = results.scan_table(table)
        n = len(sound)
        assert sound.astype(str).equals(full.iloc[:n].astype(str)), cut
        at_line_end = text[cut - 1] == "\n"
        assert len(damaged) == (0 if at_line_end else 1), cut  # a cut inside a row is always reported
        assert n == text[:cut].count("\n") - 1, cut  # every complete row before the cut is kept


def test_unwritable_table_is_one_line_from_the_cli(tmp_path, toy_notebook, test_kernel, monkeypatch, capsys):
    """A full disk while writing the table (patched writer): the CLI says so in one line, rc 2."""
    sweeps = tmp_path / "experiments" / "sweeps"
    sweeps.mkdir(parents=True)
    (sweeps / "toy.yaml").write_text(f"notebook: {toy_notebook}\nkernel: {test_kernel}\ngrid: {{x: [1]}}\n")
    monkeypatch.setattr(runner, "execute_notebook", _ok_execute)

    def disk_full(path, write):
        raise OSError(28, "No space left on device", str(path))

    monkeypatch.setattr(results, "write_atomic", disk_full)
    assert cli.main(["sweep", str(sweeps / "toy.yaml"), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "No space left on device" in err and "toy.csv" in err and len(err.strip().splitlines()) == 1


def test_failed_forced_rerun_keeps_the_earlier_record(toy_notebook, tmp_path, monkeypatch):
    layout = SweepLayout(results_dir=tmp_path / "results", runs_dir=tmp_path / "runs", sweep="toy")
    spec = spec_from_dict({"name": "toy", "notebook": str(toy_notebook), "points": [{"x": 3}]})
    monkeypatch.setattr(runner, "check_kernel", lambda name: None)
    monkeypatch.setattr(runner, "execute_notebook", _ok_execute)
    (first,) = run_sweep(spec, layout=layout, progress=False)
    record = layout.results_dir / first["record"]
    kept = record.read_bytes()

    monkeypatch.setattr(runner, "execute_notebook", lambda *a: ("error", "RuntimeError: kernel crashed"))
    (again,) = run_sweep(spec, layout=layout, force=True, progress=False)
    assert again["status"] == "error" and again["record"] is None
    assert record.read_bytes() == kept  # the finished run's curves are still there for its row
