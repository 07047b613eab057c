import math

import pytest
import torch
from _inputs import batches, make_mask
from hypothesis import given
from hypothesis import strategies as st

from refppo.advantages import (
    compute_gae_advantage_return,
    compute_grpo_outcome_advantage,
    compute_rloo_outcome_advantage,
    get_adv_estimator_fn,
)


def ref_gae(rewards, values, mask, gamma, lam):
    """verl's reverse loop, one row and one token at a time, in float64 Python floats."""
    batch, length = len(rewards), len(rewards[0])
    adv = [[0.0] * length for _ in range(batch)]
    for i in range(batch):
        next_value, last_gae = 0.0, 0.0
        for t in reversed(range(length)):
            delta = rewards[i][t] + gamma * next_value - values[i][t]
            if mask[i][t] == 1:
                last_gae = delta + gamma * lam * last_gae
                next_value = values[i][t]
            adv[i][t] = last_gae
    return adv


def ref_whiten(x, mask):
    """verl's masked_whiten: its masked means divide by count + 1e-8, which matters when the
    valid values nearly agree (variance near the 1e-8 under the square root)."""
    xs = [v for row, mrow in zip(x, mask) for v, m in zip(row, mrow) if m == 1]
    n = len(xs)
    mean = sum(xs) / (n + 1e-8)
    var = sum((v - mean) ** 2 for v in xs) / (n + 1e-8) * n / (n - 1)
    return [[(v - mean) / math.sqrt(var + 1e-8) for v in row] for row in x]


def test_worked_example_from_seed_004():
    rewards = torch.tensor([[0.0, 0.0, 0.0, 1.0]])
    values = torch.tensor([[0.2, 0.3, 0.4, 0.5]])
    mask = torch.tensor([[0.0, 0.0, 1.0, 1.0]])
    adv, ret = compute_gae_advantage_return(rewards, values, mask, 0.99, 0.95)
    raw = ret - values
    # The note's numbers: delta_3 = 0.5, A_3 = 0.5; delta_2 = 0.095, A_2 = 0.095 + 0.9405 * 0.5.
    assert raw[0, 3].item() == pytest.approx(0.5, abs=1e-6)
    assert raw[0, 2].item() == pytest.approx(0.56525, abs=1e-6)
    # Correction X3: the masked positions carry the running advantage, they are not 0.
    assert raw[0, :2].tolist() == pytest.approx([0.56525, 0.56525], abs=1e-6)
    # Whitened over the two valid tokens: mean 0.532625, unbiased std 0.0459619...
    mean, std = (0.56525 + 0.5) / 2, math.sqrt(2 * (0.56525 - 0.532625) ** 2)
    assert adv[0, 2].item() == pytest.approx((0.56525 - mean) / math.sqrt(std**2 + 1e-8), abs=1e-4)
    assert adv[0, 2].item() == pytest.approx(0.7071, abs=1e-3)


@given(batches(), st.sampled_from([0.0, 0.5, 0.95, 0.99, 1.0]), st.sampled_from([0.0, 0.3, 0.95, 1.0]))
def test_gae_matches_verl_loop(b, gamma, lam):
    gen, batch, length, kind = b
    mask = make_mask(kind, batch, length, gen)
    if mask.sum() < 2:
        mask[0, :] = 1.0
        if mask.sum() < 2:
            return
    rewards = torch.randn(batch, length, generator=gen, dtype=torch.float64)
    values = torch.randn(batch, length, generator=gen, dtype=torch.float64)
    adv, ret = compute_gae_advantage_return(rewards, values, mask, gamma, lam)
    raw = ref_gae(rewards.tolist(), values.tolist(), mask.tolist(), gamma, lam)
    expect_ret = [[a + v for a, v in zip(ra, rv)] for ra, rv in zip(raw, values.tolist())]
    torch.testing.assert_close(ret, torch.tensor(expect_ret, dtype=torch.float64), atol=1e-10, rtol=1e-10)
    torch.testing.assert_close(
        adv, torch.tensor(ref_whiten(raw, mask.tolist()), dtype=torch.float64), atol=1e-6, rtol=1e-6
    )


