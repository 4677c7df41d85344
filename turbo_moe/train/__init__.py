"""Training for turbo-moe: `run(TrainConfig(...)) -> RunResult` with honest throughput/memory metrics.

    from turbo_moe.train import TrainConfig, run
    result = run(TrainConfig(model="tiny", dataset="shakespeare", steps=50))
    result.summary["tgs"], result.history_frame()
"""

from turbo_moe._extras import require

require("turbo_moe.train")  # a clear ImportError naming the extra

from turbo_moe.train.checkpoint import Checkpointer
from turbo_moe.train.config import CheckpointConfig, DataConfig, OptimizerConfig, ParallelConfig, TrainConfig
from turbo_moe.train.loop import OutOfMemory, run
from turbo_moe.train.metrics import PEAK_BF16_FLOPS, peak_flops
from turbo_moe.train.result import STATUSES, RunResult
from turbo_moe.train.step import (
    Program,
    TrainState,
    build_program,
    init_state,
    learning_rate_schedule,
    make_eval_step,
    make_mesh,
    make_optimizer,
    make_train_step,
    master_params,
    with_head_bias,
)

__all__ = [
    "CheckpointConfig", "Checkpointer", "DataConfig", "OptimizerConfig", "OutOfMemory", "PEAK_BF16_FLOPS",
    "ParallelConfig", "Program", "RunResult", "STATUSES", "TrainConfig",
    "TrainState", "build_program", "init_state", "learning_rate_schedule", "make_eval_step", "make_mesh",
    "make_optimizer", "make_train_step", "master_params", "peak_flops", "run", "with_head_bias",
]
