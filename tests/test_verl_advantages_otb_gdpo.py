"""GDPO and the optimal token baseline (single- and multi-turn), verl 0.9's ``gdpo``,
``optimal_token_baseline`` and ``tir_optimal_token_baseline``, and the sum of squared probabilities
the baseline reads: each against a plain float64 reference that follows verl's code line by line
(loops over groups and positions), on random inputs with uneven groups, groups of one, rows of
different lengths, holes, empty rows, a unique longest row and tied longest rows."""

import math
import types
from collections import defaultdict

import numpy as np
import pytest
import torch
from _tolerances import U32, reordered

from refppo.advantages import ADV_ESTIMATORS, compute_advantage, compute_grpo_outcome_advantage, get_adv_estimator_fn
from refppo.algorithms.verl_advantages import (
    compute_gdpo_outcome_advantage,
    compute_multi_turn_optimal_token_baseline_advantage,
    compute_optimal_token_baseline_advantage,
)
from refppo.functional import calculate_sum_pi_squared_from_logits, masked_whiten
from refppo.registry import ConfigView
from refppo.settings.config import Config

T = 8
# uneven groups: 4, 3, 2, 1, and "e", two rows of which one is empty (in the multi-turn form a group of one)
INDEX = ["a", "b", "a", "c", "b", "a", "d", "b", "a", "c", "e", "e"]
B = len(INDEX)
EXACT = dict(rtol=1e-12, atol=1e-12)  # float64 against float64: the same operations up to their order


def _inputs(seed, holes=True):
    """Rewards, mask (with tool-output holes), old log-probs, sum pi^2 and IS weights, and each row's
    length with its padding (what verl's attention mask covers)."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, T, (B,), generator=g)
    lengths[[0, 2, 5, 8]] = torch.tensor([T, 5, 3, 5])  # group a: a unique longest row (T), then 5, 5, 3
    lengths[[1, 4, 7]] = torch.tensor([6, 6, 2])  # group b: two longest rows tie
    lengths[11] = 0  # group e: an empty response
    attention = (torch.arange(T)[None, :] < lengths[:, None]).double()
    mask = attention.clone()
    if holes:  # tokens the policy did not generate (a tool's output), never a row's last
        mask[0, 2:4] = 0.0
        mask[1, 1] = 0.0
        mask[3, 0] = 0.0
    rewards = torch.randn(B, T, generator=g, dtype=torch.float64) * attention
    old_log_probs = -3 * torch.rand(B, T, generator=g, dtype=torch.float64)
    pi = old_log_probs.exp()  # sum pi^2 lies in [pi_t^2, 1], so that w_t = 1 - 2 pi_t + sum pi^2 >= 0, as real ones
    sum_pi_squared = pi**2 + torch.rand(B, T, generator=g, dtype=torch.float64) * (1 - pi**2)
    is_weights = 2 * torch.rand(B, T, generator=g, dtype=torch.float64)
    return g, rewards, mask, old_log_probs, sum_pi_squared, is_weights, attention


# ---- the references: verl 0.9's code as loops over floats -----------------------------------
def ref_grpo(rows, mask, index, epsilon, norm):
    """verl's compute_grpo_outcome_advantage: a group of one has mean 0 and std 1."""
    scores = [sum(row) for row in rows]
    id2score = defaultdict(list)
    for i in range(len(scores)):
        id2score[index[i]].append(scores[i])
    id2mean, id2std = {}, {}
    for idx, group in id2score.items():
        if len(group) == 1:
            id2mean[idx], id2std[idx] = 0.0, 1.0
        else:
            mean = sum(group) / len(group)
            id2mean[idx] = mean
            id2std[idx] = math.sqrt(sum((s - mean) ** 2 for s in group) / (len(group) - 1))  # torch.std
    for i in range(len(scores)):
        if norm:
            scores[i] = (scores[i] - id2mean[index[i]]) / (id2std[index[i]] + epsilon)
        else:
            scores[i] = scores[i] - id2mean[index[i]]
    return [[s * k for k in m] for s, m in zip(scores, mask)]


