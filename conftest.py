"""``pytest`` runs one pytest-xdist worker per core (``-n auto`` in pyproject.toml): each worker,
and each notebook kernel it starts, computes with one torch thread, so that the workers do not
compete for the cores (tiny models gain nothing from a second thread)."""

import os

if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ["OMP_NUM_THREADS"] = "1"  # read by the notebook kernels the worker starts
    import torch

    torch.set_num_threads(1)
