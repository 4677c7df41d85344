"""The logic of the notebooks in ``notebooks/``: one module per notebook, named by its stem, and ``display``."""
