"""Experiments: sweeps over the notebooks, the results store and the report, one sub-package each.

- ``sweep``: sweep specs (YAML, grid, point names), the runner (papermill, resume, failure isolation), the
  notebook parameters' checks, the one-writer lock, the sweep's printed progress, the Jupyter-kernel check;
- ``store``: the results tables sweeps append, the Parquet results store, the migration of result files into it;
- ``report``: the report's data, figures and convergence analysis, and the check that a migration kept them;
- ``notebooks``: the logic of each notebook in ``notebooks/``, one module per notebook named by its stem
  (``ops`` for ``01_ops``, ``train`` for ``02_train``, ``full_deepseek`` and its ``full_deepseek_slice`` for
  ``03_full_deepseek``; ``04_report`` calls ``report.report``), and ``display``, the tables for people;
- ``accounting``: full-size parameter, FLOP and memory budgets per MoE path and mesh (beside
  ``turbo_moe.model.accounting``, which counts from the model config alone: this one also needs the training
  config's optimizer states and offload, and the model must not import ``turbo_moe.train``).

Sub-packages import each other's modules, never a package ``__init__`` (they hold no code).
"""

from turbo_moe._extras import require

require("turbo_moe.experiments")  # a clear ImportError naming the extra
