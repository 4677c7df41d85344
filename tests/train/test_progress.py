"""Run progress outside a notebook (phase lines with durations) and the one-line summary."""

import math

from turbo_moe.train.progress import RunProgress, summary_line


def test_terminal_progress_names_each_phase_with_its_duration(capsys):
    progress = RunProgress("train turbo", 2, notebook=False)
    progress.phase("initialisation")
    progress.phase("compilation")
    progress.phase("training")
    progress.step(1, 5.25, 1234.0)
    progress.step(2, 5.0, 1500.0)
    progress.close("the summary line")
    captured = capsys.readouterr()
    for phase in ("setting up (data, mesh, model)", "initialising parameters", "compiling the train step"):
        assert f"train turbo: {phase} ..." in captured.err
    assert "train turbo: compiling the train step: 0.0 s" in captured.err
    assert "2/2" in captured.err and "train CE=5.000, tgs=1500 tok/dev/s" in captured.err
    assert captured.out == "the summary line\n"
    assert progress.status_text().startswith("train turbo: finished 2/2 steps [####################] 100%")


def test_disabled_progress_prints_nothing(capsys):
    progress = RunProgress("train x", 3, enabled=False)
    progress.phase("compilation")
    progress.close("summary")
    assert capsys.readouterr() == ("", "")


def test_summary_line_has_units_and_skips_unknowns():
    summary = {"steps_done": 20, "phase_seconds": {"setup": 1.0, "compilation": 30.5, "training": 10.0},
               "compile_time_s": 30.4, "final_loss": 5.12345, "final_eval_loss": math.nan, "tgs": 12345.6,
               "peak_memory_bytes": 1433915392, "memory_source": "process peak RSS (host)"}
    line = summary_line("ok", None, summary, "train ragged")
    assert line == ("train ragged: ok | 20 steps in 41.5 s (compile 30.4 s) | final total loss 5.1235 | "
                    "TGS 12,346 tok/dev/s | peak memory 1.34 GiB (process peak RSS)")
    # Train and eval cross-entropy side by side; the total loss (CE + MTP + balance terms) named as such.
    summary.update(final_ce_loss=5.571, final_eval_loss=5.589, final_loss=7.2444)
    assert "| final train CE 5.5710, eval CE 5.5890 (total loss incl. MTP and balance 7.2444) |" in \
        summary_line("ok", None, summary, "train ragged")
    failed = summary_line("oom", "out of memory during compilation: asked 5 GiB\ntraceback...", {}, "train x")
    assert failed == "train x: oom (out of memory during compilation: asked 5 GiB) | 0 steps in 0.0 s"
