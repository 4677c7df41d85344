"""`turbo-moe train` / `launch`: the config file and --set, the process group from the environment, the launcher's
process handling, and one training run in its folder with its resume (in this process: 8 CPU devices)."""

import json
import os
import stat
import struct
import sys
import time

import pytest

from turbo_moe.cli import main
from turbo_moe.train import distributed
from turbo_moe.train.launch import apply_sets, launch_local, load_train_config, parse_set, process_envs


def write(path, text):
    path.write_text(text)
    return path


@pytest.fixture
def config_file(tmp_path):
    return write(tmp_path / "run.yaml", "model: tiny\nmodel_overrides:\n  moe_path: ragged\ndataset: synthetic\n"
                                        "steps: 12\nlearning_rate: 3e-3\nseq_len: 32\n")


# ------------------------------------------------------------------ config file and --set
def test_file_and_sets_give_the_config(config_file):
    tc = load_train_config(config_file, ["steps=20", "model_overrides.moe_path=dense_cf", "seed=7",
                                         "checkpoint_dir=null", "progress=false", "min_lr_ratio=.5",
                                         "model_overrides.top_k=1", "weight_decay=1e-2"])
    assert tc.steps == 20 and tc.seed == 7 and tc.progress is False and tc.checkpoint_dir is None
    assert tc.learning_rate == 3e-3 and tc.weight_decay == 1e-2 and tc.min_lr_ratio == 0.5  # YAML 1.2 floats
    assert tc.model_overrides == {"moe_path": "dense_cf", "top_k": 1, "max_seq_len": 32}  # seq_len: the model's
    assert tc.model_config().moe_path == "dense_cf" and tc.model_config().top_k == 1


def test_auto_path_from_the_file_and_set_is_recorded_resolved(config_file, tmp_path):
    """moe_path "auto" in a config file or `--set` is the device's fastest dropless path, and the config (what the
    run's record holds) names that path, not "auto"."""
    from turbo_moe.model.config import resolve_moe_path

    fastest = resolve_moe_path("auto")
    auto_file = write(tmp_path / "auto.yaml", config_file.read_text().replace("moe_path: ragged", "moe_path: auto"))
    for tc in (load_train_config(config_file, ["model_overrides.moe_path=auto"]), load_train_config(auto_file)):
        assert tc.model_overrides["moe_path"] == tc.to_dict()["model_overrides"]["moe_path"] == fastest
        assert tc.model_config().moe_path == fastest


def test_sub_config_sections_and_dotted_sets(tmp_path):
    """A YAML section per sub-config, and --set into one, reach the same fields as the flat keys."""
    sections = write(tmp_path / "sections.yaml", "model: tiny\noptimizer:\n  learning_rate: 1e-3\n"
                                                 "checkpoint:\n  every: 5\n")
    tc = load_train_config(sections, ["optimizer.moments_dtype=bfloat16", "data.per_device_batch=2"])
    assert (tc.learning_rate, tc.moments_dtype, tc.checkpoint_every, tc.per_device_batch) == (1e-3, "bfloat16", 5, 2)
    with pytest.raises(ValueError, match="TrainConfig.learning_rate: given both flat and in the optimizer section"):
        load_train_config(sections, ["learning_rate=2e-3"])


def test_sets_apply_in_order_and_leave_the_input_alone():
    values = {"model_overrides": {"moe_path": "turbo"}}
    out = apply_sets(values, ["model_overrides.moe_path=ragged", "model_overrides.moe_path=dense_cf",
                              "model.d_model=64"])
    assert out == {"model_overrides": {"moe_path": "dense_cf"}, "model": {"d_model": 64}}
    assert values == {"model_overrides": {"moe_path": "turbo"}}
    assert parse_set("dataset=") == (["dataset"], None)
    assert parse_set("text_field=a=b") == (["text_field"], "a=b")


