"""Experiments: papermill sweeps over the notebooks, results tables and the report figures.

Modules: ``spec`` (sweep YAML, grid expansion, point names), ``runner`` (papermill execution, resume,
failure isolation), ``results`` (atomic results tables and records), ``report`` / ``figures`` (the report),
``notebook`` (thin helpers the notebooks call), ``accounting`` (full-size parameter/FLOP/memory budgets).
"""

from turbo_moe._extras import require

require("turbo_moe.experiments")  # a clear ImportError naming the extra