def ref_masked_whiten(rows, mask):
    """verl_F.masked_whiten: the mean as sum / (count + 1e-8), the variance likewise with Bessel's
    correction, then (x - mean) * rsqrt(var + 1e-8)."""
    count = sum(sum(m) for m in mask)
    mean = sum(x * k for row, m in zip(rows, mask) for x, k in zip(row, m)) / (count + 1e-8)
    var = sum((x - mean) ** 2 * k for row, m in zip(rows, mask) for x, k in zip(row, m)) / (count + 1e-8)
    var = var * count / (count - 1)
    return [[(x - mean) / math.sqrt(var + 1e-8) for x in row] for row in rows]


def ref_gdpo(rewards, mask, attention, index, components, weights, epsilon, norm):
    """verl's compute_gdpo_outcome_advantage; ``components`` None: its fallback."""
    mask, rewards = mask.tolist(), rewards.tolist()
    if components is None:
        score_list = [rewards]
    else:
        valid_response_length = [int(sum(a)) - 1 for a in attention.tolist()]  # attention sum - 1
        score_list = []
        for comp in components:
            rm_scores = [[0.0] * T for _ in range(B)]
            for i in range(B):
                rm_scores[i][valid_response_length[i]] = float(comp[i])  # -1 (an empty row): the last column
            score_list.append(rm_scores)
    if weights is None:
        weights = [1.0] * len(score_list)
    new_advantage = None
    for i in range(len(score_list)):
        normalized = ref_grpo(score_list[i], mask, index, epsilon, norm)
        weighted = [[weights[i] * x for x in row] for row in normalized]
        if new_advantage is None:
            new_advantage = weighted
        else:
            new_advantage = [[a + b for a, b in zip(r1, r2)] for r1, r2 in zip(new_advantage, weighted)]
    whitened = ref_masked_whiten(new_advantage, mask)
    return [[x * k for x, k in zip(row, m)] for row, m in zip(whitened, mask)]


def _returns_and_w(rewards, mask, old_log_probs, sum_pi_squared, is_weights):
    """Both forms' first steps: reward-to-go, w_t = (1 - 2 pi_t + sum pi^2) rho_t^2 and its cumulative sum."""
    r, m, lp, sp = rewards.tolist(), mask.tolist(), old_log_probs.tolist(), sum_pi_squared.tolist()
    rho = is_weights.tolist() if is_weights is not None else None
    returns = [[sum(r[i][s] * m[i][s] for s in range(t, T)) for t in range(T)] for i in range(B)]
    w_cumulative = []
    for i in range(B):
        running, row = 0.0, []
        for t in range(T):
            w = 1 - 2 * math.exp(lp[i][t]) + sp[i][t]
            if rho is not None:
                w = w * rho[i][t] ** 2
            running += w * m[i][t]
            row.append(running)
        w_cumulative.append(row)
    return returns, w_cumulative, m


def _zero_tail(baselines, rows, lengths):
    """verl's handle_zero_tail: the unique longest row's baseline is 0 from the next longest length on."""
    sorted_lengths = sorted(lengths)
    max_length, second_max_length = int(sorted_lengths[-1]), int(sorted_lengths[-2])
    at_max = [j for j, n in enumerate(lengths) if n == max_length]
    if len(at_max) == 1 and max_length > second_max_length:
        for t in range(second_max_length, len(baselines[rows[at_max[0]]])):
            baselines[rows[at_max[0]]][t] = 0.0


def ref_otb(rewards, mask, index, old_log_probs, sum_pi_squared, is_weights, handle_zero_tail, epsilon=1e-8):
    """verl's compute_optimal_token_baseline_advantage."""
    returns, w_cumulative, m = _returns_and_w(rewards, mask, old_log_probs, sum_pi_squared, is_weights)
    prompt_groups = defaultdict(list)
    for i in range(B):
        prompt_groups[index[i]].append(i)
    baselines = [[0.0] * T for _ in range(B)]
    for rows in prompt_groups.values():
        if len(rows) == 1:
            continue
        for t in range(T):
            numerator = sum(returns[i][t] * w_cumulative[i][t] * m[i][t] for i in rows)
            denominator = sum(w_cumulative[i][t] * m[i][t] for i in rows) + epsilon
            for i in rows:
                baselines[i][t] = numerator / denominator
        if handle_zero_tail:
            _zero_tail(baselines, rows, [sum(m[i]) for i in rows])
    advantages = [[(returns[i][t] - baselines[i][t]) * m[i][t] for t in range(T)] for i in range(B)]
    return advantages, returns


