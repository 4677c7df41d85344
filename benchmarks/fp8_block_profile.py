"""Where the expert block's time goes, FP8 against bf16: device time per piece of `ops.expert_block` fwd+bwd, from a
jax.profiler trace, side by side in one process on one GPU (not a test). Command buffers are off
(--xla_gpu_enable_command_buffer=) so that each kernel keeps its HLO instruction: the total may differ a little from
benchmarks/fp8_expert_path.py's time of the same block.

For each case of benchmarks/fp8_expert_path.py (--cases) and each variant (--variants: "turbo", the bf16 block with
its fused SwiGLU kernels; "fp8_prepared", the FP8 block on `ops.fp8_weights` made beforehand; "fp8", the FP8 block
quantising its weights), it compiles the block's forward + backward, runs --warmup calls, traces --calls calls, and
sums each device kernel's time per call. A kernel is named by what it is:
  ffi:<kernel>          our FFI kernels (the CUDA function name, template arguments dropped): the grouped GEMMs (bf16
                        `grouped_gemm_sm90*`, FP8 `*Fp8*` / CUTLASS's blockwise FP8), permute, quantisers, SwiGLU;
  xla:<scope>:<kind>    XLA's fusions and copies, by the named scope of the block they serve (permute, grouped_gemm,
                        swiglu, unpermute) and the fusion's kind (loop / input = a reduction / ...);
  gemm:cublas           cuBLAS / cuBLASLt kernels (none expected).
Writes <out>/fp8_block_profile_<device>.csv (case, variant, piece, ms_per_call, share) and .json (+ provenance),
rewritten after each variant; prints each variant's pieces, largest first.

    PYTHONPATH=$PWD XLA_PYTHON_CLIENT_PREALLOCATE=false python benchmarks/fp8_block_profile.py --out DIR
"""
from __future__ import annotations

import argparse
import collections
import os
import re
import sys
import tempfile
from pathlib import Path

import jax
import jax.numpy as jnp

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _trace_categories as tcat  # noqa: E402
from _records import write_table_and_record  # noqa: E402
from fp8_expert_path import CASES, balanced_ids, block_fwd_bwd, block_prepared_fwd_bwd, block_weights  # noqa: E402

from turbo_moe.ops.fp8_scaling import fp8_weights  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
SCOPES = ("permute", "grouped_gemm", "swiglu", "unpermute")
VARIANTS = ("turbo", "fp8_prepared", "fp8")
NO_COMMAND_BUFFERS = "--xla_gpu_enable_command_buffer="


def _demangled_function(name: str) -> str:
    """The function's own name in an Itanium-mangled kernel name: the last <length><identifier> of the nested name
    (`_ZN9turbo_moe12_GLOBAL__N_120quantize_rows_kernelI...` -> quantize_rows_kernel)."""
    i, last = (3 if name.startswith("_ZN") else 2), name
    while i < len(name) and name[i].isdigit():
        j = i
        while j < len(name) and name[j].isdigit():
            j += 1
        n = int(name[i:j])
        last, i = name[j:j + n], j + n
    return last


def piece(event: dict, hlo: dict) -> str:
    """What a device event is: our FFI kernel by name, or XLA's work by the block scope it serves."""
    name = event["name"]
    instr = hlo.get(tcat.resolve_instruction(event, hlo))
    opcode = instr.opcode if instr else ""
    if opcode == "custom-call" or not instr:
        if re.search(r"cublas|gemm_kernel|sm\d\d_xmma", name, re.I) and "turbo" not in name:
            return "gemm:cublas"
        plain = name.replace("(anonymous namespace)::", "")  # demangled names: its parenthesis is not the arguments'
        short = re.sub(r"<.*", "", plain.split("(")[0]).split("::")[-1].split(" ")[-1]
        if name.startswith("_Z") or short in ("device_kernel", "Kernel", "Kernel2", "kernel"):  # mangled / CUTLASS
            short = ("cutlass_" + ("fp8" if re.search(r"e4m3|e5m2|fp8", name, re.I) else "bf16")
                     if "cutlass" in name else _demangled_function(name))
        call = re.sub(r"[._]\d+$", "", event["hlo_op"] or tcat.resolve_instruction(event, hlo))
        return f"ffi:{call}:{short}"
    words = tcat._WORD.findall(instr.op_name)
    scope = next((w for w in reversed(words) if w in SCOPES), "other")
    phase = "bwd" if "transpose(" in instr.op_name else "fwd"
    kind = re.sub(r"[._]\d+$", "", name).split("_fusion")[0] if opcode == "fusion" else opcode
    return f"xla:{phase}:{scope}:{kind}"


