"""RunResult: what a training run returns — status, per-step history, summary, routing, provenance."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from typing import Any

from turbo_moe.status import RUN_STATUSES as STATUSES  # the one status list


@dataclasses.dataclass
class RunResult:
    """status: "ok" | "oom" | "nan" | "error"; `error` explains anything but "ok".

    history: one dict per logged step (step, loss, ce_loss, eval_loss (NaN when not evaluated),
    step_time_s, tgs, dropped_fraction, load_max_over_mean, lr, grad_norm, ...).
    summary: run-level figures — tgs (tokens/device/s over the steps after `metrics.TGS_SKIP_STEPS`,
    total tokens / total time), tgs_steps, step_time_s, mfu with peak_flops and peak_flops_source,
    flops_per_token, peak_memory_bytes with memory_source, compiled_temp_bytes / compiled_total_bytes /
    compiled_memory (XLA's analysis of the step, per device), device_memory_limit_bytes (+ source),
    final_loss (cross-entropy + MTP and balance terms), final_ce_loss (the train cross-entropy, comparable with
    final_eval_loss), final_eval_loss, dropped_fraction_mean, load_max_over_mean_mean, params_total,
    params_active, steps_done, resumed_from_step, compile_time_s, n_devices, process_count (processes of a
    jax.distributed run; every one returns the same figures but its own step times), per_device_batch,
    seq_len, moe_path, and oom_requested_bytes for status "oom".
    expert_load: (L_moe, E) token copies per expert at the last step, as nested lists.
    """

    status: str = "ok"
    error: str | None = None
    history: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    summary: dict[str, Any] = dataclasses.field(default_factory=dict)
    expert_load: list[list[float]] = dataclasses.field(default_factory=list)
    provenance: dict[str, Any] = dataclasses.field(default_factory=dict)

    def __post_init__(self):
        if self.status not in STATUSES:
            raise ValueError(f"RunResult.status must be one of {STATUSES}, got {self.status!r}")

    @property
    def ok(self) -> bool:
        return self.status == "ok"

    def losses(self) -> list[float]:
        return [row["loss"] for row in self.history]

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def save(self, path: str | Path) -> Path:
        """Write JSON (NaN/Infinity as Python's json writes them, so `load` round-trips them), whole or not at all:
        written beside `path`, then renamed over it."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.tmp")
        tmp.write_text(json.dumps(self.to_dict(), indent=1, default=str))
        tmp.replace(path)
        return path

    @classmethod
    def load(cls, path: str | Path) -> "RunResult":
        data = json.loads(Path(path).read_text())  # json reads NaN/Infinity back
        known = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in known})

    def history_frame(self):
        """The history as a pandas DataFrame indexed by step."""
        import pandas as pd

        frame = pd.DataFrame(self.history)
        return frame.set_index("step") if "step" in frame else frame

    def __repr__(self) -> str:
        s = self.summary
        def fmt(key, spec):
            value = s.get(key)
            return format(value, spec) if isinstance(value, (int, float)) and not math.isnan(value) else "n/a"
        return (f"RunResult(status={self.status!r}, steps={s.get('steps_done')}, "
                f"train_ce={fmt('final_ce_loss', '.4f')}, eval_ce={fmt('final_eval_loss', '.4f')}, "
                f"total_loss={fmt('final_loss', '.4f')}, "
                f"tgs={fmt('tgs', '.1f')}, mfu={fmt('mfu', '.3%')}, error={self.error!r})")
