"""A run's curves as a TensorBoard event log (tensorboardX: the event format without TensorFlow).

    log = TensorBoardLog(folder, purge_step=resumed_from)   # events.out.tfevents.* in `folder`
    run(config, on_log=log.row)                               # one call per history row, as it is logged
    log.close()

`tensorboard --logdir runs` then lists every run folder under runs/ by name. A resumed run passes the step it
continues from as `purge_step`: TensorBoard drops the earlier invocation's events from that step on (the steps a
crash logged after the checkpoint it resumes from), so each step is drawn once.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Mapping

from tensorboardX import SummaryWriter

# history key -> TensorBoard tag. Train and eval cross-entropy side by side (comparable); the total loss adds the MTP
# and balance terms and is named as such.
TAGS = {
    "ce_loss": "loss/train_ce", "eval_loss": "loss/eval_ce", "loss": "loss/total_incl_mtp_and_balance",
    "mtp_loss": "loss/mtp", "balance_loss": "loss/balance",
    "lr": "optimizer/learning_rate", "grad_norm": "optimizer/grad_norm",
    "tgs": "throughput/tokens_per_device_per_s", "step_time_s": "throughput/step_time_s",
    "dropped_fraction": "routing/dropped_fraction", "load_max_over_mean": "routing/load_max_over_mean",
}


class TensorBoardLog:
    """The event file is created with the first row: a run refused or failed before its first step leaves none."""

    def __init__(self, folder: str | Path, *, purge_step: int | None = None):
        self.folder, self.purge_step = str(folder), purge_step
        self.writer: SummaryWriter | None = None

    def row(self, row: Mapping[str, Any]) -> None:
        if self.writer is None:
            self.writer = SummaryWriter(logdir=self.folder, purge_step=self.purge_step, flush_secs=10)
        step = int(row["step"])
        for key, tag in TAGS.items():
            value = row.get(key)
            if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
                self.writer.add_scalar(tag, value, global_step=step)

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
