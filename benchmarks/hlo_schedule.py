"""What runs between each async collective's start and done in a scheduled HLO module (XLA's after-optimizations dump).

    python benchmarks/hlo_schedule.py DUMP_FILE [--all] [--out SUMMARY.txt]

A GPU collective overlaps compute only where the scheduler put kernels between its `-start` and its `-done` (the
collective runs on its own stream meanwhile); one with nothing between them was turned synchronous (`"is_sync":true`)
and runs alone. For each async collective of each computation (the layer scans' while bodies among them) this prints
the kernels scheduled inside its window: custom calls by target (turbo_moe's FFI kernels, cuBLAS), fusions, command
buffers, each labelled with the micro-batch phase it belongs to where the program named one
(`ep_micro_batch<i>/ep_dispatch|ep_experts|ep_combine`, `bwd` for the backward pass). The summary counts the MoE
exchange's collectives (scope `routed_experts`) and the others (FSDP gathers, gradient reductions) with and without
compute inside. Only the schedule is read, never timed: docs/notes/expert-parallel-lab.md reads it next to the step
times of the same programs.
"""
from __future__ import annotations

import argparse
import collections
import re
import sys

COMPUTATION = re.compile(r"^(?:ENTRY )?%?([\w.\-]+) .*\{\s*$")
INSTRUCTION = re.compile(r"^\s*(?:ROOT )?%?([\w.\-]+) = (.*?) ([a-z][a-z0-9\-]*)\((.*)$")
COLLECTIVES = ("all-gather", "all-reduce", "reduce-scatter", "all-to-all", "collective-permute", "ragged-all-to-all",
               "collective-broadcast")
PHASE = re.compile(r"ep_micro_batch(\d+)/(ep_dispatch|ep_experts|ep_combine)")


def parse(text: str) -> dict[str, list[dict]]:
    """computation name -> its instructions in schedule order: name, opcode, operands text, metadata op_name."""
    computations, current = {}, None
    for line in text.splitlines():
        if current is None:
            m = COMPUTATION.match(line)
            if m:
                current = computations.setdefault(m.group(1), [])
            continue
        if line.strip() == "}":
            current = None
            continue
        m = INSTRUCTION.match(line)
        if m:
            name, _, opcode, rest = m.groups()
            op_name = re.search(r'op_name="([^"]*)"', rest)
            current.append({"name": name, "opcode": opcode, "rest": rest,
                            "op_name": op_name.group(1) if op_name else ""})
    return computations


def collective_kind(ins: dict, computations: dict) -> str | None:
    """The collective an async start begins, else None. XLA writes `<kind>-start`, or `async-start` calling a
    computation (often named async_computation.N) that holds the collective."""
    op = ins["opcode"]
    if op.endswith("-start") and op[: -len("-start")] in COLLECTIVES:
        return op[: -len("-start")]
    if op == "async-start":
        called = re.search(r"calls=%?([\w.\-]+)", ins["rest"])
        inner = computations.get(called.group(1), []) if called else []
        for i in inner:
            if i["opcode"] in COLLECTIVES:
                return i["opcode"]
    return None


def label(op_name: str) -> str:
    m = PHASE.search(op_name)
    where = f"mb{m.group(1)}/{m.group(2)[3:]}" if m else ("moe" if "routed_experts" in op_name else "-")
    return ("bwd " if "transpose(" in op_name else "") + where


def work(ins: dict, computations: dict) -> list[tuple[str, str]]:
    """(kernel, label) of each kernel an instruction launches (a command buffer's: those of its computation)."""
    op, where = ins["opcode"], label(ins["op_name"])
    if op == "custom-call":
        target = re.search(r'custom_call_target="([^"]+)"', ins["rest"])
        return [(target.group(1) if target else "custom-call", where)]
    if op == "fusion":
        kind = re.search(r"kind=(k\w+)", ins["rest"])
        return [(f"fusion:{kind.group(1) if kind else '?'}", where)]
    if op == "call":
        called = re.search(r"to_apply=%?([\w.\-]+)", ins["rest"])
        inner = computations.get(called.group(1), []) if called else []
        return [w for i in inner for w in work(i, computations)]
    if op in ("convolution", "dot", "sort", "scatter", "gather", "copy", "transpose", "reduce"):
        return [(op, where)]
    return []


def windows(computations: dict) -> list[dict]:
    """One entry per collective: computation, kind, scope label, sync flag, the kernels inside its window. A collective
    inside a computation that an async-start calls is counted at that async-start, not on its own."""
    wrapped = {m.group(1) for instructions in computations.values() for ins in instructions
               if ins["opcode"] == "async-start" for m in [re.search(r"calls=%?([\w.\-]+)", ins["rest"])] if m}
    found = []
    for comp, instructions in computations.items():
        if comp in wrapped:
            continue
        open_ = {}
        for ins in instructions:
            if ins["opcode"] in COLLECTIVES:  # no start/done: synchronous, nothing can run beside it
                found.append({"computation": comp, "kind": ins["opcode"], "start": ins["name"],
                              "op_name": ins["op_name"], "label": label(ins["op_name"]), "sync": True, "inside": []})
                continue
            kind = collective_kind(ins, computations)
            if kind:
                open_[ins["name"]] = {"computation": comp, "kind": kind, "start": ins["name"],
                                      "op_name": ins["op_name"], "label": label(ins["op_name"]),
                                      "sync": '"is_sync":true' in ins["rest"], "inside": []}
                continue
            if ins["opcode"].endswith("-done"):
                operand = re.search(r"%([\w.\-]+)", ins["rest"]) or re.match(r"\s*([\w.\-]+)", ins["rest"])
                entry = open_.pop(operand.group(1), None) if operand else None
                if entry:
                    found.append(entry)
                continue
            kernels = work(ins, computations)
            for entry in open_.values():
                entry["inside"].extend(kernels)
    return found


def summarize(entries: list[dict], show_all: bool) -> str:
    lines = []
    for group, members in (("MoE exchange", [e for e in entries if "routed_experts" in e["op_name"]]),
                           ("other collectives", [e for e in entries if "routed_experts" not in e["op_name"]])):
        overlapped = [e for e in members if e["inside"]]
        lines.append(f"{group}: {len(members)} collectives, {len(overlapped)} with kernels inside their window, "
                     f"{sum(e['sync'] for e in members)} synchronous")
        for e in members if show_all or group == "MoE exchange" else []:
            counts = collections.Counter(f"{k} [{lab}]" for k, lab in e["inside"])
            inside = ", ".join(f"{n}x {k}" for k, n in counts.most_common(8)) or "nothing"
            lines.append(f"  {e['computation'][:40]:40s} {e['kind']:18s} {e['label']:22s} "
                         f"{'sync ' if e['sync'] else ''}inside: {inside}")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("dump", help="an after-optimizations HLO text file (--xla_dump_to with --xla_dump_hlo_as_text)")
    ap.add_argument("--all", action="store_true", help="list the other collectives too, not only the exchange's")
    ap.add_argument("--out", help="also write the summary here")
    args = ap.parse_args()
    with open(args.dump) as f:
        text = f.read()
    if "is_scheduled=true" not in text.split("\n", 1)[0]:
        print(f"{args.dump}: not a scheduled module (take the after-optimizations dump)", file=sys.stderr)
    summary = f"{args.dump}\n" + summarize(windows(parse(text)), args.all)
    if args.out:
        with open(args.out, "a") as f:
            f.write(summary + "\n\n")
    print(summary)


if __name__ == "__main__":
    main()