def profile(fn, args, warmup: int, calls: int) -> dict[str, float]:
    """{piece: device ms per call} of the jitted fn(*args)."""
    jitted = jax.jit(fn)
    compiled = jitted.lower(*args).compile()
    hlo = tcat.parse_hlo(compiled.as_text())
    for _ in range(warmup):
        jax.block_until_ready(compiled(*args))
    with tempfile.TemporaryDirectory() as tmp:
        jax.profiler.start_trace(tmp, create_perfetto_trace=True)
        for _ in range(calls):
            jax.block_until_ready(compiled(*args))
        jax.profiler.stop_trace()
        traces = sorted(Path(tmp).rglob("perfetto_trace.json.gz")) or sorted(Path(tmp).rglob("*.trace.json.gz"))
        events = tcat.device_events(tcat.load_trace_json(traces[0]))
    totals: dict[str, float] = collections.defaultdict(float)
    for e in events:
        totals[piece(e, hlo)] += e["dur_us"] / 1e3 / calls
    return dict(totals)


def block_inputs(case, prepared: bool):
    """fp8_expert_path's block inputs for `case` (the same keys), the weights as `fp8_weights` when prepared."""
    keys = jax.random.split(jax.random.PRNGKey(case.M + case.G), 6)
    x = jax.random.normal(keys[0], (case.T, case.K), jnp.bfloat16)
    w_gate_up, w_down, combine_w, dy = block_weights(case, keys)
    if prepared:
        w_gate_up, w_down = jax.jit(fp8_weights)(w_gate_up), jax.jit(fp8_weights)(w_down)
    return x, jnp.asarray(balanced_ids(case)), combine_w, w_gate_up, w_down, dy


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=REPO / "experiments" / "results")
    ap.add_argument("--cases", default="dsv3_G32,qwen3_G64", help="comma-separated: " +
                    ", ".join(c.name for c in CASES))
    ap.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated: " + ", ".join(VARIANTS))
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--calls", type=int, default=5)
    args = ap.parse_args()
    # Kernels run one thunk each, so every kernel keeps its HLO instruction (inside a CUDA graph they all read
    # "command_buffer"): set before the backend starts. The profile's device times are those of this program.
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + NO_COMMAND_BUFFERS).strip()
    if jax.devices()[0].platform != "gpu":
        raise SystemExit("benchmarks/fp8_block_profile.py needs a GPU (JAX_PLATFORMS=cuda)")
    cases = {c.name: c for c in CASES}
    wanted, variants = args.cases.split(","), args.variants.split(",")
    bad = sorted(set(wanted) - set(cases)) + sorted(set(variants) - set(VARIANTS))
    if bad:
        raise SystemExit(f"unknown --cases/--variants {bad}; cases {list(cases)}, variants {list(VARIANTS)}")
    args.out.mkdir(parents=True, exist_ok=True)
    table = args.out / f"fp8_block_profile_{jax.devices()[0].device_kind.replace(' ', '_')}.csv"
    rows: list[dict] = []
    for name in wanted:
        case = cases[name]
        for variant in variants:
            prepared = variant == "fp8_prepared"
            fn = block_prepared_fwd_bwd("fp8") if prepared else block_fwd_bwd("turbo" if variant == "turbo" else "fp8")
            base = dict(case=name, variant=variant, T=case.T, k=case.k, D=case.K, F=case.F, G=case.G)
            try:
                totals = profile(fn, block_inputs(case, prepared), args.warmup, args.calls)
            except Exception as e:  # recorded, never fatal
                rows.append(base | dict(status=f"failed: {type(e).__name__}: {str(e).splitlines()[0][:200]}"))
                continue
            busy = sum(totals.values())
            print(f"[{name} {variant}] device busy {busy:.3f} ms a call", flush=True)
            for p, ms in sorted(totals.items(), key=lambda kv: -kv[1]):
                rows.append(base | dict(piece=p, ms_per_call=round(ms, 4), share=round(ms / busy, 4), status="ok"))
                if ms >= 0.01 * busy:
                    print(f"    {ms:8.3f} ms {100 * ms / busy:5.1f}%  {p}", flush=True)
            write_table_and_record(rows, table, f"warmup={args.warmup} calls={args.calls}; device time per call "
                                                f"from jax.profiler; XLA_FLAGS {NO_COMMAND_BUFFERS}; balanced routing, "
                                                "shuffled; inputs bf16")
    print(f"wrote {table} and {table.with_suffix('.json')}")


if __name__ == "__main__":
    main()
