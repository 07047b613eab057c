"""The estimators and losses added from verl 0.9's registry: REINFORCE++, REINFORCE++-baseline,
ReMax, GPG, OPO and pass@k GRPO (estimators), GSPO, SAPO, CISPO, GMPO, GPG, Clip-Cov, KL-Cov,
DPPO and DRO (losses). Each
against a plain float64 reference written from verl's formula, on random inputs with padding and
holes, and with a property its paper states."""

import math

import pytest
import torch

from refppo.advantages import (
    ADV_ESTIMATORS,
    compute_gae_advantage_return,
    compute_grpo_outcome_advantage,
    compute_reinforce_plus_plus_outcome_advantage,
    needs_critic,
)
from refppo.algorithms.divergence_losses import (
    compute_policy_loss_dppo_kl,
    compute_policy_loss_dppo_tv,
    compute_policy_loss_dro,
)
from refppo.algorithms.verl_advantages import (
    compute_gpg_outcome_advantage,
    compute_grpo_passk_outcome_advantage,
    compute_opo_outcome_advantage,
    compute_reinforce_plus_plus_baseline_outcome_advantage,
    compute_remax_outcome_advantage,
)
from refppo.algorithms.verl_losses import (
    compute_policy_loss_cispo,
    compute_policy_loss_clip_cov,
    compute_policy_loss_geo_mean,
    compute_policy_loss_gpg,
    compute_policy_loss_gspo,
    compute_policy_loss_kl_cov,
    compute_policy_loss_sapo,
)
from refppo.losses import POLICY_LOSSES, compute_policy_loss
from refppo.rewards import place_score_on_last_token
from refppo.settings.config import Config, apply_overrides
from refppo.settings.validate import validate

B, T = 6, 7


def _inputs(seed, holes=True):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, T + 1, (B,), generator=g)
    lengths[0] = T
    mask = (torch.arange(T)[None, :] < lengths[:, None]).double()
    rewards = torch.randn(B, T, generator=g, dtype=torch.float64) * mask
    if holes:  # masked tokens inside a response (a tool's output in multi-turn data): their rewards unread
        mask[0, 2:4] = 0.0
    return g, rewards, mask


def _whiten(rows, mask):
    """verl's masked_whiten on nested lists: unbiased variance, rsqrt(var + 1e-8)."""
    valid = [x for row, m in zip(rows, mask) for x, k in zip(row, m) if k]
    mean = sum(valid) / len(valid)
    var = sum((x - mean) ** 2 for x in valid) / len(valid) * len(valid) / (len(valid) - 1)
    return [[(x - mean) / math.sqrt(var + 1e-8) for x in row] for row in rows]


def _group_means(scores, index):
    groups = {}
    for s, i in zip(scores, index):
        groups.setdefault(i, []).append(s)
    return [0.0 if len(groups[i]) == 1 else sum(groups[i]) / len(groups[i]) for i in index]


# ---- estimators ------------------------------------------------------------------------


