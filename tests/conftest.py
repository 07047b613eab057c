import pytest
import torch
from hypothesis import settings

settings.register_profile("refppo", max_examples=60, deadline=None)
settings.load_profile("refppo")


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def compiled_kernel_calls(monkeypatch):
    """Every call of refppo.functional's compiled block kernels from here on, in order, as
    "forward" or "backward" (the real compiled kernels still run)."""
    import refppo.functional as F

    calls = []
    forward, backward = F._compiled_kernels()

    def spy(name, fn):
        def call(*args):
            calls.append(name)
            return fn(*args)

        return call

    monkeypatch.setattr(F, "_compiled_kernels", lambda: (spy("forward", forward), spy("backward", backward)))
    return calls