def test_gae_float32_long_sequence_matches_loop():
    gen = torch.Generator().manual_seed(3)
    rewards, values = torch.randn(4, 300, generator=gen), torch.randn(4, 300, generator=gen)
    mask = make_mask("ragged", 4, 300, gen).float()
    _, ret = compute_gae_advantage_return(rewards, values, mask, 1.0, 0.95)
    raw = ref_gae(rewards.double().tolist(), values.double().tolist(), mask.tolist(), 1.0, 0.95)
    expect = torch.tensor(raw, dtype=torch.float64) + values.double()
    torch.testing.assert_close(ret.double(), expect, atol=1e-5, rtol=1e-5)


def test_gae_is_the_discounted_sum_of_td_errors():
    # 003.12: A_t = sum_l (gamma * lam)^l delta_{t+l} on a full mask.
    gen = torch.Generator().manual_seed(4)
    r, v = torch.randn(1, 6, generator=gen, dtype=torch.float64), torch.randn(1, 6, generator=gen, dtype=torch.float64)
    gamma, lam = 0.9, 0.8
    _, ret = compute_gae_advantage_return(r, v, torch.ones(1, 6), gamma, lam)
    vn = v[0].tolist() + [0.0]
    delta = [r[0, t].item() + gamma * vn[t + 1] - vn[t] for t in range(6)]
    for t in range(6):
        expect = sum((gamma * lam) ** k * delta[t + k] for k in range(6 - t))
        assert (ret - v)[0, t].item() == pytest.approx(expect, abs=1e-12)


def test_gae_extremes_are_td_and_monte_carlo():
    gen = torch.Generator().manual_seed(5)
    r, v = torch.randn(2, 5, generator=gen, dtype=torch.float64), torch.randn(2, 5, generator=gen, dtype=torch.float64)
    m = torch.ones(2, 5)
    _, ret0 = compute_gae_advantage_return(r, v, m, 1.0, 0.0)
    next_v = torch.cat([v[:, 1:], torch.zeros(2, 1, dtype=torch.float64)], -1)
    torch.testing.assert_close(ret0 - v, r + next_v - v)  # lambda = 0: the one-step TD error
    _, ret1 = compute_gae_advantage_return(r, v, m, 1.0, 1.0)
    reward_to_go = r.flip(-1).cumsum(-1).flip(-1)
    torch.testing.assert_close(ret1, reward_to_go)  # lambda = 1, gamma = 1: Monte-Carlo return


def test_gamma_and_lam_may_be_tensors():
    gen = torch.Generator().manual_seed(6)
    r, v = torch.randn(2, 9, generator=gen), torch.randn(2, 9, generator=gen)
    m = torch.ones(2, 9)
    a1, r1 = compute_gae_advantage_return(r, v, m, 0.99, 0.95)
    a2, r2 = compute_gae_advantage_return(r, v, m, torch.tensor(0.99, dtype=torch.float64), torch.tensor(0.95))
    torch.testing.assert_close(r1, r2)
    torch.testing.assert_close(a1, a2)


def test_gae_bad_input():
    r, v, m = torch.zeros(2, 3), torch.zeros(2, 3), torch.ones(2, 3)
    with pytest.raises(ValueError, match="shape mismatch"):
        compute_gae_advantage_return(r, torch.zeros(2, 4), m, 1.0, 0.95)
    with pytest.raises(ValueError, match="only 0 and 1"):
        compute_gae_advantage_return(r, v, torch.full((2, 3), 0.5), 1.0, 0.95)
    with pytest.raises(ValueError, match="token_level_rewards contains NaN"):
        compute_gae_advantage_return(torch.full((2, 3), float("nan")), v, m, 1.0, 0.95)
    with pytest.raises(ValueError, match="values contains NaN or inf"):
        compute_gae_advantage_return(r, torch.full((2, 3), float("inf")), m, 1.0, 0.95)
    with pytest.raises(ValueError, match="gamma must be in"):
        compute_gae_advantage_return(r, v, m, 1.5, 0.95)
    with pytest.raises(ValueError, match="lam must be in"):
        compute_gae_advantage_return(r, v, m, 1.0, -0.1)
    with pytest.raises(ValueError, match="response_mask has fewer than 2 valid"):
        compute_gae_advantage_return(r, v, torch.tensor([[1.0, 0, 0], [0, 0, 0]]), 1.0, 0.95)
    with pytest.raises(ValueError, match="2 dimensions"):
        compute_gae_advantage_return(r[0], v[0], m[0], 1.0, 0.95)


def ref_group_stats(scores, index):
    groups = {}
    for s, g in zip(scores, index):
        groups.setdefault(g, []).append(s)
    return groups