def ref_reinforce_plus_plus(rewards, mask, gamma):
    returns = []
    for r, m in zip(rewards.tolist(), mask.tolist()):
        running, row = 0.0, [0.0] * T
        for t in reversed(range(T)):
            if m[t]:
                running = r[t] + gamma * running
                row[t] = running
        returns.append(row)
    adv = [[a * k for a, k in zip(row, m)] for row, m in zip(_whiten(returns, mask.tolist()), mask.tolist())]
    return adv, returns


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize("gamma", [1.0, 0.9])
def test_reinforce_plus_plus_is_verls(seed, gamma):
    _, rewards, mask = _inputs(seed)
    adv, ret = compute_reinforce_plus_plus_outcome_advantage(rewards, mask, gamma)
    want_adv, want_ret = ref_reinforce_plus_plus(rewards, mask, gamma)
    torch.testing.assert_close(ret, torch.tensor(want_ret, dtype=torch.float64), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(adv, torch.tensor(want_adv, dtype=torch.float64), rtol=1e-9, atol=1e-9)


def test_reinforce_plus_plus_returns_are_gae_with_no_critic():
    """REINFORCE++'s returns are GAE's with V = 0 and lambda = 1 (Monte Carlo returns), on the
    valid tokens."""
    _, rewards, mask = _inputs(11)
    _, ret = compute_reinforce_plus_plus_outcome_advantage(rewards, mask, 0.95)
    _, gae_returns = compute_gae_advantage_return(rewards, torch.zeros_like(rewards), mask, 0.95, 1.0)
    torch.testing.assert_close(ret, gae_returns * mask)


def ref_baseline(rewards, mask, index):
    scores = rewards.sum(-1).tolist()
    centred = [s - mu for s, mu in zip(scores, _group_means(scores, index))]
    rows = [[c * k for k in m] for c, m in zip(centred, mask.tolist())]
    return [[a * k for a, k in zip(row, m)] for row, m in zip(_whiten(rows, mask.tolist()), mask.tolist())]


@pytest.mark.parametrize("seed", range(5))
def test_reinforce_plus_plus_baseline_is_verls(seed):
    _, rewards, mask = _inputs(seed)
    index = ["a", "a", "b", "b", "b", "c"]  # "c": a group of one keeps its raw score
    adv, ret = compute_reinforce_plus_plus_baseline_outcome_advantage(rewards, mask, index)
    torch.testing.assert_close(adv, torch.tensor(ref_baseline(rewards, mask, index), dtype=torch.float64))
    assert ret is adv


def test_reinforce_plus_plus_baseline_teaches_nothing_where_a_group_agrees():
    _, rewards, mask = _inputs(3, holes=False)
    rewards = torch.zeros_like(rewards)
    rewards[:, 0] = torch.tensor([1.0, 1.0, -2.0, -2.0, 0.5, 0.5])
    adv, _ = compute_reinforce_plus_plus_baseline_outcome_advantage(rewards, mask, [0, 0, 1, 1, 2, 2])
    assert adv.abs().max() == 0


def ref_gpg(rewards, mask, index):
    scores = rewards.sum(-1).tolist()
    alpha = len(scores) / max(sum(s != 0 for s in scores), 1)
    return [[alpha * (s - mu) * k for k in m] for s, mu, m in zip(scores, _group_means(scores, index), mask.tolist())]


@pytest.mark.parametrize("seed", range(5))
def test_gpg_advantage_is_verls(seed):
    _, rewards, mask = _inputs(seed)
    rewards[1] = 0.0  # a response with no signal: alpha = 6 / 5
    index = torch.tensor([0, 0, 1, 1, 1, 2])
    adv, ret = compute_gpg_outcome_advantage(rewards, mask, index)
    torch.testing.assert_close(adv, torch.tensor(ref_gpg(rewards, mask, index.tolist()), dtype=torch.float64))
    assert ret is adv


def test_gpg_with_every_score_nonzero_is_dr_grpo():
    """alpha = 1 when no response scores 0: GPG's advantage is GRPO's without the std (Dr. GRPO)."""
    _, rewards, mask = _inputs(5)
    rewards[:, 0] += 3.0 * mask[:, 0] + 0.1
    index = [0, 0, 0, 1, 1, 1]
    gpg, _ = compute_gpg_outcome_advantage(rewards, mask, index)
    dr_grpo, _ = compute_grpo_outcome_advantage(rewards, mask, index, norm_adv_by_std_in_grpo=False)
    torch.testing.assert_close(gpg, dr_grpo)


def ref_remax(rewards, mask, baselines):
    """verl's formula as loops: the undiscounted reward-to-go over valid tokens, minus the baseline
    where the mask is 1 (a hole keeps its reward-to-go)."""
    rows = []
    for r, m, b in zip(rewards.tolist(), mask.tolist(), baselines.tolist()):
        to_go = [sum(r[s] * m[s] for s in range(t, T)) for t in range(T)]
        rows.append((to_go, [g - b * k for g, k in zip(to_go, m)]))
    return [a for _, a in rows], [g for g, _ in rows]


@pytest.mark.parametrize("seed", range(5))
def test_remax_is_verls(seed):
    g, rewards, mask = _inputs(seed)
    baselines = torch.randn(B, generator=g, dtype=torch.float64)
    adv, ret = compute_remax_outcome_advantage(rewards, baselines, mask)
    want_adv, want_ret = ref_remax(rewards, mask, baselines)
    torch.testing.assert_close(adv, torch.tensor(want_adv, dtype=torch.float64))
    torch.testing.assert_close(ret, torch.tensor(want_ret, dtype=torch.float64))


def test_remax_advantage_is_the_score_over_the_greedy_responses():
    """With the score on the last token alone (no KL), every valid token's advantage is the
    response's score minus its prompt's greedy score: 0 for a response that scores as the greedy one."""
    g, _, mask = _inputs(7, holes=False)
    scores = torch.randn(B, generator=g, dtype=torch.float64)
    baselines = torch.cat([scores[:2], torch.randn(B - 2, generator=g, dtype=torch.float64)])
    rewards = place_score_on_last_token(scores, mask)
    adv, _ = compute_remax_outcome_advantage(rewards, baselines, mask)
    torch.testing.assert_close(adv, (scores - baselines)[:, None] * mask)
    assert adv[:2].abs().max() == 0
    with pytest.raises(ValueError, match="reward_baselines has 5 rows but token_level_rewards has 6"):
        compute_remax_outcome_advantage(rewards, baselines[:5], mask)


def ref_opo(rewards, mask, index):
    """verl's loop: a group's baseline is sum(length * score) / sum(length); a group of one, 0."""
    scores, lengths = rewards.sum(-1).tolist(), mask.sum(-1).tolist()
    baselines = []
    for i in index:
        members = [j for j, k in enumerate(index) if k == i]
        weighted = sum(lengths[j] * scores[j] for j in members) / sum(lengths[j] for j in members)
        baselines.append(0.0 if len(members) == 1 else weighted)
    return [[(s - b) * k for k in m] for s, b, m in zip(scores, baselines, mask.tolist())]


@pytest.mark.parametrize("seed", range(5))
def test_opo_is_verls(seed):
    _, rewards, mask = _inputs(seed)
    index = ["a", "a", "b", "b", "b", "c"]
    adv, ret = compute_opo_outcome_advantage(rewards, mask, index)
    torch.testing.assert_close(adv, torch.tensor(ref_opo(rewards, mask, index), dtype=torch.float64))
    assert ret is adv


def test_opo_with_equal_lengths_is_dr_grpo():
    """The length weights cancel when every response of a group is as long: the plain group mean."""
    _, rewards, _ = _inputs(2, holes=False)
    mask = torch.ones(B, T, dtype=torch.float64)
    index = [0, 0, 0, 1, 1, 1]
    opo, _ = compute_opo_outcome_advantage(rewards, mask, index)
    dr_grpo, _ = compute_grpo_outcome_advantage(rewards, mask, index, norm_adv_by_std_in_grpo=False)
    torch.testing.assert_close(opo, dr_grpo)


def ref_passk(rewards, mask, index, norm, epsilon=1e-6):
    """verl's loop: the group's top two by torch.topk; the first of them gets r_max - r_second."""
    scores = rewards.sum(-1)
    adv = [0.0] * len(index)
    for i in dict.fromkeys(index):
        members = [j for j, k in enumerate(index) if k == i]
        group = scores[members]
        top, where = torch.topk(group, 2)
        gap = (top[0] - top[1]).item()
        adv[members[where[0].item()]] = gap / (group.std().item() + epsilon) if norm else gap
    return [[a * k for k in m] for a, m in zip(adv, mask.tolist())]


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize("norm", [True, False])
def test_grpo_passk_is_verls(seed, norm):
    _, rewards, mask = _inputs(seed)
    index = ["a", "a", "b", "b", "c", "c"] if seed % 2 else ["a", "a", "b", "b", "b", "b"]
    adv, ret = compute_grpo_passk_outcome_advantage(rewards, mask, index, norm_adv_by_std_in_grpo=norm)
    torch.testing.assert_close(adv, torch.tensor(ref_passk(rewards, mask, index, norm), dtype=torch.float64))
    assert ret is adv
    learners = [index[r] for r in range(B) if adv[r].abs().sum() > 0]
    assert len(learners) == len(set(learners)), "at most one response of a group learns"
    with pytest.raises(ValueError, match="every group needs >= 2"):
        compute_grpo_passk_outcome_advantage(rewards, mask, list(range(B)))


def test_grpo_passk_teaches_nothing_where_the_best_is_tied():
    _, _, mask = _inputs(1, holes=False)
    rewards = torch.zeros(B, T, dtype=torch.float64)
    rewards[:, 0] = torch.tensor([3.0, 3.0, 1.0, 2.0, 0.5, 0.0])
    adv, _ = compute_grpo_passk_outcome_advantage(rewards, mask, [0, 0, 0, 1, 1, 1])
    assert adv[:3].abs().max() == 0 and adv[3, 0] > 0 and adv[4:].abs().max() == 0


def test_the_estimators_are_registered_with_verls_names():
    for name in ("reinforce_plus_plus", "reinforce_plus_plus_baseline", "gpg", "remax", "opo", "grpo_passk"):
        assert name in ADV_ESTIMATORS.names()
    assert not needs_critic("remax"), "ReMax's baseline is a greedy response, not a critic"
    assert ADV_ESTIMATORS.readers("gamma") == ("gae", "reinforce_plus_plus")
    assert ADV_ESTIMATORS.readers("norm_adv_by_std_in_grpo") == ("grpo", "grpo_passk")


# ---- losses ----------------------------------------------------------------------------


def _loss_inputs(seed, scale=0.3):
    g, advantages, mask = _inputs(seed)
    advantages = torch.randn(B, T, generator=g, dtype=torch.float64)
    old = -torch.rand(B, T, generator=g, dtype=torch.float64) - 0.1
    new = (old + scale * torch.randn(B, T, generator=g, dtype=torch.float64)).requires_grad_(True)
    return old, new, advantages, mask


def _seq_mean_token_mean(per_token, mask):
    rows = [(sum(x * k for x, k in zip(r, m)) / (sum(m) + 1e-8)) for r, m in zip(per_token, mask) if sum(m)]  # verl's
    return sum(rows) / len(rows)


def ref_gspo(old, new, adv, mask, low, high):
    """verl's GSPO value, per token: the sequence ratio exp(mean log-ratio), clipped PPO-style."""
    losses = []
    for o, n, a, m in zip(old.tolist(), new.tolist(), adv.tolist(), mask.tolist()):
        s = math.exp(min(sum((y - x) * k for x, y, k in zip(o, n, m)) / max(sum(m), 1), 10.0))
        losses.append([max(-ai * s, -ai * min(max(s, 1 - low), 1 + high)) for ai in a])
    return _seq_mean_token_mean(losses, mask.tolist())


@pytest.mark.parametrize("seed", range(5))
def test_gspo_is_verls(seed):
    old, new, adv, mask = _loss_inputs(seed)
    loss, metrics = compute_policy_loss_gspo(old, new, adv, mask, clip_ratio_low=0.02, clip_ratio_high=0.03)
    assert loss.item() == pytest.approx(ref_gspo(old, new.detach(), adv, mask, 0.02, 0.03), rel=1e-12, abs=1e-12)
    log_ratio = new.detach() - old
    assert metrics["actor/ppo_kl"].item() == pytest.approx((-(log_ratio * mask).sum() / mask.sum()).item())
    # The gradient: each token's own log-prob, times its sequence's ratio where the unclipped term counts.
    loss.backward()
    lengths = mask.sum(-1, keepdim=True)
    s = torch.exp((log_ratio * mask).sum(-1, keepdim=True) / lengths).expand(B, T)
    clipped = torch.clamp(s, 1 - 0.02, 1 + 0.03)
    unclipped_counts = (-adv * s) >= (-adv * clipped)
    rows = (lengths > 0).sum()
    want = torch.where(unclipped_counts, -adv * s, torch.zeros_like(s)) * mask / lengths / rows
    torch.testing.assert_close(new.grad, want)


def test_gspo_ratio_is_one_number_per_sequence_and_one_token_responses_give_ppos_loss():
    old, new, adv, mask = _loss_inputs(7)
    one = torch.zeros_like(mask)
    one[:, 0] = 1.0
    gspo, _ = compute_policy_loss_gspo(old, new, adv, one)
    (g_gspo,) = torch.autograd.grad(gspo, new)
    ppo, _ = compute_policy_loss(old, new, adv, one, clip_ratio_c=None, loss_agg_mode="seq-mean-token-mean")
    (g_ppo,) = torch.autograd.grad(ppo, new)
    torch.testing.assert_close(gspo, ppo)
    torch.testing.assert_close(g_gspo, g_ppo)
    # A longer response: every token carries the same ratio, so the clip acts on whole sequences.
    _, metrics = compute_policy_loss_gspo(old, new, torch.ones_like(adv), mask, clip_ratio=1e-4)
    clipped_rows = metrics["actor/pg_clipfrac"].item() * mask.sum().item()
    assert any(abs(clipped_rows - k) < 1e-6 for k in _row_length_sums(mask)), clipped_rows  # masked_mean: + 1e-8


def _row_length_sums(mask):
    """Every total of whole rows' lengths (a clip fraction of whole sequences is one of them)."""
    lengths = [int(x) for x in mask.sum(-1).tolist()]
    sums = {0}
    for n in lengths:
        sums |= {s + n for s in sums}
    return sums


def ref_cispo(old, new, adv, mask, low, high):
    losses = []
    for o, n, a in zip(old.tolist(), new.tolist(), adv.tolist()):
        losses.append([-min(max(math.exp(y - x), 1 - low), 1 + high) * ai * y for x, y, ai in zip(o, n, a)])
    valid = [(x, k) for r, m in zip(losses, mask.tolist()) for x, k in zip(r, m)]
    return sum(x * k for x, k in valid) / sum(k for _, k in valid)


@pytest.mark.parametrize("seed", range(5))
def test_cispo_is_verls_and_a_clipped_token_keeps_its_gradient(seed):
    old, new, adv, mask = _loss_inputs(seed, scale=0.5)
    loss, metrics = compute_policy_loss_cispo(old, new, adv, mask, clip_ratio=0.1)
    assert loss.item() == pytest.approx(ref_cispo(old, new.detach(), adv, mask, 0.1, 0.1), rel=1e-12)
    loss.backward()
    ratio = torch.exp(new.detach() - old)
    weight = torch.clamp(ratio, 0.9, 1.1)
    torch.testing.assert_close(new.grad, -weight * adv * mask / mask.sum())
    clipped = (ratio != weight) & mask.bool()
    assert clipped.any() and (new.grad[clipped] != 0).all(), "PPO's clip would give these tokens no gradient"
    assert metrics["actor/pg_clipfrac"].item() == pytest.approx(clipped.sum().item() / mask.sum().item())


@pytest.mark.parametrize("seed", range(3))
def test_cispo_without_a_lower_bound_as_verls_example_runs_it(seed):
    """verl's examples/cispo_trainer sets clip_ratio_low=10: 1 - 10 < 0, so no ratio is cut from
    below (verl 0.9, core_algos.compute_policy_loss_cispo clamps at 1 - clip_ratio_low)."""
    old, new, adv, mask = _loss_inputs(seed, scale=1.0)
    loss, metrics = compute_policy_loss_cispo(old, new, adv, mask, clip_ratio_low=10.0, clip_ratio_high=0.2)
    assert loss.item() == pytest.approx(ref_cispo(old, new.detach(), adv, mask, 10.0, 0.2), rel=1e-12)
    ratio = torch.exp(new.detach() - old)
    assert (ratio[mask.bool()] < 0.5).any(), "a ratio the default lower bound (0.8) would have cut"
    cut = (ratio > 1.2) & mask.bool()
    assert metrics["actor/pg_clipfrac"].item() == pytest.approx(cut.sum().item() / mask.sum().item())
    validate(
        apply_overrides(Config(), ["actor.policy_loss=cispo", "actor.clip_ratio_low=10", "actor.clip_ratio_high=0.2"])
    )


def ref_dppo(old, new, adv, mask, low, high, c, divergence):
    """verl's DPPO per token: which tokens are kept, and -A * min(ratio, c) * log pi on them."""
    kept, losses = [], []
    for o_row, n_row, a_row in zip(old.tolist(), new.tolist(), adv.tolist()):
        kept.append([])
        for x, y, a in zip(o_row, n_row, a_row):
            p, q, ratio = math.exp(x), math.exp(y), math.exp(min(max(y - x, -20.0), 20.0))
            if divergence == "tv":
                keep = q - p <= high if a > 0 else q - p >= -low
            else:
                kl = p * (x - y) + (1 - p) * math.log((1 - p + 1e-8) / (1 - q + 1e-8))
                keep = (kl <= high or q <= p) if a > 0 else (kl <= low or q >= p)
            kept[-1].append(float(keep))
            losses.append((-a * min(ratio, c) * y * keep, keep))
    flat_mask = [k for m in mask.tolist() for k in m]
    loss = sum(x * k for (x, _), k in zip(losses, flat_mask)) / sum(flat_mask)
    return loss, torch.tensor(kept, dtype=torch.float64)


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize("divergence", ["tv", "kl"])
def test_dppo_is_verls_and_its_gradient_is_ppos_on_the_kept_tokens(seed, divergence):
    old, new, adv, mask = _loss_inputs(seed, scale=0.5)
    new = torch.clamp(new.detach(), max=-0.01).requires_grad_(True)  # probabilities below 1
    fn = compute_policy_loss_dppo_tv if divergence == "tv" else compute_policy_loss_dppo_kl
    low, high = (0.1, 0.15) if divergence == "tv" else (0.02, 0.05)
    loss, metrics = fn(old, new, adv, mask, clip_ratio_low=low, clip_ratio_high=high, clip_ratio_c=1.5)
    want, kept = ref_dppo(old, new.detach(), adv, mask, low, high, 1.5, divergence)
    assert loss.item() == pytest.approx(want, rel=1e-12)
    loss.backward()
    ratio = torch.exp(new.detach() - old)
    # PPO's gradient -A * ratio * grad log pi (truncated at c) where kept, none elsewhere
    torch.testing.assert_close(new.grad, -adv * torch.clamp(ratio, max=1.5) * kept * mask / mask.sum())
    left_out = (1 - kept) * mask
    assert 0 < left_out.sum() < mask.sum(), "some tokens kept, some left out"
    assert metrics["actor/pg_clipfrac"].item() == pytest.approx(left_out.sum().item() / mask.sum().item())
    truncated = ((ratio > 1.5) * kept * mask).sum().item() / mask.sum().item()
    assert metrics["actor/pg_clipfrac_lower"].item() == pytest.approx(truncated)


def test_dppo_without_truncation_and_thresholds_is_the_plain_policy_gradient():
    old, new, adv, mask = _loss_inputs(1, scale=0.3)
    loss, metrics = compute_policy_loss_dppo_tv(
        old, new, adv, mask, clip_ratio_low=0.999, clip_ratio_high=2.0, clip_ratio_c=None
    )
    loss.backward()
    torch.testing.assert_close(new.grad, -adv * torch.exp(new.detach() - old) * mask / mask.sum())
    assert metrics["actor/pg_clipfrac"].item() == 0 and metrics["actor/pg_clipfrac_lower"].item() == 0


def ref_dro(old, new, adv, mask, beta):
    rows = zip(old.tolist(), new.tolist(), adv.tolist(), mask.tolist())
    terms = [(-(y * a - 0.5 * beta * (y - x) ** 2), k) for o, n, ad, m in rows for x, y, a, k in zip(o, n, ad, m)]
    return sum(t * k for t, k in terms) / sum(k for _, k in terms)


@pytest.mark.parametrize("seed", range(5))
def test_dro_is_verls_and_its_penalty_pulls_back_to_the_old_policy(seed):
    old, new, adv, mask = _loss_inputs(seed)
    loss, metrics = compute_policy_loss_dro(old, new, adv, mask, dro_beta=0.7)
    assert loss.item() == pytest.approx(ref_dro(old, new.detach(), adv, mask, 0.7), rel=1e-12)
    loss.backward()
    torch.testing.assert_close(new.grad, (-adv + 0.7 * (new.detach() - old)) * mask / mask.sum())
    kl = ((old - new.detach()) * mask).sum() / mask.sum()
    assert metrics == {"actor/ppo_kl": pytest.approx(kl.item())}
    with pytest.raises(ValueError, match="dro_beta must be"):
        compute_policy_loss_dro(old, new, adv, mask)


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-sum"])
def test_gpg_loss_is_plain_policy_gradient(mode):
    old, new, adv, mask = _loss_inputs(2)
    loss, metrics = compute_policy_loss_gpg(new, adv, mask, loss_agg_mode=mode)
    per_token = (-new.detach() * adv).tolist()
    if mode == "token-mean":
        want = sum(x * k for r, m in zip(per_token, mask.tolist()) for x, k in zip(r, m)) / mask.sum().item()
    else:
        rows = [sum(x * k for x, k in zip(r, m)) for r, m in zip(per_token, mask.tolist()) if sum(m)]
        want = sum(rows) / len(rows)
    assert loss.item() == pytest.approx(want, rel=1e-12) and metrics == {}


def test_the_losses_are_registered_with_verls_names():
    for name in ("gspo", "sapo", "cispo", "geo_mean", "gpg", "clip_cov", "kl_cov"):
        assert name in POLICY_LOSSES.names()
    assert POLICY_LOSSES.readers("tau_pos") == ("sapo",)
    assert not POLICY_LOSSES.reads("gpg", "clip_ratio"), "no ratio: no clip"


def _covariances(old, new, adv, mask):
    """Each valid token's (row, column) and cov = (A - mean A)(log pi - mean log pi), in float64 Python."""
    cells = [(i, j) for i, m in enumerate(mask.tolist()) for j, k in enumerate(m) if k]
    a = [adv[i, j].item() for i, j in cells]
    lp = [new[i, j].item() for i, j in cells]
    ma, ml = sum(a) / len(a), sum(lp) / len(lp)
    return {c: (x - ma) * (y - ml) for c, x, y in zip(cells, a, lp)}


def ref_kl_cov(old, new, adv, mask, kl_cov_ratio, coef):
    """verl's KL-Cov, token-mean: -A * ratio, plus coef * |log ratio| on the top-covariance tokens."""
    cov = _covariances(old, new, adv, mask)
    count = max(1, int(len(cov) * kl_cov_ratio))
    top = set(sorted(cov, key=cov.get, reverse=True)[:count])
    total = 0.0
    for i, j in cov:
        log_ratio = new[i, j].item() - old[i, j].item()
        total += -adv[i, j].item() * math.exp(log_ratio) + (coef * abs(log_ratio) if (i, j) in top else 0.0)
    return total / len(cov), top


def verl_kl_cov_tokens(new, adv, mask, kl_cov_ratio):
    """The tokens verl 0.9 penalises, transcribed from ``verl/trainer/ppo/core_algos.py``,
    ``compute_policy_loss_kl_cov``: top-k over the valid tokens' covariances, computed on the CPU."""
    all_valid = mask > 0
    all_valid_idx = torch.nonzero(all_valid.reshape(-1), as_tuple=True)[0]
    all_valid_adv = adv[all_valid].detach().reshape(-1).cpu()
    all_valid_logp = new[all_valid].detach().reshape(-1).cpu()
    cov_lst_all = (all_valid_adv - all_valid_adv.mean()) * (all_valid_logp - all_valid_logp.mean())
    k_percent_nums = max(1, int(len(cov_lst_all) * kl_cov_ratio))
    large_cov_idxs = all_valid_idx[torch.topk(cov_lst_all, k_percent_nums, largest=True).indices]
    return {(int(i) // adv.shape[1], int(i) % adv.shape[1]) for i in large_cov_idxs}


@pytest.mark.parametrize("shape", [(4, 8), (8, 16), (16, 64)])
def test_kl_cov_breaks_ties_as_verl_does(shape):
    """Equal advantages make every covariance 0: which tokens carry the penalty is then top-k's
    tie-breaking, over the valid tokens alone in verl (over the padded batch it picks others)."""
    gen = torch.Generator().manual_seed(shape[1])
    old = -torch.rand(shape, generator=gen) - 0.1
    new = old + 0.3 * torch.randn(shape, generator=gen)
    adv = torch.ones(shape)
    mask = (torch.rand(shape, generator=gen) > 0.3).float()
    mask[:, 0] = 1
    loss, _ = compute_policy_loss_kl_cov(old, new, adv, mask, kl_cov_ratio=0.3, ppo_kl_coef=1.0)
    top = verl_kl_cov_tokens(new, adv, mask, 0.3)
    log_ratio = new - old
    plain = -adv * log_ratio.exp() * mask
    penalty = sum(log_ratio[i, j].abs() for i, j in top)
    assert loss.item() == pytest.approx(((plain.sum() + penalty) / mask.sum()).item(), rel=1e-6)


@pytest.mark.parametrize("seed", range(5))
def test_kl_cov_is_verls_and_penalises_the_top_covariance_tokens(seed):
    old, new, adv, mask = _loss_inputs(seed)
    loss, metrics = compute_policy_loss_kl_cov(old, new, adv, mask, kl_cov_ratio=0.2, ppo_kl_coef=0.5)
    want, top = ref_kl_cov(old, new.detach(), adv, mask, 0.2, 0.5)
    assert loss.item() == pytest.approx(want, rel=1e-12) and len(top) == int(mask.sum().item() * 0.2)
    loss.backward()
    log_ratio = new.detach() - old
    plain = -adv * log_ratio.exp()
    for i, j in top:  # the penalty's gradient on the chosen tokens only
        assert new.grad[i, j].item() == pytest.approx(
            (plain[i, j] + 0.5 * log_ratio[i, j].sign()).item() / mask.sum().item()
        )
    valid = mask.bool()
    assert metrics["actor/ppo_kl"].item() == pytest.approx(log_ratio[valid].abs().mean().item())
    no_penalty, _ = compute_policy_loss_kl_cov(old, new.detach(), adv, mask, kl_cov_ratio=0.2, ppo_kl_coef=0.0)
    assert no_penalty.item() == pytest.approx((plain[valid]).mean().item(), rel=1e-12), "coef 0: plain ratio loss"


def ref_clip_cov(old, new, adv, mask, clip, lb, ub):
    """verl's Clip-Cov, token-mean, when every candidate is cut (clip_cov_ratio=1)."""
    cov = _covariances(old, new, adv, mask)
    total, cut = 0.0, set()
    for i, j in cov:
        ratio, a = math.exp(new[i, j].item() - old[i, j].item()), adv[i, j].item()
        l1, l2 = -a * ratio, -a * min(max(ratio, 1 - clip), 1 + clip)
        if lb < cov[i, j] < ub and not l2 > l1:
            cut.add((i, j))
        else:
            total += max(l1, l2)
    return total / len(cov), cut


@pytest.mark.parametrize("seed", range(5))
def test_clip_cov_is_verls_and_cut_tokens_get_no_gradient(seed):
    old, new, adv, mask = _loss_inputs(seed, scale=0.5)
    loss, metrics = compute_policy_loss_clip_cov(
        old, new, adv, mask, clip_ratio=0.2, clip_cov_ratio=1.0, clip_cov_lb=0.05
    )
    want, cut = ref_clip_cov(old, new.detach(), adv, mask, 0.2, 0.05, 5.0)
    assert cut and loss.item() == pytest.approx(want, rel=1e-12)
    assert metrics["actor/pg_clipfrac"].item() == pytest.approx(len(cut) / mask.sum().item())
    loss.backward()
    assert all(new.grad[i, j] == 0 for i, j in cut)


def test_clip_cov_cuts_a_random_share_of_the_candidates_and_without_any_is_ppos_clip():
    old, new, adv, mask = _loss_inputs(1, scale=0.5)
    _, candidates = ref_clip_cov(old, new.detach(), adv, mask, 0.2, 0.05, 5.0)
    count = int(0.1 * mask.sum().item())
    assert 1 <= count < len(candidates)
    torch.manual_seed(0)
    loss, metrics = compute_policy_loss_clip_cov(old, new, adv, mask, clip_cov_ratio=0.1, clip_cov_lb=0.05)
    loss.backward()
    cut = {(i, j) for i, j in candidates if new.grad[i, j] == 0}
    assert len(cut) == count and metrics["actor/pg_clipfrac"].item() == pytest.approx(count / mask.sum().item())
    torch.manual_seed(0)
    again, _ = compute_policy_loss_clip_cov(old, new, adv, mask, clip_cov_ratio=0.1, clip_cov_lb=0.05)
    assert again.item() == loss.item(), "the draw is torch's global generator's, as verl's"
    none, _ = compute_policy_loss_clip_cov(old, new, adv, mask, clip_cov_lb=100.0, clip_cov_ub=101.0)
    ppo, _ = compute_policy_loss(old, new, adv, mask, clip_ratio=0.2, clip_ratio_c=None)
    assert none.item() == pytest.approx(ppo.item(), rel=1e-12), "no token in the window: PPO's clip"
    with pytest.raises(ValueError, match="clip_cov_ub must be in"):
        compute_policy_loss_clip_cov(old, new, adv, mask, clip_cov_lb=2.0, clip_cov_ub=1.0)


# ---- in a run --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def sft_model(tmp_path_factory):
    from refppo.runs.cli import main

    out = tmp_path_factory.mktemp("runs") / "sft"
    tiny = ["model.hidden_size=32", "model.num_hidden_layers=1", "model.num_attention_heads=2"]
    assert main(["sft", f"trainer.output_dir={out}", "sft.steps=3", "sft.batch_size=8", *tiny, "data.val_size=8"]) == 0
    return out / "model"


@pytest.mark.parametrize(
    "settings",
    [
        ["algorithm.adv_estimator=reinforce_plus_plus", "algorithm.use_kl_in_reward=true", "algorithm.gamma=0.99"],
        ["algorithm.adv_estimator=reinforce_plus_plus_baseline", "rollout.n=2"],
        ["algorithm.adv_estimator=gpg", "rollout.n=2", "actor.policy_loss=gpg"],
        ["algorithm.adv_estimator=remax", "algorithm.use_kl_in_reward=true"],
        ["algorithm.adv_estimator=opo", "rollout.n=2"],
        ["algorithm.adv_estimator=grpo_passk", "rollout.n=2"],
        ["algorithm.adv_estimator=grpo", "rollout.n=2", "actor.policy_loss=dppo_tv", "actor.clip_ratio_c=20"],
        ["algorithm.adv_estimator=grpo", "rollout.n=2", "actor.policy_loss=dppo_kl"],
        [
            "algorithm.adv_estimator=grpo",
            "rollout.n=2",
            "actor.policy_loss.loss_mode=dro",
            "actor.policy_loss.dro_beta=0.5",
        ],
        [
            "algorithm.adv_estimator=grpo",
            "rollout.n=2",
            "actor.policy_loss=gspo",
            "actor.use_kl_loss=true",  # averaged with verl's default loss_agg_mode, token-mean
        ],
        ["algorithm.adv_estimator=grpo", "rollout.n=2", "actor.policy_loss=cispo", "actor.clip_ratio_high=0.28"],
        [
            "algorithm.adv_estimator=grpo",
            "rollout.n=2",
            "actor.policy_loss=sapo",
            "actor.use_kl_loss=true",  # averaged with verl's default loss_agg_mode, token-mean
        ],
        [
            "algorithm.adv_estimator=grpo",
            "rollout.n=2",
            "actor.policy_loss=geo_mean",
            "actor.use_kl_loss=true",  # averaged with verl's default loss_agg_mode, token-mean
        ],
        ["trainer.critic_warmup=0", "actor.policy_loss=clip_cov", "actor.clip_cov_ratio=0.1", "actor.clip_cov_lb=0.0"],
        [
            "algorithm.adv_estimator=grpo",
            "rollout.n=2",
            "actor.policy_loss.loss_mode=kl_cov",  # verl's key without its prefix
            "actor.policy_loss.kl_cov_ratio=0.1",
        ],
    ],
)
def test_each_runs_in_the_trainer(sft_model, tmp_path, settings):
    import json

    from refppo.runs.cli import main

    quick = ["trainer.total_training_steps=2", "data.train_batch_size=4", "actor.ppo_mini_batch_size=2"]
    quick += ["data.val_size=8", "trainer.progress_bar=false", "data.max_response_length=4"]
    out = tmp_path / "run"
    assert main(["ppo", f"model.path={sft_model}", f"trainer.output_dir={out}", *quick, *settings]) == 0
    last = json.loads((out / "metrics.jsonl").read_text().splitlines()[-1])
    assert last["step"] == 2 and math.isfinite(last["actor/pg_loss"])


def test_remax_baseline_is_the_score_of_each_prompts_greedy_response():
    """The trainer's ``reward_baselines`` against Hugging Face's own greedy decoding of each prompt,
    scored by the same rule, for each of the prompt's ``rollout.n`` rows."""
    from _trainers import TOK, make_trainer

    def reward(prompts, responses, records):  # a score that tells responses apart
        return torch.tensor([len(r) + sum(map(ord, r)) % 13 / 13 for r in responses])

    trainer = make_trainer(["algorithm.adv_estimator=remax", "rollout.n=2"], seed=3, reward_fn=reward)
    records = trainer.sampler.next_batch()
    batch, _ = trainer.make_experience(records, {})
    want = []
    for record in records:
        ids = torch.tensor([TOK(record["prompt"])["input_ids"]])
        out = trainer.actor.generate(
            ids, do_sample=False, max_new_tokens=4, eos_token_id=TOK.eos_token_id, pad_token_id=TOK.pad_token_id
        )
        text = TOK.decode(out[0, ids.shape[1] :], skip_special_tokens=True)
        want += [float(reward(None, [text], None)[0])] * 2
    assert batch["reward_baselines"].tolist() == pytest.approx(want, abs=1e-6)
    assert len(set(want)) > 1, "the check can tell prompts apart"
    rewards_to_go = batch["token_level_rewards"].flip(-1).cumsum(-1).flip(-1)
    valid = batch["response_mask"].bool()
    torch.testing.assert_close(batch["advantages"][valid], (rewards_to_go - batch["reward_baselines"][:, None])[valid])


def ref_sapo(old, new, adv, mask, tau_pos, tau_neg):
    losses = []
    for o, n, a in zip(old.tolist(), new.tolist(), adv.tolist()):
        row = []
        for x, y, ai in zip(o, n, a):
            tau = tau_pos if ai > 0 else tau_neg
            row.append(-ai * 4.0 / tau / (1.0 + math.exp(-tau * (math.exp(y - x) - 1.0))))
        losses.append(row)
    return _seq_mean_token_mean(losses, mask.tolist())


@pytest.mark.parametrize("seed", range(5))
def test_sapo_is_verls_and_its_gate_has_ppos_gradient_at_the_old_policy(seed):
    old, new, adv, mask = _loss_inputs(seed)
    loss, metrics = compute_policy_loss_sapo(old, new, adv, mask, tau_pos=1.0, tau_neg=1.05)
    assert loss.item() == pytest.approx(ref_sapo(old, new.detach(), adv, mask, 1.0, 1.05), rel=1e-12)
    assert metrics["actor/pg_clipfrac"].item() == 0
    # At ratio 1, f'(1) = 1 for every tau: the gradient is the unclipped PPO loss's.
    at_old = old.clone().requires_grad_(True)
    sapo, _ = compute_policy_loss_sapo(old, at_old, adv, mask, tau_pos=0.5, tau_neg=3.0)
    ppo, _ = compute_policy_loss(old, at_old, adv, mask, clip_ratio_c=None, loss_agg_mode="seq-mean-token-mean")
    torch.testing.assert_close(torch.autograd.grad(sapo, at_old)[0], torch.autograd.grad(ppo, at_old)[0])


def ref_geo_mean(old, new, adv, mask, low, high):
    losses = []
    for o, n, a, m in zip(old.tolist(), new.tolist(), adv.tolist(), mask.tolist()):
        total, n_valid, adv_sum = 0.0, sum(m), 0.0
        for x, y, ai, k in zip(o, n, a, m):
            d = y - x
            sign = (ai > 0) - (ai < 0)
            clipped = min(max(d, -low), high)
            total += k * sign * min(sign * d, sign * clipped)
            adv_sum += k * ai
        losses.append(-adv_sum / (n_valid + 1e-8) * math.exp(total / (n_valid + 1e-8)))
    return sum(losses) / len(losses)


@pytest.mark.parametrize("seed", range(5))
def test_geo_mean_is_verls(seed):
    old, new, adv, mask = _loss_inputs(seed, scale=0.5)
    loss, metrics = compute_policy_loss_geo_mean(old, new, adv, mask, clip_ratio=0.1, clip_ratio_high=0.2)
    assert loss.item() == pytest.approx(ref_geo_mean(old, new.detach(), adv, mask, 0.1, 0.2), rel=1e-12)
    d = new.detach() - old
    out = (d < -0.1) | (d > 0.2)
    want = ((out & (adv > 0)).double() * mask).sum() / mask.sum()
    assert metrics["actor/pg_clipfrac"].item() == pytest.approx(want.item(), abs=1e-8)


@pytest.mark.parametrize("micro_rows", [B, 2, 1])
def test_geo_mean_micro_batches_rebuild_verls_mean_over_every_row_empty_ones_included(micro_rows):
    """verl 0.9's ``compute_policy_loss_geo_mean`` (``verl/trainer/ppo/core_algos.py``) ends with
    ``torch.mean(pg_losses)``: a row that rejection sampling emptied adds a loss of 0 and still
    counts in the denominator. The registry's weights (``aggregates``, as the update reads them) put
    the micro-batches' losses back together into that one-batch number, however the batch is split."""
    from refppo.algorithms.verl_losses import geo_mean_loss
    from refppo.guards.checks import value_checks
    from refppo.losses import agg_loss_weight
    from refppo.registry import ConfigView

    old, new, adv, mask = _loss_inputs(7, scale=0.5)
    mask[1] = 0.0  # two rows emptied, as sequence-level rejection sampling empties them
    mask[4] = 0.0
    config = ConfigView(clip_ratio=0.2, clip_ratio_low=0.1, clip_ratio_high=0.2)
    mode = POLICY_LOSSES.aggregation("geo_mean", "token-mean")
    total = 0.0
    with value_checks(False):  # as in the update: a micro-batch of one emptied row is no error there
        for rows in torch.arange(B).split(micro_rows):
            loss, _ = geo_mean_loss(old[rows], new[rows], adv[rows], mask[rows], "token-mean", config)
            total += agg_loss_weight(mask[rows], mask, mode) * loss
    assert total.item() == pytest.approx(ref_geo_mean(old, new.detach(), adv, mask, 0.1, 0.2), rel=1e-12)


def test_geo_mean_of_one_token_responses_is_ppos_loss_with_a_sequence_mean():
    """With one token per response, the geometric mean is that token's ratio, and the pessimistic
    log-space clip is PPO's clip: the same loss as PPO's (no dual clip), averaged over sequences."""
    old, new, adv, mask = _loss_inputs(4, scale=0.5)
    one = torch.zeros_like(mask)
    one[:, 0] = 1.0
    geo, _ = compute_policy_loss_geo_mean(old, new, adv, one, clip_ratio=0.1)
    # PPO clips the ratio to [0.9, 1.1]; GMPO the log-ratio to [-0.1, 0.1]: equal bounds in log space
    ppo, _ = compute_policy_loss(
        old,
        new,
        adv,
        one,
        clip_ratio_low=1 - math.exp(-0.1),
        clip_ratio_high=math.exp(0.1) - 1,
        clip_ratio_c=None,
        loss_agg_mode="seq-mean-token-mean",
    )
    torch.testing.assert_close(geo, ppo)
    torch.testing.assert_close(torch.autograd.grad(geo, new)[0], torch.autograd.grad(ppo, new)[0])