def ref_tir_otb(rewards, mask, index, old_log_probs, sum_pi_squared, is_weights, handle_zero_tail, epsilon=1e-8):
    """verl's compute_multi_turn_optimal_token_baseline_advantage: each row's valid tokens packed to
    the left, empty rows in no group."""
    returns, w_cumulative, m = _returns_and_w(rewards, mask, old_log_probs, sum_pi_squared, is_weights)
    lengths = [int(sum(row)) for row in m]
    width = max(lengths)
    all_w = [[0.0] * width for _ in range(B)]
    all_returns = [[0.0] * width for _ in range(B)]
    for i in range(B):
        valid = [t for t in range(T) if m[i][t]]
        for k, t in enumerate(valid):
            all_w[i][k] = w_cumulative[i][t]
            all_returns[i][k] = returns[i][t]
    prompt_groups = defaultdict(list)
    for i in range(B):
        if lengths[i] == 0:
            continue
        prompt_groups[index[i]].append(i)
    baselines = [[0.0] * width for _ in range(B)]
    for rows in prompt_groups.values():
        if len(rows) == 1:
            continue
        for k in range(width):
            b_star = sum(all_returns[i][k] * all_w[i][k] for i in rows) / (sum(all_w[i][k] for i in rows) + epsilon)
            for i in rows:
                baselines[i][k] = b_star
        if handle_zero_tail:
            _zero_tail(baselines, rows, [lengths[i] for i in rows])
    advantages = [[0.0] * T for _ in range(B)]
    for i in range(B):
        valid = [t for t in range(T) if m[i][t]]
        for k, t in enumerate(valid):
            advantages[i][t] = all_returns[i][k] - baselines[i][k]
    return [[a * k for a, k in zip(row, mr)] for row, mr in zip(advantages, m)], returns


def _t(rows):
    return torch.tensor(rows, dtype=torch.float64)


# ---- GDPO ---------------------------------------------------------------------------------
def _components(g):
    """Three reward components, as a reward function's dict results arrive: a list of floats, a
    NumPy array and a tensor, on different scales."""
    fmt = [float(x) for x in torch.randint(0, 2, (B,), generator=g)]
    acc = 10 * torch.rand(B, generator=g, dtype=torch.float64).numpy()
    length = torch.randn(B, generator=g, dtype=torch.float64) * 0.1
    return {"format_reward": fmt, "accuracy_reward": acc, "length_reward": length, "score": np.zeros(B)}


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("norm", [True, False])
@pytest.mark.parametrize("weights", [None, [1.0, 0.5, -2.0]])
def test_gdpo_is_verls(seed, norm, weights):
    g, rewards, mask, *_, attention = _inputs(seed)
    non_tensor_batch = _components(g)
    keys = ["format_reward", "accuracy_reward", "length_reward"]
    config = ConfigView(gdpo_reward_keys=keys, gdpo_reward_weights=weights)
    adv, ret = compute_gdpo_outcome_advantage(
        rewards, mask, INDEX, norm_adv_by_std_in_grpo=norm, config=config, non_tensor_batch=non_tensor_batch
    )
    components = [non_tensor_batch[k] for k in keys]
    want = ref_gdpo(rewards, mask, attention, INDEX, components, weights, 1e-6, norm)
    torch.testing.assert_close(adv, _t(want), **EXACT)
    assert ret is adv


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("norm", [True, False])
def test_gdpo_without_components_is_verls_fallback_whitened_grpo(seed, norm):
    """No non_tensor_batch: token_level_rewards is the one component, as in verl; then GDPO is
    GRPO's advantage whitened over the batch."""
    _, rewards, mask, *_, attention = _inputs(seed)
    adv, _ = compute_gdpo_outcome_advantage(rewards, mask, INDEX, norm_adv_by_std_in_grpo=norm)
    torch.testing.assert_close(adv, _t(ref_gdpo(rewards, mask, attention, INDEX, None, None, 1e-6, norm)), **EXACT)
    grpo, _ = compute_grpo_outcome_advantage(rewards, mask, INDEX, norm_adv_by_std_in_grpo=norm)
    torch.testing.assert_close(adv, masked_whiten(grpo, mask) * mask, **EXACT)
    # a config that names no component changes nothing (verl's direct call with config and no batch)
    same, _ = compute_gdpo_outcome_advantage(rewards, mask, INDEX, norm_adv_by_std_in_grpo=norm, config=ConfigView())
    assert torch.equal(same, adv)


