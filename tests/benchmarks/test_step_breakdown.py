"""benchmarks/step_breakdown.py: HLO metadata parsing, category/phase assignment, trace event selection and
the exclusive-time attribution, on small handmade HLO and trace snippets (the end-to-end collect compiles a
train step: minutes on the CPU, so it is not a test)."""
from __future__ import annotations

import gzip
import importlib.util
import json
import sys
from pathlib import Path

import pytest

_PATH = Path(__file__).resolve().parents[2] / "benchmarks" / "_trace_categories.py"
_spec = importlib.util.spec_from_file_location("_trace_categories", _PATH)
tcat = importlib.util.module_from_spec(_spec)
sys.modules["_trace_categories"] = tcat
_spec.loader.exec_module(tcat)

HLO = '''HloModule jit_train_step, is_scheduled=true

%fused_computation.1 (param_0.1: f32[4,8]) -> f32[4,8] {
  %param_0.1 = f32[4,8]{1,0} parameter(0)
  %multiply.3 = f32[4,8]{1,0} multiply(%param_0.1, %param_0.1), metadata={op_name="jit(train_step)/jvp()/while/body/closed_call/attention/mul" stack_frame_id=3}
  ROOT %add.2 = f32[4,8]{1,0} add(%multiply.3, %param_0.1), metadata={op_name="jit(train_step)/jvp()/while/body/closed_call/attention/add" stack_frame_id=4}
}

%wrapped_convert_computation (param_0.2: bf16[4,8]) -> f32[4,8] {
  %param_0.2 = bf16[4,8]{1,0} parameter(0)
  ROOT %convert.1 = f32[4,8]{1,0} convert(%param_0.2)
}

ENTRY %main.9 (Arg_0.1: f32[4,8], Arg_1.2: bf16[4,8]) -> (f32[4,8], f32[4,8]) {
  %Arg_0.1 = f32[4,8]{1,0} parameter(0), metadata={op_name="state.params"}
  %Arg_1.2 = bf16[4,8]{1,0} parameter(1)
  %fusion.1 = f32[4,8]{1,0} fusion(%Arg_0.1), kind=kLoop, calls=%fused_computation.1
  %wrapped_convert = f32[4,8]{1,0} fusion(%Arg_1.2), kind=kLoop, calls=%wrapped_convert_computation
  %ffi_call.7 = (bf16[16,8]{1,0}, s32[4]{0}) custom-call(%fusion.1), custom_call_target="turbo_moe_grouped_gemm", api_version=API_VERSION_TYPED_FFI, metadata={op_name="jit(train_step)/transpose(jvp())/while/body/closed_call/checkpoint/rematted_computation/moe/routed_experts/grouped_gemm/ffi_call" stack_frame_id=9}
  %all-reduce.2 = f32[4,8]{1,0} all-reduce(%fusion.1), replica_groups={}, to_apply=%fused_computation.1
  ROOT %tuple.3 = (f32[4,8]{1,0}, f32[4,8]{1,0}) tuple(%fusion.1, %wrapped_convert)
}
'''


def test_parse_hlo_metadata_opcodes_and_fusion_majority():
    hlo = tcat.parse_hlo(HLO)
    assert hlo["ffi_call.7"].opcode == "custom-call"
    assert hlo["ffi_call.7"].op_name.endswith("grouped_gemm/ffi_call")
    assert hlo["fusion.1"].opcode == "fusion" and hlo["fusion.1"].inherited
    assert "/attention/" in hlo["fusion.1"].op_name  # majority of what it calls
    assert hlo["wrapped_convert"].op_name == "" and hlo["wrapped_convert"].computation == "main.9"
    assert hlo["multiply.3"].computation == "fused_computation.1"
    assert hlo["all-reduce.2"].opcode == "all-reduce"


