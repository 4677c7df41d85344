"""Pure helpers of `step_breakdown.py` (standard library only: collect mode runs them on the GPU machine).

1. `parse_hlo`: compiled HLO text -> {instruction name: HloInstr(op_name, opcode, computation)}; a fusion or
   wrapped op without metadata takes the majority op_name of the instructions it calls.
2. `categorize`: a `metadata={op_name=...}` path -> (category, phase) from the model's jax.named_scope labels
   and JAX's transform names: `transpose(` = backward, `rematted_computation` = remat recompute inside the
   backward, `jvp(` = forward (as seen in jax 0.10/0.11 op_names).
3. `device_events`: the profiler's trace JSON (chrome/perfetto format) -> the device op events (GPU: kernels
   on the "Stream" lines of /device:GPU:N; CPU: XLA:CPU thunk events carrying args.hlo_op).
4. `exclusive_times`: time per key with nested events resolved innermost-first on each line and concurrent
   lines (several CUDA streams, XLA:CPU executor threads) sharing the overlapped time equally, so that the
   per-key times add up to the union of device busy time.
"""
from __future__ import annotations

import collections
import csv
import gzip
import io
import json
import re
from typing import Iterable, NamedTuple

# Named scopes, innermost wins. "mtp" is a group (recorded apart), not a leaf.
LEAF_SCOPES = ("permute", "unpermute", "grouped_gemm", "swiglu", "routed_experts", "shared_expert", "router",
               "attention", "dense_ffn", "embedding", "lm_head", "loss", "optimizer")
CATEGORY_OF_SCOPE = {"lm_head": "lm_head+loss", "loss": "lm_head+loss"}
CATEGORIES = ("embedding", "attention", "router", "permute", "grouped_gemm", "swiglu", "unpermute",
              "routed_experts", "shared_expert", "dense_ffn", "lm_head+loss", "mtp", "optimizer", "collective",
              "other")
PHASES = ("fwd", "bwd", "bwd_remat", "update", "none")
COLLECTIVE_OPCODES = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute",
                      "ragged-all-to-all", "send", "recv", "collective-broadcast")
COPY_OPCODES = ("copy", "copy-start", "copy-done", "bitcast", "dynamic-update-slice", "tuple",
                "get-tuple-element")

_WORD = re.compile(r"[A-Za-z_][\w\-]*")
_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(.*)$")
_COMP = re.compile(r"^(?:ENTRY\s+)?%?([\w.\-]+)\s*(?:\(.*\))?\s*(?:->.*)?\{\s*$")
_OP_NAME = re.compile(r'metadata=\{[^}]*?op_name="((?:[^"\\]|\\.)*)"')
_CALLS = re.compile(r"\b(?:calls|to_apply|body|condition|called_computations|branch_computations)="
                    r"(?:\{([^}]*)\}|%?([\w.\-]+))")
_ANNOT = re.compile(r"hlo_op=([\w.\-]+)")
_ANNOT_MODULE = re.compile(r"hlo_module=([\w.\-]+)")


class HloInstr(NamedTuple):
    op_name: str  # "" when neither the instruction nor what it calls has metadata
    opcode: str
    computation: str
    inherited: bool  # op_name taken from called computations (majority)


def _opcode(rhs: str) -> str:
    """Opcode of an instruction's right-hand side `f32[2,3]{1,0} fusion(%a), kind=...` (tuple shapes too)."""
    depth, i = 0, 0
    # skip the shape: balanced (), [], {} up to the first space at depth 0
    while i < len(rhs):
        c = rhs[i]
        if c in "([{":
            depth += 1
        elif c in ")]}":
            depth -= 1
        elif c == " " and depth == 0:
            break
        i += 1
    m = re.match(r"\s*([a-z][\w\-]*)\(", rhs[i:])
    return m.group(1) if m else ""


def parse_hlo(text: str) -> dict[str, HloInstr]:
    """{instruction name: HloInstr} of every instruction in every computation of an HLO module's text."""
    raw: dict[str, tuple[str, str, str, list[str]]] = {}
    comp_members: dict[str, list[str]] = collections.defaultdict(list)
    computation = ""
    for line in text.splitlines():
        if not line.strip() or line.startswith("HloModule"):
            continue
        if not line.startswith(" "):
            m = _COMP.match(line)
            if m:
                computation = m.group(1)
            continue
        m = _INSTR.match(line)
        if not m:
            continue
        name, rhs = m.groups()
        op = _OP_NAME.search(rhs)
        calls = []
        for braced, single in _CALLS.findall(rhs):
            calls += [c.strip().lstrip("%") for c in (braced or single).split(",") if c.strip()]
        raw[name] = (op.group(1) if op else "", _opcode(rhs), computation, calls)
        comp_members[computation].append(name)

    memo: dict[str, str] = {}

    def majority_of(comps: list[str], seen: set[str]) -> str:
        votes: collections.Counter = collections.Counter()
        for comp in comps:
            if comp in seen:
                continue
            seen.add(comp)
            for member in comp_members.get(comp, ()):
                op_name, _, _, calls = raw[member]
                if op_name:
                    votes[op_name] += 1
                elif calls:
                    inner = majority_of(calls, seen)
                    if inner:
                        votes[inner] += 1
        if not votes:
            return ""
        # the most frequent op_name; ties go to the longest (most specific) one
        return max(votes.items(), key=lambda kv: (kv[1], len(kv[0])))[0]

    out = {}
    for name, (op_name, opcode, comp, calls) in raw.items():
        inherited = False
        if not op_name and calls:
            key = ",".join(calls)
            if key not in memo:
                memo[key] = majority_of(calls, set())
            op_name, inherited = memo[key], bool(memo[key])
        out[name] = HloInstr(op_name, opcode, comp, inherited)
    return out