def test_gdpo_keeps_a_small_component_that_grpo_on_the_sum_drowns():
    """The paper's point: normalised apart, a component with a small spread moves the advantage as
    much as one with a large spread; GRPO on their sum barely sees it."""
    mask = torch.ones(4, 3, dtype=torch.float64)
    big = torch.tensor([100.0, -100.0, 100.0, -100.0], dtype=torch.float64)
    small = torch.tensor([0.01, 0.01, -0.01, -0.01], dtype=torch.float64)
    config = ConfigView(gdpo_reward_keys=["big", "small"])
    adv, _ = compute_gdpo_outcome_advantage(
        torch.zeros(4, 3), mask, [0, 0, 0, 0], config=config, non_tensor_batch={"big": big, "small": small}
    )
    assert adv[0, 0] > adv[1, 0] and adv[2, 0] > adv[3, 0] and (adv[0, 0] - adv[2, 0]) > 0.5


@pytest.mark.parametrize(
    "config, non_tensor_batch, message",
    [
        (None, {"acc": [1.0] * B}, "gdpo needs gdpo_reward_keys"),
        (ConfigView(gdpo_reward_keys=[]), {"acc": [1.0] * B}, "gdpo needs gdpo_reward_keys"),
        (ConfigView(gdpo_reward_keys="acc"), {"acc": [1.0] * B}, "gdpo_reward_keys must be a list of names"),
        (ConfigView(gdpo_reward_keys=["acc"]), None, "no non_tensor_batch holds their scores"),
        (ConfigView(gdpo_reward_weights=[1.0]), None, "no non_tensor_batch holds their scores"),
        (ConfigView(gdpo_reward_keys=["acc", "fmt"]), {"acc": [1.0] * B}, "'fmt' is not in non_tensor_batch"),
        (
            ConfigView(gdpo_reward_keys=["acc", "fmt"], gdpo_reward_weights=[1.0]),
            {"acc": [1.0] * B, "fmt": [0.0] * B},
            "gdpo_reward_weights has 1 weights but gdpo_reward_keys names 2 components",
        ),
        (
            ConfigView(gdpo_reward_keys=["acc"], gdpo_reward_weights=[math.nan]),
            {"acc": [1.0] * B},
            "gdpo_reward_weights\\['acc'\\] must be in",
        ),
        (ConfigView(gdpo_reward_keys=["acc"]), {"acc": [1.0] * (B - 1)}, r"non_tensor_batch\['acc'\] must hold one"),
        (ConfigView(gdpo_reward_keys=["acc"]), {"acc": ["right"] * B}, r"non_tensor_batch\['acc'\] must hold one"),
        (ConfigView(gdpo_reward_keys=["acc"]), {"acc": [None] * B}, r"non_tensor_batch\['acc'\] contains NaN or inf"),
        (
            ConfigView(gdpo_reward_keys=["acc"]),
            {"acc": [1.0] * (B - 1) + [math.inf]},
            r"non_tensor_batch\['acc'\] contains NaN or inf",
        ),
        (
            ConfigView(gdpo_reward_keys=["acc"]),
            {"acc": torch.full((B,), math.nan)},
            r"non_tensor_batch\['acc'\] contains NaN or inf",
        ),
    ],
)
def test_gdpo_refuses_what_it_cannot_read_naming_it(config, non_tensor_batch, message):
    _, rewards, mask, *_ = _inputs(0)
    with pytest.raises(ValueError, match=message):
        compute_gdpo_outcome_advantage(rewards, mask, INDEX, config=config, non_tensor_batch=non_tensor_batch)