@pytest.mark.parametrize("op_name, opcode, expected", [
    ("jit(train_step)/jvp()/while/body/closed_call/moe/routed_experts/permute/ffi_call", "", ("permute", "fwd")),
    ("jit(train_step)/transpose(jvp())/while/body/closed_call/moe/routed_experts/unpermute/ffi_call", "",
     ("unpermute", "bwd")),
    ("jit(train_step)/transpose(jvp())/while/body/closed_call/checkpoint/rematted_computation/attention/mul", "",
     ("attention", "bwd_remat")),
    ("jit(train_step)/transpose(jvp())/while/body/closed_call/checkpoint/attention/dot_general", "",
     ("attention", "bwd")),
    ("jit(train_step)/jvp()/while/body/closed_call/moe/routed_experts/swiglu/jit(silu)/logistic", "", ("swiglu", "fwd")),
    ("jit(train_step)/jvp()/while/body/closed_call/moe/routed_experts/dot_general", "", ("routed_experts", "fwd")),
    ("jit(train_step)/jvp()/while/body/closed_call/moe/shared_expert/dot_general", "", ("shared_expert", "fwd")),
    ("jit(train_step)/jvp()/while/body/closed_call/moe/router/top_k", "", ("router", "fwd")),
    ("jit(train_step)/transpose(jvp())/while/body/closed_call/dense_ffn/transpose", "", ("dense_ffn", "bwd")),
    ("jit(train_step)/jvp(embedding)/jit(_take)/gather", "", ("embedding", "fwd")),
    ("jit(train_step)/transpose(jvp(lm_head))/transpose", "", ("lm_head+loss", "bwd")),
    ("jit(train_step)/jvp(loss)/jit(log_softmax)/reduce_max", "", ("lm_head+loss", "fwd")),
    ("jit(train_step)/transpose(jvp(mtp))/moe/routed_experts/swiglu/jit(silu)/mul", "", ("mtp", "bwd")),
    ("jit(train_step)/optimizer/add", "", ("optimizer", "update")),
    ("jit(train_step)/jvp()/while/body/jit(dynamic_index_in_dim)/dynamic_slice", "fusion", ("other", "fwd")),
    ("", "all-reduce-start", ("collective", "none")),
    ("jit(train_step)/transpose(jvp())/while/body/closed_call/checkpoint/moe/routed_experts/shard_map/ppermute",
     "collective-permute-start", ("collective", "bwd")),
])
def test_categorize(op_name, opcode, expected):
    assert tcat.categorize(op_name, opcode)[:2] == expected


def test_categorize_details():
    assert tcat.categorize("jit(train_step)/jvp(mtp)/attention/mul")[2] == "mtp/attention"
    assert tcat.categorize("", "all-gather")[2] == "unscoped"
    assert tcat.categorize("jit(train_step)/jvp()/while/body/closed_call/moe/routed_experts/shard_map/ppermute",
                           "collective-permute")[2] == "routed_experts"
    assert tcat.categorize("jit(train_step)/jvp(mtp)/attention/all_gather", "all-gather-start")[2] == "mtp/attention"
    assert tcat.categorize("", "copy")[2] == "copy"
    assert tcat.categorize("jit(train_step)/jvp(jit(log_softmax))/exp")[2] == "unlabelled"


def _meta(pid, name, tid=None, tname=None):
    if tid is None:
        return {"ph": "M", "pid": pid, "name": "process_name", "args": {"name": name}}
    return {"ph": "M", "pid": pid, "tid": tid, "name": "thread_name", "args": {"name": tname}}


def test_device_events_gpu_takes_stream_lines_only():
    trace = {"traceEvents": [
        _meta(1, "/host:CPU"), _meta(2, "/device:GPU:0"),
        _meta(2, "", 10, "Stream #13(Compute)"), _meta(2, "", 11, "XLA Ops"),
        {"ph": "X", "pid": 1, "tid": 5, "ts": 0, "dur": 50, "name": "PjitFunction(jit(train_step))"},
        {"ph": "X", "pid": 2, "tid": 10, "ts": 1, "dur": 4, "name": "loop_add_fusion",
         "args": {"hlo_op": "fusion.1", "hlo_module": "jit_train_step"}},
        {"ph": "X", "pid": 2, "tid": 10, "ts": 6, "dur": 2, "name": "sm90_gemm",
         "args": {"kernel_annotation": "Thunk:#name=moe/router/dot_general,hlo_op=custom-call.3#"}},
        {"ph": "X", "pid": 2, "tid": 11, "ts": 1, "dur": 4, "name": "fusion.1", "args": {"hlo_op": "fusion.1"}},
    ]}
    events = tcat.device_events(trace)
    assert [e["hlo_op"] for e in events] == ["fusion.1", "custom-call.3"]
    assert events[0]["hlo_module"] == "jit_train_step" and events[0]["line"].startswith("Stream")


