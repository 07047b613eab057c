import pytest

from refppo.data import EpochSampler


def test_epoch_sampler_epochs_and_state():
    sampler = EpochSampler([{"i": i} for i in range(10)], 4, seed=0)
    seen = [r["i"] for _ in range(5) for r in sampler.next_batch()]
    assert sorted(seen[:10]) == list(range(10)) and sorted(seen[10:20]) == list(range(10))
    state = sampler.state_dict()
    after = sampler.next_batch()
    sampler.load_state_dict(state)
    assert sampler.next_batch() == after
    with pytest.raises(ValueError, match="the dataset is empty"):
        EpochSampler([], 4, 0)