# ---- the optimal token baseline -------------------------------------------------------------
@pytest.mark.parametrize(
    "estimator, reference",
    [
        (compute_optimal_token_baseline_advantage, ref_otb),
        (compute_multi_turn_optimal_token_baseline_advantage, ref_tir_otb),
    ],
    ids=["optimal_token_baseline", "tir_optimal_token_baseline"],
)
@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("with_is", [False, True])
@pytest.mark.parametrize("handle_zero_tail", [True, False])
@pytest.mark.parametrize("holes", [True, False])
def test_optimal_token_baselines_are_verls(estimator, reference, seed, with_is, handle_zero_tail, holes):
    _, rewards, mask, lp, sp, isw, _ = _inputs(seed, holes)
    isw = isw if with_is else None
    adv, ret = estimator(rewards, mask, INDEX, lp, sp, rollout_is_weights=isw, handle_zero_tail=handle_zero_tail)
    want_adv, want_ret = reference(rewards, mask, INDEX, lp, sp, isw, handle_zero_tail)
    torch.testing.assert_close(ret, _t(want_ret), **EXACT)
    torch.testing.assert_close(adv, _t(want_adv), **EXACT)


@pytest.mark.parametrize("epsilon", [1e-8, 0.5])
def test_the_epsilon_is_verls(epsilon):
    _, rewards, mask, lp, sp, isw, _ = _inputs(7)
    for fn, ref in (
        (compute_optimal_token_baseline_advantage, ref_otb),
        (compute_multi_turn_optimal_token_baseline_advantage, ref_tir_otb),
    ):
        adv, _ = fn(rewards, mask, INDEX, lp, sp, rollout_is_weights=isw, epsilon=epsilon)
        torch.testing.assert_close(adv, _t(ref(rewards, mask, INDEX, lp, sp, isw, True, epsilon)[0]), **EXACT)


def test_the_two_forms_agree_without_holes_or_empty_rows_and_the_cut_is_where_verl_puts_it():
    """Without holes or empty responses the multi-turn form packs nothing: both forms agree. A group
    of one keeps its returns; the unique longest row of group a has baseline 0 past the next
    longest (5 tokens), so its advantage there is its return, and group b's tied rows are not cut."""
    _, rewards, mask, lp, sp, _, _ = _inputs(3, holes=False)
    index = INDEX[:-1] + ["f"]  # the empty row alone
    single, returns = compute_optimal_token_baseline_advantage(rewards, mask, index, lp, sp)
    multi, _ = compute_multi_turn_optimal_token_baseline_advantage(rewards, mask, index, lp, sp)
    torch.testing.assert_close(single, multi, **EXACT)
    torch.testing.assert_close(single[[6, 10]], returns[[6, 10]] * mask[[6, 10]])  # groups of one: d and e
    assert torch.equal(single[0, 5:], returns[0, 5:]) and not torch.equal(single[0, 4], returns[0, 4])
    uncut, _ = compute_optimal_token_baseline_advantage(rewards, mask, index, lp, sp, handle_zero_tail=False)
    torch.testing.assert_close(uncut[0, 5:], torch.zeros(T - 5, dtype=torch.float64), atol=1e-6, rtol=0)
    assert torch.equal(uncut[[1, 4, 7]], single[[1, 4, 7]])


def test_optimal_token_baseline_refuses_bad_input_naming_it():
    _, rewards, mask, lp, sp, isw, _ = _inputs(0)
    for fn in (compute_optimal_token_baseline_advantage, compute_multi_turn_optimal_token_baseline_advantage):
        with pytest.raises(ValueError, match="sum_pi_squared contains NaN or inf"):
            fn(rewards, mask, INDEX, lp, torch.full_like(sp, math.nan))
        with pytest.raises(ValueError, match="sum_pi_squared has a negative entry"):
            fn(rewards, mask, INDEX, lp, -sp)
        with pytest.raises(ValueError, match="rollout_is_weights has a negative entry"):
            fn(rewards, mask, INDEX, lp, sp, rollout_is_weights=-isw)
        with pytest.raises(ValueError, match="shape mismatch: sum_pi_squared"):
            fn(rewards, mask, INDEX, lp, sp[:, :-1])
        with pytest.raises(ValueError, match=r"epsilon must be in \(0, inf\)"):
            fn(rewards, mask, INDEX, lp, sp, epsilon=0.0)
        with pytest.raises(ValueError, match="handle_zero_tail must be True or False"):
            fn(rewards, mask, INDEX, lp, sp, handle_zero_tail="false")
        with pytest.raises(ValueError, match="index has 11 entries but the batch has 12 rows"):
            fn(rewards, mask, INDEX[:-1], lp, sp)
        with pytest.raises(ValueError, match="response_mask must contain only 0 and 1"):
            fn(rewards, mask * 2, INDEX, lp, sp)
        # padding is never read: NaN there changes nothing
        padded = lp.masked_fill(~mask.bool(), math.nan)
        assert torch.equal(fn(rewards, mask, INDEX, padded, sp)[0], fn(rewards, mask, INDEX, lp, sp)[0])