def categorize(op_name: str, opcode: str = "") -> tuple[str, str, str]:
    """op_name path -> (category, phase, detail). detail: the innermost scope under "mtp" ("mtp/attention"),
    for "other" why ("copy", "unlabelled"). Collectives (several devices: the expert-parallel exchange, FSDP's
    gathers, gradient reductions) are the category "collective" wherever they sit, with the scope they serve as
    detail ("routed_experts", "mtp/attention", "optimizer", "unscoped")."""
    words = _WORD.findall(op_name)
    in_mtp = "mtp" in words
    leaf = ""
    for w in words:  # innermost (last) known scope wins
        if w in LEAF_SCOPES:
            leaf = w
    if leaf == "optimizer" or (not leaf and "optimizer" in words):
        phase = "update"
    elif "transpose(" in op_name:
        phase = "bwd_remat" if "rematted_computation" in words else "bwd"
    elif "jvp(" in op_name:
        phase = "fwd"
    else:
        phase = "none"
    base = opcode.split("-start")[0].split("-done")[0]
    if opcode in COLLECTIVE_OPCODES or base in COLLECTIVE_OPCODES:
        scope = CATEGORY_OF_SCOPE.get(leaf, leaf) or "unscoped"
        return "collective", phase, ("mtp/" + scope) if in_mtp else scope
    if in_mtp:
        return "mtp", phase, "mtp/" + (CATEGORY_OF_SCOPE.get(leaf, leaf) or "unscoped")
    if leaf:
        category = CATEGORY_OF_SCOPE.get(leaf, leaf)
        return category, phase, category
    if opcode in COPY_OPCODES:
        return "other", phase, "copy"
    return "other", phase, "unlabelled"


# ------------------------------------------------------------------------------------------- trace events
DERIVED_LINES = ("XLA Modules", "XLA Ops", "XLA TraceMe", "Steps", "TensorFlow Ops", "Framework Ops",
                 "Framework Name Scope", "TensorFlow Name Scope", "Source code", "Launch Stats")
EVENT_FIELDS = ("process", "line", "name", "hlo_op", "hlo_module", "label", "ts_us", "dur_us")


def load_trace_json(path) -> dict:
    opener = gzip.open if str(path).endswith(".gz") else open
    with opener(path, "rt") as fp:
        return json.load(fp)


def _find(args: dict, pattern: re.Pattern) -> str:
    for value in args.values():
        if isinstance(value, str):
            m = pattern.search(value)
            if m:
                return m.group(1)
    return ""


def device_events(trace: dict) -> list[dict]:
    """Device op events of a chrome-trace dict as flat dicts (EVENT_FIELDS).

    GPU (or TPU): processes named "/device:..."; "Stream ..." lines when there are any, else every line but
    the derived ones (XLA Ops etc. repeat the kernels). CPU (no device process): events with args.hlo_op
    (XLA:CPU thunks on the executor threads)."""
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    pname, tname = {}, {}
    for e in events:
        if e.get("ph") == "M" and e.get("name") == "process_name":
            pname[e.get("pid")] = str(e.get("args", {}).get("name", ""))
        elif e.get("ph") == "M" and e.get("name") == "thread_name":
            tname[(e.get("pid"), e.get("tid"))] = str(e.get("args", {}).get("name", ""))
    device_pids = {pid for pid, n in pname.items() if n.startswith("/device:") and "CPU" not in n}
    complete = [e for e in events if e.get("ph") == "X" and "dur" in e]
    if device_pids:
        on_device = [e for e in complete if e.get("pid") in device_pids
                     and not tname.get((e.get("pid"), e.get("tid")), "").startswith(DERIVED_LINES)]
        streams = [e for e in on_device if tname.get((e.get("pid"), e.get("tid")), "").startswith("Stream")]
        chosen = streams or on_device
    else:
        chosen = [e for e in complete if "hlo_op" in (e.get("args") or {})]
    out = []
    for e in chosen:
        args = e.get("args") or {}
        hlo_op = str(args.get("hlo_op", "")) or _find(args, _ANNOT)
        module = str(args.get("hlo_module", "")) or _find(args, _ANNOT_MODULE)
        label = str(args.get("long_name") or args.get("tf_op") or args.get("name") or "")
        out.append({"process": pname.get(e.get("pid"), str(e.get("pid"))),
                    "line": tname.get((e.get("pid"), e.get("tid")), str(e.get("tid"))),
                    "name": str(e.get("name", "")), "hlo_op": hlo_op, "hlo_module": module, "label": label,
                    "ts_us": float(e["ts"]), "dur_us": float(e["dur"])})
    return out


