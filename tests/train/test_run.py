"""End-to-end `run` on CPU with the `tiny` model: learning, determinism, exact resume, metrics, failures.

Runs that share a step program (same model, batch, schedule) reuse one compilation through the
persistent cache set up in conftest.py, which keeps this file within the CI budget.
"""

import json
import math

import jax
import numpy as np
import pytest

from turbo_moe.model import get_config
from turbo_moe.train import RunResult, TrainConfig, run
from turbo_moe.train import metrics as M
from turbo_moe.train.loop import _Trainer

WORDS = ("the king and queen of denmark speak to hamlet who is sad because his father died "
         "horatio sees a ghost on the wall at night and tells the prince").split()


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """A small structured text corpus: sentences from a tiny vocabulary, so loss can fall fast."""
    root = tmp_path_factory.mktemp("corpus")
    rng = np.random.default_rng(0)
    for i in range(8):
        lines = [" ".join(rng.choice(WORDS, size=rng.integers(5, 12))) + "." for _ in range(300)]
        (root / f"play{i}.txt").write_text("\n".join(lines) + "\n")
    return root


@pytest.fixture(scope="module")
def base(corpus, tmp_path_factory):
    """The shared config: tiny on the ragged path, 1 x 32 tokens per device per step (tests/conftest.py gives 8
    CPU devices, so this is data parallel), 30-step schedule."""
    return TrainConfig(model=get_config("tiny", moe_path="ragged"), dataset=str(corpus),
                       data_dir=str(tmp_path_factory.mktemp("data")),
                       per_device_batch=1, seq_len=32, steps=30, lr_schedule_steps=30, warmup_steps=3,
                       learning_rate=3e-3, eval_every=10, eval_batches=2, progress=False, seed=0)


@pytest.fixture(scope="module")
def long_run(base):
    return run(base)


def test_loss_falls_and_metrics_are_reported(long_run):
    r = long_run
    assert r.status == "ok", r.error
    ce = [row["ce_loss"] for row in r.history]
    assert len(r.history) == 30 and [row["step"] for row in r.history] == list(range(30))
    assert np.mean(ce[-5:]) < ce[0] - 0.8, ce  # starts near ln(256) = 5.5
    evals = [row["eval_loss"] for row in r.history if not math.isnan(row["eval_loss"])]
    assert len(evals) == 3 and evals[-1] < evals[0]
    s = r.summary
    assert s["steps_done"] == 30 and s["tgs_steps"] == 30 - M.TGS_SKIP_STEPS
    assert s["tgs"] > 0 and s["compile_time_s"] > 0
    assert math.isnan(s["mfu"]) and s["peak_flops_source"].startswith("unknown (cpu")
    assert s["peak_memory_bytes"] > 0 and "RSS" in s["memory_source"] and s["compiled_temp_bytes"] > 0
    assert s["dropped_fraction_mean"] == 0.0  # ragged is dropless
    assert s["params_active"] < s["params_total"] and s["flops_per_token"] > 6 * s["params_active"] * 0.5
    load = np.asarray(r.expert_load)
    cfg = base_model_cfg(r)
    assert load.shape == (cfg["n_layers"] - cfg["n_dense_layers"] + cfg["mtp_depth"], cfg["n_experts"])
    tokens = jax.device_count() * 32  # global batch
    assert load.sum(-1) == pytest.approx(np.full(len(load), tokens * cfg["top_k"]))  # every copy counted
    assert all(row["load_max_over_mean"] >= 1.0 for row in r.history)
    assert r.history[0]["lr"] == 0.0 and r.history[3]["lr"] == pytest.approx(3e-3)
    p = r.provenance
    assert p["device_kind"] and p["device_count"] == jax.device_count() and p["jax_version"] == jax.__version__
    assert p["config"]["steps"] == 30 and "git_commit" in p and p["date"]
    # the config as run (every "auto" as the CPU resolves it) and the choices the device made
    assert [p["config"][f] for f in ("master_weights", "moments_dtype")] == ["float32", None]
    assert p["device_choices"] == {"platform": "cpu", "attention": "xla", "swiglu_kernels": False,
                                   "router_topk_kernel": False, "scan_outputs_uninitialized": False}
    json.dumps(r.to_dict())  # JSON-serialisable as is


def base_model_cfg(result: RunResult) -> dict:
    return result.provenance["model_config"]


def test_same_seed_same_losses_and_resume_is_exact(base, long_run, tmp_path, capsys):
    """A killed-and-resumed run reproduces the uninterrupted one; same seed gives identical losses."""
    ckpt = str(tmp_path / "ckpt")
    killed = run(base.replace(steps=4, checkpoint_dir=ckpt, checkpoint_every=2))
    assert killed.status == "ok", killed.error
    resumed = run(base.replace(steps=8, checkpoint_dir=ckpt, resume=True, progress=True))
    assert resumed.status == "ok", resumed.error
    assert resumed.summary["resumed_from_step"] == 4
    assert "tok/dev/s" in capsys.readouterr().err  # the progress bar shows loss and TGS
    reference = [row["loss"] for row in long_run.history[:8]]
    assert resumed.losses() == reference  # bit-identical on CPU, steps 0-3 restored, 4-7 recomputed
    assert killed.losses() == reference[:4]
    # A different seed really changes the run (the test above could not pass by accident).
    other = run(base.replace(steps=2, seed=1))
    assert other.losses() != reference[:2]