# ---- sum of squared probabilities -------------------------------------------------------------
def ref_sum_pi_squared(logits, temperature):
    """verl's actor: logits / temperature, then sum_v softmax^2 (written out)."""
    out = []
    for row in logits.reshape(-1, logits.shape[-1]).tolist():
        z = [x / temperature for x in row]
        top = max(z)
        e = [math.exp(x - top) for x in z]
        total = sum(e)
        out.append(sum((x / total) ** 2 for x in e))
    return torch.tensor(out, dtype=torch.float64).reshape(logits.shape[:-1])


@pytest.mark.parametrize("temperature", [1.0, 0.6, 1.7])
def test_sum_pi_squared_is_verls(temperature):
    g = torch.Generator().manual_seed(int(temperature * 10))
    vocab = 50
    logits = 4 * torch.randn(3, 5, vocab, generator=g, dtype=torch.float64)
    logits[0, 0, 7] = 40.0  # a near one-hot distribution: sum pi^2 close to 1
    want = ref_sum_pi_squared(logits, temperature)
    torch.testing.assert_close(calculate_sum_pi_squared_from_logits(logits, temperature), want, **EXACT)
    assert want[0, 0] > 0.99 and bool((want >= 1 / vocab).all())
    # in float32, from float32 logits: each logit rounds (u), is divided (u) and doubled; the two
    # logsumexps, L1 and L2, sum `vocab` positive terms and each rounds (u |L|); exp then turns the
    # absolute error of L2 - 2 L1 into a relative one
    got = calculate_sum_pi_squared_from_logits(logits.float(), temperature)
    assert got.dtype == torch.float32
    z = logits / temperature
    l1, l2 = torch.logsumexp(z, -1), torch.logsumexp(2 * z, -1)
    bound = 2 * U32 * (4 * z.abs().amax(-1) + l2.abs() + 2 * l1.abs()) + 3 * reordered(vocab)
    assert bool(((got.double() - want).abs() <= bound * want).all())


def test_sum_pi_squared_refuses_non_finite_logits():
    logits = torch.randn(2, 3, 5)
    logits[1, 2, 0] = math.inf
    with pytest.raises(ValueError, match="logits contains NaN or inf"):
        calculate_sum_pi_squared_from_logits(logits)
    with pytest.raises(ValueError, match="temperature must be in"):
        calculate_sum_pi_squared_from_logits(torch.randn(2, 3, 5), 0.0)


# ---- the registry -----------------------------------------------------------------------------
def test_each_is_found_by_verls_name_and_compute_advantage_needs_its_batch_keys():
    assert get_adv_estimator_fn("gdpo") is compute_gdpo_outcome_advantage
    assert get_adv_estimator_fn("optimal_token_baseline") is compute_optimal_token_baseline_advantage
    assert get_adv_estimator_fn("tir_optimal_token_baseline") is compute_multi_turn_optimal_token_baseline_advantage
    assert ADV_ESTIMATORS.readers("gdpo_reward_keys") == ("gdpo",)
    assert ADV_ESTIMATORS.readers("gdpo_reward_weights") == ("gdpo",)
    _, rewards, mask, *_ = _inputs(0)
    data = {"token_level_rewards": rewards, "response_mask": mask, "index": INDEX}
    algorithm = Config().algorithm
    for name in ("optimal_token_baseline", "tir_optimal_token_baseline"):
        with pytest.raises((TypeError, ValueError), match="sum_pi_squared"):
            compute_advantage(data, name, get_adv_estimator_fn(name), algorithm)
    # GDPO asked for its components without them in the batch is refused, not run on the score alone
    with_keys = types.SimpleNamespace(**(vars(algorithm) | {"gdpo_reward_keys": ["accuracy_reward"]}))
    with pytest.raises(ValueError, match="non_tensor_batch"):
        compute_advantage(data, "gdpo", get_adv_estimator_fn("gdpo"), with_keys)
