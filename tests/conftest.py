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