@pytest.mark.parametrize("sets, message", [
    (["steps=-1"], r"TrainConfig\.steps: must be a positive int, got -1"),
    (["steps=ten"], r"TrainConfig\.steps: must be a positive int, got 'ten'"),
    (["stepz=3"], r"unknown TrainConfig field\(s\) \['stepz'\]"),
    (["model_overrides.moe_path=nope"], r"moe_path"),
    (["model_overrides.top_kk=2"], r"top_kk"),
    (["steps"], r"--set 'steps': expected key=value"),
    (["model overrides.x=1"], r"expected key=value with key a field name or a dotted path"),
    (["steps.x=1"], r"--set 'steps.x=1': steps is 12, not a mapping"),
    (["steps=[1"], r"--set 'steps=\[1': not valid YAML"),
])
def test_bad_values_name_what_is_wrong(config_file, sets, message):
    with pytest.raises(ValueError, match=message):
        load_train_config(config_file, sets)


def test_bad_files_are_named(tmp_path):
    with pytest.raises(ValueError, match=r"config file '.*missing.yaml': cannot read it"):
        load_train_config(tmp_path / "missing.yaml")
    with pytest.raises(ValueError, match=r"'.*list.yaml': expected a mapping of TrainConfig fields, got list"):
        load_train_config(write(tmp_path / "list.yaml", "- steps\n"))
    with pytest.raises(ValueError, match=r"'.*broken.yaml': not valid YAML at line 3, column 1: expected ','"):
        load_train_config(write(tmp_path / "broken.yaml", "steps: 3\nmodel: [tiny\n"))
    with pytest.raises(ValueError, match=r"model_overrides: must be a mapping, got list"):
        load_train_config(write(tmp_path / "overrides.yaml", "model_overrides: [1, 2]\n"))