def resolve_instruction(event: dict, hlo: dict) -> str:
    """The HLO instruction an event ran: args.hlo_op, else the kernel name if it is one (XLA names a fusion's
    kernel after it, "." -> "_"); "?<kernel name>" when none matches."""
    for candidate in (event["hlo_op"], event["name"], re.sub(r"_(\d+)$", r".\1", event["name"])):
        if candidate and candidate in hlo:
            return candidate
    return event["hlo_op"] or "?" + event["name"]


def write_events_csv(events: Iterable[dict], path) -> None:
    with gzip.open(path, "wt", newline="") as fp:
        writer = csv.DictWriter(fp, fieldnames=EVENT_FIELDS)
        writer.writeheader()
        for e in events:
            writer.writerow({k: e[k] for k in EVENT_FIELDS})


def read_events_csv(path) -> list[dict]:
    opener = gzip.open if str(path).endswith(".gz") else open
    with opener(path, "rt", newline="") as fp:
        rows = list(csv.DictReader(io.StringIO(fp.read())))
    for r in rows:
        r["ts_us"], r["dur_us"] = float(r["ts_us"]), float(r["dur_us"])
    return rows


def main_module(events: list[dict], hint: str = "train_step") -> str:
    """The HLO module most device time went to whose name contains `hint` ("" if none carries a module)."""
    busy = collections.Counter()
    for e in events:
        if e["hlo_module"]:
            busy[e["hlo_module"]] += e["dur_us"]
    named = [m for m, _ in busy.most_common() if hint in m]
    return named[0] if named else (busy.most_common(1)[0][0] if busy else "")


def exclusive_times(events: list[dict], key=lambda e: e["hlo_op"] or "?" + e["name"]) -> tuple[dict, float]:
    """({key: exclusive µs}, union µs). On one line, a nested event's time goes to the innermost event;
    time where several lines are busy is split equally among them. Sum of the values == union."""
    by_line = collections.defaultdict(list)
    for e in events:
        if e["dur_us"] > 0:
            by_line[(e["process"], e["line"])].append((e["ts_us"], e["ts_us"] + e["dur_us"], key(e)))
    segments = []  # (start, end, key) with no overlap within a line
    for items in by_line.values():
        items.sort(key=lambda t: (t[0], -t[1]))
        stack: list[tuple[float, float, str]] = []
        cursor = None
        for start, end, k in items:
            while stack and stack[-1][1] <= start:  # close finished events, emitting their tails
                s_end, s_key = stack[-1][1], stack[-1][2]
                if cursor < s_end:
                    segments.append((cursor, s_end, s_key))
                    cursor = s_end
                stack.pop()
            if stack:
                if cursor < start:
                    segments.append((cursor, start, stack[-1][2]))
            cursor = start
            stack.append((start, min(end, stack[-1][1]) if stack else end, k))
        while stack:
            s_end, s_key = stack[-1][1], stack[-1][2]
            if cursor < s_end:
                segments.append((cursor, s_end, s_key))
                cursor = s_end
            stack.pop()
    marks = []
    for start, end, k in segments:
        marks.append((start, 1, k))
        marks.append((end, -1, k))
    marks.sort(key=lambda t: (t[0], t[1]))
    active: collections.Counter = collections.Counter()
    n_active, prev, union = 0, None, 0.0
    times: collections.Counter = collections.Counter()
    for t, delta, k in marks:
        if n_active and prev is not None and t > prev:
            dt = t - prev
            union += dt
            for kk, count in active.items():
                times[kk] += dt * count / n_active
        prev = t
        active[k] += delta
        n_active += delta
        if active[k] == 0:
            del active[k]
    return dict(times), union


def _merged(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    out: list[list[float]] = []
    for start, end in sorted(intervals):
        if out and start <= out[-1][1]:
            out[-1][1] = max(out[-1][1], end)
        else:
            out.append([start, end])
    return [(s, e) for s, e in out]


def collective_overlap(events: list[dict]) -> dict:
    """µs of NCCL kernels (their union), of other kernels, and of the NCCL time during which another kernel ran
    (on another stream): how much of the exchange the schedule actually hid. One device's events."""
    nccl = _merged([(e["ts_us"], e["ts_us"] + e["dur_us"]) for e in events if "nccl" in e["name"].lower()])
    other = _merged([(e["ts_us"], e["ts_us"] + e["dur_us"]) for e in events if "nccl" not in e["name"].lower()])
    both, j = 0.0, 0
    for start, end in nccl:
        while j < len(other) and other[j][1] <= start:
            j += 1
        k = j
        while k < len(other) and other[k][0] < end:
            both += min(end, other[k][1]) - max(start, other[k][0])
            k += 1
    return {"collective_us": sum(e - s for s, e in nccl), "compute_us": sum(e - s for s, e in other),
            "collective_beside_compute_us": both}