def test_dense_cf_with_remat_on_synthetic_data_reports_drops(base):
    overrides = {"moe_path": "dense_cf", "capacity_factor": 1.0, "n_layers": 2, "mtp_depth": 0,  # fast compile
                 "remat_policy": "full"}
    tc = base.replace(dataset="synthetic", model_overrides=overrides,
                      steps=4, lr_schedule_steps=None, warmup_steps=1, eval_every=0)
    r = run(tc)
    assert r.status == "ok", r.error
    assert 0.0 < r.summary["dropped_fraction_mean"] < 0.5
    assert abs(r.history[0]["ce_loss"] - math.log(256)) < 0.3  # uniform tokens: loss stays near ln V
    assert r.provenance["dataset"]["source"] == "synthetic" and r.summary["tgs_steps"] == 2  # half of 4
    assert np.asarray(r.expert_load).shape == (1, 8) and r.provenance["model_config"]["remat_policy"] == "full"
    assert len(r.history[-1]["load_max_over_mean_per_layer"]) == 1


def test_unigram_head_bias_starts_at_the_data_unigram_loss(base, monkeypatch):
    # The router recipe's head_bias "unigram": the first step's loss is the data's unigram cross-entropy (the corpus
    # uses ~30 words of 256 ids), far below ~ln V without the bias. (A zero bias changes nothing: test_model.py.)
    from tests.model.conftest import router_recipe_with

    fast = {"n_layers": 2, "mtp_depth": 0}
    recipes = {"none": "deepseek_v3", "unigram": router_recipe_with(monkeypatch, head_bias="unigram")}
    losses = {}
    for head_bias, recipe in recipes.items():
        r = run(base.replace(model_overrides={**fast, "router_recipe": recipe}, steps=1, lr_schedule_steps=None,
                             warmup_steps=1, eval_every=0))
        assert r.status == "ok", r.error
        losses[head_bias] = r.history[0]["ce_loss"]
    assert abs(losses["none"] - math.log(256)) < 0.3
    assert losses["unigram"] < losses["none"] - 1.5, losses


def test_nan_loss_returns_status_nan(base):
    # Weights initialised at 1e30 overflow: a genuine non-finite loss within the first steps.
    r = run(base.replace(model_overrides={"init_std": 1e30}, steps=5))
    assert r.status == "nan", r.error
    bad_step = r.history[-1]["step"]
    assert f"at step {bad_step}" in r.error and not math.isfinite(r.history[-1]["loss"])
    assert r.summary["steps_done"] == bad_step + 1 < 5


def test_impossible_batch_returns_oom_at_compile(base):
    tc = base.replace(model_overrides={"n_layers": 1, "mtp_depth": 0}, per_device_batch=2**18,
                      dataset="synthetic", steps=2, warmup_steps=1, lr_schedule_steps=None)
    r = run(tc)
    assert r.status == "oom", r.error
    assert "compilation" in r.error and "per_device_batch=262144" in r.error
    assert r.summary["oom_requested_bytes"] > r.summary["device_memory_limit_bytes"]
    assert r.summary["steps_done"] == 0


def test_allocator_error_at_run_time_returns_oom(base, monkeypatch):
    def compile_then_fail(self, train_step, state, mesh):
        def step(state, batch):
            raise jax.errors.JaxRuntimeError(
                "RESOURCE_EXHAUSTED: Out of memory while trying to allocate 17179869184 bytes.")
        return step

    monkeypatch.setattr(_Trainer, "_compile", compile_then_fail)
    r = run(base.replace(steps=3))
    assert r.status == "oom" and "during training" in r.error
    assert r.summary["oom_requested_bytes"] == 17179869184


def test_next_step_is_queued_before_metrics_are_read(base, monkeypatch):
    """One step ahead: step n + 1 is dispatched before step n's metrics are read (the device does not wait for the
    host between steps), except after a step whose state is evaluated (or saved) and after the last one."""
    events = []
    original_compile, original_get = _Trainer._compile, jax.device_get

    def compile_and_count(self, train_step, state, mesh):
        compiled = original_compile(self, train_step, state, mesh)

        def step(state, batch):
            events.append(("dispatch", sum(e[0] == "dispatch" for e in events)))
            return compiled(state, batch)
        return step

    def get(tree):
        if isinstance(tree, dict) and "loss" in tree:  # the loop's read of a step's metrics
            events.append(("read", sum(e[0] == "read" for e in events)))
        return original_get(tree)

    monkeypatch.setattr(_Trainer, "_compile", compile_and_count)
    monkeypatch.setattr(jax, "device_get", get)
    r = run(base.replace(steps=12))  # eval_every 10: evaluated after steps 9 and 11
    assert r.status == "ok", r.error
    assert [row["step"] for row in r.history] == list(range(12))
    at = {e: i for i, e in enumerate(events)}
    assert len(at) == 12 + 12 and ("dispatch", 12) not in at
    for n in range(11):
        ahead = at[("dispatch", n + 1)] < at[("read", n)]
        assert ahead == (n != 9), (n, events)


def test_bad_dataset_path_raises_naming_it(base, tmp_path):
    with pytest.raises(FileNotFoundError, match="missing_corpus"):
        run(base.replace(dataset=str(tmp_path / "missing_corpus")))


def test_turbo_path_matches_ragged(base, request):
    """The FFI-kernel path trains through the same loop and follows the pure-JAX dropless path."""
    ops = pytest.importorskip("turbo_moe.ops")
    try:
        ops.ensure_registered()
    except RuntimeError as error:  # library not built (or stale) in this checkout
        pytest.skip(f"turbo_moe ops library unavailable: {error}")
    long_run = request.getfixturevalue("long_run")  # only once we know the kernels are there
    r = run(base.replace(model_overrides={"moe_path": "turbo"}, steps=3))
    assert r.status == "ok", r.error
    assert r.summary["dropped_fraction_mean"] == 0.0
    np.testing.assert_allclose(r.losses(), long_run.losses()[:3], rtol=1e-3)