def test_device_events_cpu_takes_thunks_with_hlo_op():
    trace = {"traceEvents": [
        _meta(7, "/host:CPU"), _meta(7, "", 1, "python"), _meta(7, "", 2, "tf_XLAEigen/1"),
        {"ph": "X", "pid": 7, "tid": 1, "ts": 0, "dur": 90, "name": "PjitFunction(jit(train_step))"},
        {"ph": "X", "pid": 7, "tid": 2, "ts": 5, "dur": 3, "name": "wrapped_convert",
         "args": {"hlo_op": "wrapped_convert", "hlo_module": "jit_train_step"}},
    ]}
    events = tcat.device_events(trace)
    assert len(events) == 1 and events[0]["name"] == "wrapped_convert"


def _ev(line, ts, dur, op):
    return {"process": "p", "line": line, "name": op, "hlo_op": op, "hlo_module": "m", "label": "",
            "ts_us": float(ts), "dur_us": float(dur)}


def test_exclusive_times_nesting_and_concurrency_sum_to_union():
    events = [_ev("a", 0, 10, "outer"), _ev("a", 2, 3, "inner"),  # nested: inner 3, outer 7
              _ev("b", 20, 10, "x"), _ev("c", 25, 10, "y"),  # overlap 25..30 split 2.5 / 2.5
              _ev("a", 50, 5, "z")]
    times, union = tcat.exclusive_times(events)
    assert times["inner"] == pytest.approx(3) and times["outer"] == pytest.approx(7)
    assert times["x"] == pytest.approx(7.5) and times["y"] == pytest.approx(7.5)
    assert union == pytest.approx(10 + 15 + 5)
    assert sum(times.values()) == pytest.approx(union)


def test_resolve_instruction_falls_back_to_kernel_name():
    hlo = tcat.parse_hlo(HLO)
    assert tcat.resolve_instruction({"hlo_op": "", "name": "fusion_1"}, hlo) == "fusion.1"
    assert tcat.resolve_instruction({"hlo_op": "ffi_call.7", "name": "k"}, hlo) == "ffi_call.7"
    assert tcat.resolve_instruction({"hlo_op": "", "name": "memcpy"}, hlo) == "?memcpy"


def test_events_csv_round_trip(tmp_path):
    events = [_ev("a", 0, 10, "outer"), _ev("b", 1.5, 2.25, "x")]
    tcat.write_events_csv(events, tmp_path / "e.csv.gz")
    assert tcat.read_events_csv(tmp_path / "e.csv.gz") == events


