"""The optimal token baselines and GDPO in a PPO step, fed as verl 0.9's ``compute_advantage``
(``verl/trainer/ppo/ray_trainer.py``) feeds them: each token's sum of squared probabilities from the
actor's old-log-prob pass (``actor.calculate_sum_pi_squared``), and GDPO's components from the
reward function's dict results (``algorithm.gdpo_reward_keys``)."""

import math

import numpy as np
import pytest
import torch
from _trainers import make_trainer
from test_trainer_wiring import perturb_rollout_log_probs

from refppo.algorithms.verl_advantages import (
    compute_gdpo_outcome_advantage,
    compute_multi_turn_optimal_token_baseline_advantage,
    compute_optimal_token_baseline_advantage,
)
from refppo.registry import ConfigView
from refppo.rollout.forward import response_logits
from refppo.settings.config import Config, apply_overrides
from refppo.settings.validate import validate
from refppo.training.reward_fns import split_reward_result

GROUPS = ["rollout.n=4", "data.train_batch_size=4", "actor.ppo_mini_batch_size=4"]


def _evaluated(trainer):
    """One step's evaluated batch, the extra scores it was scored with, and its metrics."""
    seen = {}
    evaluate = trainer.evaluate

    def recording(batch, scores, extras, timing):
        stats = evaluate(batch, scores, extras, timing)
        seen["batch"] = batch
        seen["extras"] = extras
        return stats

    trainer.evaluate = recording
    metrics = trainer.train_step()
    return seen["batch"], seen["extras"], metrics


def length_reward(prompts, responses, records):
    return torch.tensor([float(len(r)) for r in responses])


@pytest.mark.parametrize("weighted", [False, True])
@pytest.mark.parametrize(
    "name, fn", [("optimal_token_baseline", compute_optimal_token_baseline_advantage),
                 ("tir_optimal_token_baseline", compute_multi_turn_optimal_token_baseline_advantage)],
)  # fmt: skip
def test_the_optimal_token_baseline_reads_the_actors_sum_of_squared_probabilities(name, fn, weighted):
    """With rollout correction's weights too, which verl squares into the baseline's weights."""
    weights = ["algorithm.rollout_correction.rollout_is=token"] if weighted else []
    trainer = make_trainer(
        [f"algorithm.adv_estimator={name}", "actor.calculate_sum_pi_squared=true", "rollout.temperature=0.7", *GROUPS]
        + weights,
        reward_fn=length_reward,
    )
    if weighted:
        perturb_rollout_log_probs(trainer)
    actor_before = {k: v.clone() for k, v in trainer.actor.state_dict().items()}
    evaluate = trainer.evaluate
    expected = {}

    def before_update(batch, scores, extras, timing):
        # the actor as it sampled: sum_v softmax(logits / T)^2 at each response token, in float64
        with torch.no_grad():
            logits = response_logits(trainer.actor, batch).double() / 0.7
        expected["sum_pi_squared"] = (logits.softmax(-1) ** 2).sum(-1) * batch["response_mask"]
        return evaluate(batch, scores, extras, timing)

    trainer.evaluate = before_update
    batch, _, metrics = _evaluated(trainer)
    assert any(not torch.equal(actor_before[k], v) for k, v in trainer.actor.state_dict().items())
    mask = batch["response_mask"]
    # float32 logits, softmax and log-sum-exp against float64: a few roundings of values <= 1
    torch.testing.assert_close(batch["sum_pi_squared"].double(), expected["sum_pi_squared"], rtol=1e-5, atol=1e-6)
    advantages, returns = fn(
        token_level_rewards=batch["token_level_rewards"],
        response_mask=mask,
        index=batch["index"],
        old_log_probs=batch["old_log_probs"],
        sum_pi_squared=batch["sum_pi_squared"],
        rollout_is_weights=batch.get("rollout_is_weights"),
    )
    assert ("rollout_is_weights" in batch) == weighted
    # verl logs its gradient-variance proxies whenever the batch holds sum_pi_squared. float32: about
    # 4 roundings per token over at most 16 x 4 tokens, 64 x 4 x 2^-24 < 2e-5 relative
    for key, value in plain_variance_proxies(batch, metrics["actor/grad_norm"]).items():
        assert metrics[key] == pytest.approx(value, rel=2e-5, abs=1e-7), key
    assert metrics["variance_proxy/proxy2_total_power"] > 0, "a vacuous check"
    assert torch.equal(batch["advantages"], advantages) and torch.equal(batch["returns"], returns)
    assert bool((advantages != 0).any()), "a vacuous check: every advantage 0"


def plain_variance_proxies(batch, grad_norm):
    """verl 0.9's compute_variance_proxy_metrics (verl/trainer/ppo/metric_utils.py), row by row in
    float64 Python."""
    weights = batch.get("rollout_is_weights")
    a_sq, w_sums, power = [], [], []
    for i, m in enumerate(batch["response_mask"].tolist()):
        old = batch["old_log_probs"][i].tolist()
        spi = batch["sum_pi_squared"][i].tolist()
        adv = batch["advantages"][i].tolist()
        rho = weights[i].tolist() if weights is not None else [1.0] * len(m)
        w = [(1 - 2 * math.exp(o) + s) * r * r for o, s, r in zip(old, spi, rho)]
        a = sum(x * k for x, k in zip(adv, m)) / (sum(m) + 1e-8)
        w_sum = sum(x * k for x, k in zip(w, m))
        if weights is None:
            power.append(a * a * max(w_sum, 0.0))
        else:
            rho_bar = sum(r * k for r, k in zip(rho, m)) / (sum(m) + 1e-8)
            original = max(sum(x / max(r * r, 1e-10) * k for x, r, k in zip(w, rho, m)), 0.0)
            power.append(rho_bar**2 * a * a * original)
        a_sq.append(a * a)
        w_sums.append(w_sum)
    n = len(a_sq)
    proxy2 = sum(power) / n
    signal = grad_norm**2
    return {
        "variance_proxy/proxy1_signal_strength": signal,
        "variance_proxy/proxy2_total_power": proxy2,
        "variance_proxy/proxy3_pure_noise": max(0.0, (proxy2 - signal) / (n - 1)),
        "variance_proxy/expected_a_squared": sum(a_sq) / n,
        "variance_proxy/expected_w": sum(w_sums) / n,
    }