def test_cli_reports_a_bad_config_in_one_line(config_file, capsys):
    assert main(["train", str(config_file), "--set", "per_device_batch=0"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "turbo-moe train: error: TrainConfig.per_device_batch" in err
    assert main(["launch", "--cpu-devices", "2", "--processes", "2", str(config_file), "--set", "stepz=1"]) == 2
    assert "turbo-moe launch: error: unknown TrainConfig field(s) ['stepz']" in capsys.readouterr().err


# ------------------------------------------------------------------ the process group from the environment
def test_no_job_variables_is_one_process():
    assert distributed.detect({}) is None
    assert distributed.detect({"SLURM_PROCID": "0", "SLURM_NTASKS": "4"}) is None  # sbatch script, not an srun step
    assert distributed.detect({"SLURM_STEP_NUM_TASKS": "1", "SLURM_PROCID": "0"}) is None
    assert distributed.detect({"OMPI_COMM_WORLD_SIZE": "1", "OMPI_COMM_WORLD_RANK": "0"}) is None


def test_plain_variables():
    env = {"TURBO_MOE_COORDINATOR": "host0:1234", "TURBO_MOE_NUM_PROCESSES": "4", "TURBO_MOE_PROCESS_ID": "3"}
    assert distributed.detect(env) == distributed.ProcessGroup("env", 4, 3, "host0:1234")
    jax_names = {"JAX_COORDINATOR_ADDRESS": "h:1", "JAX_NUM_PROCESSES": "2", "JAX_PROCESS_ID": "0",
                 "TURBO_MOE_LOCAL_DEVICE_IDS": "2,3"}
    assert distributed.detect(jax_names) == distributed.ProcessGroup("env", 2, 0, "h:1", (2, 3))
    with pytest.raises(ValueError, match="needs TURBO_MOE_COORDINATOR as well"):
        distributed.detect({"TURBO_MOE_NUM_PROCESSES": "2", "TURBO_MOE_PROCESS_ID": "0"})
    with pytest.raises(ValueError, match=r"TURBO_MOE_PROCESS_ID='one': expected an integer"):
        distributed.detect({**env, "TURBO_MOE_PROCESS_ID": "one"})
    with pytest.raises(ValueError, match=r"process id must be an int in \[0, 4\), got 4"):
        distributed.detect({**env, "TURBO_MOE_PROCESS_ID": "4"})
    with pytest.raises(ValueError, match="coordinator must be host:port"):
        distributed.detect({**env, "TURBO_MOE_COORDINATOR": "host0"})
    with pytest.raises(ValueError, match="TURBO_MOE_COORDINATOR is set but neither"):
        distributed.detect({"TURBO_MOE_COORDINATOR": "h:1"})


def test_slurm_step():
    step = {"SLURM_STEP_NUM_TASKS": "16", "SLURM_PROCID": "9", "SLURM_NODEID": "1", "SLURM_LOCALID": "1",
            "SLURM_STEP_TASKS_PER_NODE": "8(x2)", "SLURM_JOB_ID": "77", "SLURM_STEP_NODELIST": "n[1-2]"}
    assert distributed.detect(step) == distributed.ProcessGroup("slurm", 16, 9, None, (1,))  # one GPU a task
    # srun --gpus-per-task=1: the task already sees only its GPU
    assert distributed.detect({**step, "CUDA_VISIBLE_DEVICES": "5"}).local_device_ids is None
    per_host = {**step, "SLURM_STEP_NUM_TASKS": "2", "SLURM_PROCID": "1", "SLURM_LOCALID": "0",
                "SLURM_STEP_TASKS_PER_NODE": "1(x2)"}
    assert distributed.detect(per_host) == distributed.ProcessGroup("slurm", 2, 1, None, None)  # every GPU
    assert distributed.detect({**per_host, "JAX_COORDINATOR_ADDRESS": "n1:999"}).coordinator == "n1:999"
    assert [distributed.slurm_tasks_on_node("2(x3),1", i) for i in range(4)] == [2, 2, 2, 1]
    with pytest.raises(ValueError, match="SLURM tasks per node '2x3'"):
        distributed.slurm_tasks_on_node("2x3", 0)


def test_open_mpi():
    ranks = {"OMPI_COMM_WORLD_SIZE": "4", "OMPI_COMM_WORLD_RANK": "2", "OMPI_COMM_WORLD_LOCAL_RANK": "0",
             "OMPI_COMM_WORLD_LOCAL_SIZE": "2", "OMPI_MCA_orte_hnp_uri": "1531576320.0;tcp://10.0.0.1:3491"}
    assert distributed.detect(ranks) == distributed.ProcessGroup("openmpi", 4, 2, None, (0,))
    ompi5 = {k: v for k, v in ranks.items() if k != "OMPI_MCA_orte_hnp_uri"}
    with pytest.raises(ValueError, match="set TURBO_MOE_COORDINATOR=host:port"):
        distributed.detect(ompi5)
    assert distributed.detect({**ompi5, "TURBO_MOE_COORDINATOR": "h:5"}).coordinator == "h:5"


# ------------------------------------------------------------------ the local launcher
def test_process_envs_split_the_devices():
    base = {"CUDA_VISIBLE_DEVICES": "4,5,6,7", "SLURM_PROCID": "3", "TURBO_MOE_PROCESS_ID": "9", "XLA_FLAGS": "--a=1"}
    gpu = process_envs(2, gpus=4, port=1234, base=base)
    assert [e["CUDA_VISIBLE_DEVICES"] for e in gpu] == ["4,5", "6,7"]
    assert [e["TURBO_MOE_PROCESS_ID"] for e in gpu] == ["0", "1"]
    assert all(e["TURBO_MOE_COORDINATOR"] == "127.0.0.1:1234" and "SLURM_PROCID" not in e for e in gpu)
    assert [e["CUDA_VISIBLE_DEVICES"] for e in process_envs(2, gpus=2, port=1, base={})] == ["0", "1"]
    cpu = process_envs(2, cpu_devices=3, port=1, base=base)
    assert cpu[1]["XLA_FLAGS"] == "--a=1 --xla_force_host_platform_device_count=3" and cpu[1]["JAX_PLATFORMS"] == "cpu"
    with pytest.raises(ValueError, match="--gpus 3 must be a positive multiple of --processes 2"):
        process_envs(2, gpus=3, port=1, base={})
    with pytest.raises(ValueError, match="CUDA_VISIBLE_DEVICES='4,5,6,7' lists 4"):
        process_envs(8, gpus=8, port=1, base=base)
    with pytest.raises(ValueError, match="exactly one of --gpus N and --cpu-devices K"):
        process_envs(2, port=1, base={})


def test_launch_stops_the_others_when_one_fails(tmp_path, config_file):
    """Process 1 fails at once; process 0 would run for a minute: the launcher stops it and returns 1's code."""
    fake = write(tmp_path / "fake_python", f"""#!{sys.executable}
import os, sys, time
rank = os.environ["TURBO_MOE_PROCESS_ID"]
open(os.path.join({str(tmp_path)!r}, "pid" + rank), "w").write(str(os.getpid()))
if rank == "1":
    print("process 1 breaks", flush=True)
    sys.exit(3)
time.sleep(60)
""")
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    lines = []
    start = time.monotonic()
    code = launch_local(config_file, processes=2, cpu_devices=1, python=str(fake), log_dir=tmp_path / "logs",
                        out=tmp_path / "run", echo=lambda *a, **k: lines.append(" ".join(map(str, a))))
    assert code == 3 and time.monotonic() - start < 30
    assert any("process 1 exited with code 3" in line for line in lines)
    assert any("[process 1] process 1 breaks" in line for line in lines)
    pid0 = int((tmp_path / "pid0").read_text())
    with pytest.raises(ProcessLookupError):
        os.kill(pid0, 0)


# ------------------------------------------------------------------ one run in its folder, resumed
def event_scalars(folder) -> dict[str, dict[int, float]]:
    """{tag: {step: value}} of every TensorBoard event file in `folder` (TFRecord framing around Event protos)."""
    from tensorboardX.proto import event_pb2

    scalars: dict[str, dict[int, float]] = {}
    for path in sorted(folder.glob("events.out.tfevents.*")):
        data, at = path.read_bytes(), 0
        while at < len(data):
            (size,) = struct.unpack("<Q", data[at:at + 8])
            event = event_pb2.Event.FromString(data[at + 12:at + 12 + size])
            at += 12 + size + 4
            for value in event.summary.value:
                scalars.setdefault(value.tag, {})[event.step] = value.simple_value
    return scalars


def test_train_writes_its_run_folder_and_resumes(tmp_path, config_file, monkeypatch, capsys):
    for name in ("TURBO_MOE_COORDINATOR", "TURBO_MOE_NUM_PROCESSES", "TURBO_MOE_PROCESS_ID", "SLURM_STEP_NUM_TASKS",
                 "OMPI_COMM_WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    out = tmp_path / "run"
    common = ["model_overrides.n_layers=2", "model_overrides.mtp_depth=0", "per_device_batch=1", "expert_parallel=2",
              "eval_batches=0", "progress=false", "lr_schedule_steps=6", "warmup_steps=1"]
    train = ["train", str(config_file), "--out", str(out), *(a for s in common for a in ("--set", s))]
    assert main([*train, "--set", "steps=4"]) == 0
    first = json.loads((out / "record.json").read_text())
    assert first["status"] == "ok" and [row["step"] for row in first["history"]] == [0, 1, 2, 3]
    assert first["provenance"]["process_count"] == 1 and first["summary"]["process_count"] == 1
    assert first["summary"]["final_ce_loss"] == first["history"][-1]["ce_loss"]
    assert (out / "checkpoint" / "4").is_dir()  # the run folder holds the checkpoint
    assert (out / "history.csv").read_text().splitlines()[0].startswith("step,loss,ce_loss,")
    printed = capsys.readouterr().out
    assert f"results in {out}: record.json, history.csv, TensorBoard events" in printed and "final train CE" in printed
    # The same schedule continued (lr_schedule_steps=6 in both calls): the record grows, the curves go on.
    assert main([*train, "--set", "steps=6", "--set", "resume=true"]) == 0
    resumed = json.loads((out / "record.json").read_text())
    assert resumed["summary"]["resumed_from_step"] == 4
    assert [row["step"] for row in resumed["history"]] == list(range(6))
    assert [row["loss"] for row in resumed["history"][:4]] == [row["loss"] for row in first["history"]]
    curves = event_scalars(out)
    assert sorted(curves["loss/train_ce"]) == list(range(6))
    assert curves["loss/train_ce"][5] == pytest.approx(resumed["history"][5]["ce_loss"])
    # The finished run resumed again: nothing runs, nothing changes.
    before = (out / "record.json").read_bytes()
    capsys.readouterr()
    assert main([*train, "--set", "steps=6", "--set", "resume=true"]) == 0
    assert "is finished" in capsys.readouterr().out and (out / "record.json").read_bytes() == before
    # Another schedule is refused in one line, naming the field; the record stays.
    assert main([*train, "--set", "steps=8", "--set", "lr_schedule_steps=8", "--set", "resume=true"]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("turbo-moe train: error: cannot resume: the learning-rate schedule") and \
        "lr_schedule_steps=6 in the checkpoint, 8 now" in err, err
    assert (out / "record.json").read_bytes() == before