def _step_breakdown_module():
    path = Path(__file__).resolve().parents[2] / "benchmarks" / "step_breakdown.py"
    spec = importlib.util.spec_from_file_location("step_breakdown", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_train_overrides_are_parsed_refused_when_collect_sets_them_and_tagged():
    sb = _step_breakdown_module()
    explicit = {"model": "tiny", "per_device_batch": 2, "remat_policy": None}
    assert sb.train_overrides_arg('{"adam_mu_dtype": "bfloat16"}', explicit) == {"adam_mu_dtype": "bfloat16"}
    assert sb.train_overrides_arg(None, explicit) == {}
    with pytest.raises(SystemExit, match=r"\['per_device_batch'\] are set by collect"):
        sb.train_overrides_arg('{"per_device_batch": 4}', explicit)
    with pytest.raises(SystemExit, match="expected a JSON dict"):
        sb.train_overrides_arg('["adam_mu_dtype"]', explicit)
    params = {"model": "reduced", "moe_path": "turbo", "per_device_batch": 8, "seq_len": 2048,
              "model_overrides": {"moe_path": "turbo", "loss_chunk_tokens": 4096}}
    assert sb.config_tag(params) == "reduced-lct4096_turbo_b8_s2048"  # a collect from before the flag
    params["train_overrides"] = {"adam_mu_dtype": "bfloat16"}
    assert sb.config_tag(params) == "reduced-amdbfloat16-lct4096_turbo_b8_s2048"


def test_gaps_are_charged_to_the_kernel_that_ends_them():
    sb = _step_breakdown_module()
    cats = {"a": "attention", "g": "grouped_gemm", "n": "attention"}
    events = [_ev("s", 0, 10, "a"), _ev("s", 2, 3, "n"),   # nested: no gap
              _ev("s", 14, 6, "g"),                      # 4 us idle before a grouped GEMM
              _ev("s", 20, 5, "a"),                      # back to back: no gap
              _ev("s", 2525, 5, "g"),                    # 2.5 ms idle: the host between two steps
              _ev("s", 2540, 1, "a")]                    # 10 us idle before attention
    gaps = sb._gaps_before(events, lambda e: cats[e["hlo_op"]], n_steps=2)
    assert gaps == pytest.approx({"between_steps": 2.5 / 2, "attention": 0.010 / 2, "grouped_gemm": 0.004 / 2})
    assert sb._gaps_before([], lambda e: "x", n_steps=1) == {}


def test_breakdown_of_several_devices_reads_one(tmp_path):
    """Two GPUs (expert parallelism) run the same program: the table is the first device's, not their sum."""
    hlo = ("HloModule jit_train_step\n\nENTRY %main {\n"
           '  %fusion.1 = f32[8]{0} fusion(), kind=kLoop, metadata={op_name="jit(train_step)/jvp()/attention/mul"}\n'
           '  %collective-permute-start.2 = f32[8]{0} collective-permute-start(), '
           'metadata={op_name="jit(train_step)/jvp()/moe/routed_experts/shard_map/ppermute"}\n}\n')
    with gzip.open(tmp_path / "compiled_hlo.txt.gz", "wt") as fp:
        fp.write(hlo)
    events = []
    for dev in (0, 1, 10):
        for op, ts, dur in (("fusion.1", 0.0, 300.0), ("collective-permute-start.2", 300.0, 100.0 * (dev + 1))):
            events.append({"process": f"/device:GPU:{dev}", "line": "Stream #1", "name": op, "hlo_op": op,
                           "hlo_module": "jit_train_step", "label": "", "ts_us": ts, "dur_us": dur})
    tcat.write_events_csv(events, tmp_path / "device_events.csv.gz")
    (tmp_path / "meta.json").write_text(json.dumps({"traced_step_times_s": [0.001], "step_time_s_traced": 0.001,
                                                    "step_time_s_untraced": 0.001}))
    b = _step_breakdown_module().breakdown(tmp_path)
    assert (b["devices_traced"], b["device_shown"]) == (3, "/device:GPU:0")
    per = {(c, d): ms for c, _, d, ms in b["rows"]}
    assert per == {("attention", "attention"): pytest.approx(0.3), ("collective", "routed_experts"): pytest.approx(0.1)}
    assert b["busy_ms"] == pytest.approx(0.4)


def test_collective_overlap_counts_nccl_time_beside_other_kernels():
    events = [_ev("s7", 0, 10, "k1"), _ev("s7", 30, 10, "k2"),  # compute: 0..10, 30..40
              _ev("s9", 5, 10, "c1"), _ev("s9", 12, 4, "c2"), _ev("s9", 35, 20, "c3")]  # nccl: 5..16, 35..55
    for e in events:
        e["name"] = ("ncclDevKernel_SendRecv" if e["hlo_op"].startswith("c") else "cutlass_gemm")
    got = tcat.collective_overlap(events)
    assert got["collective_us"] == pytest.approx(11 + 20)
    assert got["compute_us"] == pytest.approx(20)
    assert got["collective_beside_compute_us"] == pytest.approx(5 + 5)  # 5..10 and 35..40