def components(prompts, responses, records):
    """A verl-style reward function's dict results: two components on very different scales."""
    length = torch.tensor([float(len(r)) for r in responses])
    first = torch.tensor([float(r[:1] == "7") for r in responses])
    return {"score": 100 * length + first, "length_reward": 100 * length, "seven_reward": first}


@pytest.mark.parametrize("weights", [None, "[1.0,3.0]"])
def test_gdpo_normalises_the_reward_functions_components_one_by_one(weights):
    settings = ["algorithm.adv_estimator=gdpo", "algorithm.gdpo_reward_keys=[length_reward,seven_reward]", *GROUPS]
    if weights:
        settings.append(f"algorithm.gdpo_reward_weights={weights}")
    trainer = make_trainer(settings, reward_fn=components)
    batch, extras, metrics = _evaluated(trainer)
    assert set(extras) >= {"length_reward", "seven_reward"}
    config = ConfigView(vars(trainer.config.algorithm))
    advantages, _ = compute_gdpo_outcome_advantage(
        token_level_rewards=batch["token_level_rewards"],
        response_mask=batch["response_mask"],
        index=batch["index"],
        config=config,
        non_tensor_batch={k: extras[k] for k in ("length_reward", "seven_reward")},
        batch=batch,
    )
    assert torch.equal(batch["advantages"], advantages)
    assert bool((advantages != 0).any()), "a vacuous check: every advantage 0"
    for key in ("length_reward", "seven_reward"):  # verl's gdpo/<key>/*, numpy's population std
        values = extras[key].double().numpy()
        assert metrics[f"gdpo/{key}/std"] == pytest.approx(values.std(), rel=1e-6)
        assert metrics[f"gdpo/{key}/mean"] == pytest.approx(values.mean(), rel=1e-6)
        assert (metrics[f"gdpo/{key}/max"], metrics[f"gdpo/{key}/min"]) == (values.max(), values.min())


@pytest.mark.parametrize(
    "settings, message",
    [
        (["algorithm.adv_estimator=optimal_token_baseline"], "set actor.calculate_sum_pi_squared=true"),
        (
            ["actor.calculate_sum_pi_squared=true", "algorithm.rollout_correction.bypass_mode=true"],
            "actor.calculate_sum_pi_squared=true is ignored: .*bypass_mode=false",
        ),
        (
            ["actor.calculate_sum_pi_squared=true", "model.use_fused_kernels=true"],
            "the fused kernels never form the logits",
        ),
        (["algorithm.adv_estimator=gdpo"], "gdpo needs algorithm.gdpo_reward_keys"),
        (
            ["algorithm.adv_estimator=gdpo", "algorithm.gdpo_reward_keys=[a,b]", "algorithm.gdpo_reward_weights=[1.0]"],
            "has 1 weights for 2 algorithm.gdpo_reward_keys",
        ),
        (
            ["algorithm.gdpo_reward_keys=[a]"],
            "algorithm.gdpo_reward_keys=.* is ignored: .*algorithm.adv_estimator=gdpo",
        ),
    ],
)
def test_what_the_estimators_need_is_checked_before_any_work(settings, message):
    with pytest.raises(ValueError, match=message):
        validate(apply_overrides(Config(), settings))


def test_a_result_gives_the_score_and_verls_reward_extra_info():
    """As verl's reward managers (``NaiveRewardManager``, ``DAPORewardManager``): a dict result keeps
    each entry, ``score`` included; a plain score is also ``acc``."""
    result = {"score": [1.0, 2.0], "acc": [1, 0], "pred": ["12", "7"]}  # a parsed answer is verl's, for its logs
    scores, parts = split_reward_result(result, 2, "fn")
    assert scores.tolist() == [1.0, 2.0] and list(parts) == ["score", "acc"] and parts["acc"].tolist() == [1.0, 0.0]
    scores, parts = split_reward_result([0.5, 1.0], 2, "fn")
    assert list(parts) == ["acc"] and parts["acc"].tolist() == scores.tolist() == [0.5, 1.0]
    # numpy's numbers, as a verl compute_score often returns them, are components too
    numpy_result = {"score": [1.0, 2.0], "acc": [np.float32(0.5), np.int64(1)], "ok": [np.bool_(True), False]}
    _, parts = split_reward_result(numpy_result, 2, "fn")
    assert parts["acc"].tolist() == [0.5, 1.0] and parts["ok"].tolist() == [1.0, 0.0]
    with pytest.raises(ValueError, match="fn's 'acc' returned shape"):
        split_reward_result({"score": [1.0, 2.0], "acc": [1.0]}, 2, "fn")
