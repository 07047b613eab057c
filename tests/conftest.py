import pytest
import torch
from hypothesis import settings

settings.register_profile("refppo", max_examples=60, deadline=None)
settings.load_profile("refppo")


@pytest.fixture(scope="session")
def tok():
    """The offline tasks' character tokenizer."""
    from refppo.tasks.tokenizer import build_tokenizer

    return build_tokenizer()


@pytest.fixture(scope="module")
def models(tok):
    """A tiny actor, critic and reward model (seed 0)."""
    from refppo.rollout.models import load_causal_lm, load_value_model, tiny_config

    torch.manual_seed(0)
    config = tiny_config(tok)
    return load_causal_lm(config), load_value_model(config), load_value_model(config)


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def compiled_kernel_calls(monkeypatch):
    """Every call of refppo.accel.logprobs's compiled block kernels from here on, in order, as
    "forward" or "backward" (the real compiled kernels still run)."""
    import refppo.accel.logprobs as F

    calls = []
    forward, backward = F._compiled_kernels()

    def spy(name, fn):
        def call(*args):
            calls.append(name)
            return fn(*args)

        return call

    monkeypatch.setattr(F, "_compiled_kernels", lambda: (spy("forward", forward), spy("backward", backward)))
    return calls
