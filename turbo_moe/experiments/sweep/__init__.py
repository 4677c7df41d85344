"""Sweeps: specs, the runner, parameter checks, the writer lock, progress output, the Jupyter-kernel check."""