@given(batches(max_batch=9), st.booleans(), st.booleans())
def test_grpo_matches_plain_loop(b, norm_by_std, tensor_index):
    gen, batch, length, kind = b
    mask = make_mask(kind, batch, length, gen)
    rewards = torch.randn(batch, length, generator=gen, dtype=torch.float64)
    labels = torch.randint(0, 3, (batch,), generator=gen)
    index = labels if tensor_index else [f"uid{int(x)}" for x in labels]
    adv, ret = compute_grpo_outcome_advantage(rewards, mask, index, 1e-6, norm_by_std)
    scores = rewards.sum(-1).tolist()
    keys = labels.tolist()
    groups = ref_group_stats(scores, keys)
    for i in range(batch):
        g = groups[keys[i]]
        if len(g) == 1:
            mean, std = 0.0, 1.0
        else:
            mean = sum(g) / len(g)
            std = math.sqrt(sum((x - mean) ** 2 for x in g) / (len(g) - 1))
        a = (scores[i] - mean) / (std + 1e-6) if norm_by_std else scores[i] - mean
        for t in range(length):
            assert adv[i, t].item() == pytest.approx(a * mask[i, t].item(), abs=1e-9)
    assert torch.equal(adv, ret)


@pytest.mark.parametrize("score, size", [(0.1, 16), (0.7, 16), (0.7, 64), (0.7, 3), (2.3, 16)])
def test_grpo_gives_a_group_of_equal_float32_scores_advantage_zero(score, size):
    """Equal scores that float32 cannot hold exactly: a float32 mean is off by a rounding step and the
    std is near 0, so a float32 GRPO (verl's, whose torch.mean rounds) turns rounding into
    advantages of order 0.1; taken in float64, the group's deviation and advantage are exactly 0.
    Its float32 result is still float32, and a group beside it with differing scores keeps its own."""
    mixed = torch.tensor([0.0, 1.0, 1.0, 0.0], dtype=torch.float32)
    rewards = torch.cat([torch.full((size,), score, dtype=torch.float32), mixed]).unsqueeze(-1)
    index = [0] * size + [1] * 4
    adv, _ = compute_grpo_outcome_advantage(rewards, torch.ones_like(rewards), index)
    assert adv.dtype == torch.float32
    assert torch.equal(adv[:size], torch.zeros(size, 1))
    expected = (mixed - 0.5) / (math.sqrt(1 / 3) + 1e-6)
    torch.testing.assert_close(adv[size:, 0], expected)


@given(batches(max_batch=9), st.booleans())
def test_rloo_matches_plain_loop(b, tensor_index):
    gen, batch, length, kind = b
    mask = make_mask(kind, batch, length, gen)
    rewards = torch.randn(batch, length, generator=gen, dtype=torch.float64)
    labels = torch.randint(0, 3, (batch,), generator=gen)
    index = labels if tensor_index else labels.tolist()
    adv, _ = compute_rloo_outcome_advantage(rewards, mask, index)
    scores = rewards.sum(-1).tolist()
    groups = ref_group_stats(scores, labels.tolist())
    for i in range(batch):
        g = groups[int(labels[i])]
        a = scores[i] if len(g) == 1 else scores[i] - (sum(g) - scores[i]) / (len(g) - 1)
        for t in range(length):
            assert adv[i, t].item() == pytest.approx(a * mask[i, t].item(), abs=1e-9)


def test_outcome_estimators_bad_input():
    with pytest.raises(ValueError, match="index has 3 entries"):
        compute_grpo_outcome_advantage(torch.zeros(2, 4), torch.ones(2, 4), [0, 0, 1])
    with pytest.raises(ValueError, match="NaN"):
        compute_rloo_outcome_advantage(torch.full((2, 4), float("nan")), torch.ones(2, 4), [0, 0])


def test_registry():
    assert get_adv_estimator_fn("gae") is compute_gae_advantage_return
    assert get_adv_estimator_fn("grpo") is compute_grpo_outcome_advantage
    assert get_adv_estimator_fn("rloo").__name__ == "rloo_advantage"  # verl's call, then the formula
    with pytest.raises(
        ValueError,
        match="valid: gae, gdpo, gpg, grpo, grpo_passk, grpo_vectorized, opo, optimal_token_baseline, "
        "reinforce_plus_plus, reinforce_plus_plus_baseline, remax, rloo",
    ):
        get_adv_estimator_fn("ppo")
