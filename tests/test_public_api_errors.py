"""The README's promise, for every public function of the math modules: bad input raises a
ValueError naming the problem, never a torch error, a NaN or a wrong number.

Each public function has a valid call in ``GOOD``. The bad inputs are made from its signature:
for every tensor argument a wrong shape, a tensor on the meta device, NaN (values) or 0.5 and 2
(masks), a float dtype (token ids); for every number NaN, inf, -1, a string and None; for every
flag the string "false"; for every name an unknown one. ``VALID`` lists the few of these that are
valid input (a negative KL, an infinite threshold), each with its reason. A public function
missing from ``GOOD`` fails the first test.
"""

import inspect
import math

import pytest
import torch

from refppo import advantages, functional, kl, losses, rewards
from refppo.algorithms import bypass, divergence_losses, overlong, rollout_correction, verl_advantages, verl_losses
from refppo.guards import inputs
from refppo.guards.checks import NonFiniteError
from refppo.registry import ConfigView
from refppo.settings.config import Config, apply_overrides

POLICY_LOSS_NAMES = (
    "clip",
    "penalty",
    "cispo",
    "gpg",
    "clip_cov",
    "kl_cov",
    "dppo_tv",
    "dppo_kl",
    "dro",
    "gspo",
    "sapo",
    "geo_mean",
)

MODULES = (
    functional,
    advantages,
    verl_advantages,
    losses,
    verl_losses,
    divergence_losses,
    kl,
    rewards,
    overlong,
    rollout_correction,
    bypass,
    inputs,
)
B, T = 3, 4


def _public(module):
    for name, obj in vars(module).items():
        if name.startswith("_") or getattr(obj, "__module__", None) != module.__name__:
            continue
        if inspect.isfunction(obj):
            yield name, obj
        elif inspect.isclass(obj) and not issubclass(obj, Exception):
            yield name, obj
            yield f"{name}.update", obj.update


def _x(seed=0):
    return torch.randn(B, T, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def _mask():
    return torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0], [1, 1, 1, 1]], dtype=torch.float64)


def _lp(seed):
    return -_x(seed).abs()


def _pair(**extra):
    return dict(old_log_prob=_lp(1), log_prob=_lp(2), advantages=_x(3), response_mask=_mask(), **extra)


def _loss_config():
    return losses.policy_loss_config(apply_overrides(Config(), ["actor.dro_beta=0.5"]).actor, loss_scale_factor=8.0)


# bypass mode's settings: REINFORCE with token weights and a token-k1 rejection
_BYPASS = {
    "loss_type": "reinforce",
    "rollout_is": "token",
    "rollout_is_threshold": 2.0,
    "rollout_rs": "token_k1",
    "rollout_rs_threshold": "0.5_2.0",
}


def _verl_pair(loss_agg_mode="token-mean"):
    """verl's policy-loss keywords."""
    return _pair(loss_agg_mode=loss_agg_mode, config=_loss_config(), rollout_is_weights=_x(4).abs())


def _verl_pair_by_sequence():
    return _verl_pair("seq-mean-token-mean")


def _verl_estimator(**extra):
    """verl's generic estimator keywords."""
    config = ConfigView(vars(Config().algorithm))
    return dict(token_level_rewards=_x(1), response_mask=_mask(), config=config, index=["a", "a", "b"], **extra)


def _controller(cls, *args):
    return lambda **kw: cls(*args).update(**kw)


# name -> keyword arguments of a valid call (a method: the arguments of the method, on an instance
# made with valid arguments)
GOOD = {
    "masked_sum": lambda: dict(values=_x(), mask=_mask(), axis=None),
    "masked_mean": lambda: dict(values=_x(), mask=_mask(), axis=-1),
    "masked_var": lambda: dict(values=_x(), mask=_mask(), unbiased=True),
    "masked_whiten": lambda: dict(values=_x(), mask=_mask(), shift_mean=True),
    "masked_max_min": lambda: dict(values=_x(), mask=_mask()),
    "last_valid_index": lambda: dict(mask=_mask()),
    "logprobs_from_logits": lambda: dict(
        logits=torch.randn(B, T, 7), labels=torch.randint(0, 7, (B, T)), temperature=0.7
    ),
    "entropy_from_logits": lambda: dict(logits=torch.randn(B, T, 7), temperature=0.7),
    "calculate_sum_pi_squared_from_logits": lambda: dict(logits=torch.randn(B, T, 7), temperature=0.7),
    "check_masked": lambda: dict(values=_x(), mask=_mask(), axis=-1, min_valid=2),
    "check_logits": lambda: dict(logits=torch.randn(B, T, 7), labels=torch.randint(0, 7, (B, T)), temperature=0.7),
    "check_labels": lambda: dict(labels=torch.randint(0, 7, (B, T)), shape=torch.Size((B, T)), vocab=7),
    "check_log_probs": lambda: dict(picked=-torch.rand(B, T), labels=torch.randint(0, 7, (B, T)), vocab=7),
    "work_dtype": lambda: dict(),
    "checked_return_inputs": lambda: dict(token_level_rewards=_x(1), response_mask=_mask(), gamma=0.99),
    "check_outcome_inputs": lambda: dict(token_level_rewards=_x(1), response_mask=_mask(), min_valid=2),
    "group_ids": lambda: dict(index=["a", "a", "b"], batch=B, device=torch.device("cpu")),
    "check_score_inputs": lambda: dict(scores=torch.randn(B), response_mask=_mask()),
    "check_kl_update": lambda: dict(current_kl=0.1, n_steps=4),
    "checked_gae_inputs": lambda: dict(
        token_level_rewards=_x(1), values=_x(2), response_mask=_mask(), gamma=0.99, lam=0.95
    ),
    "compute_gae_advantage_return": lambda: dict(
        token_level_rewards=_x(1), values=_x(2), response_mask=_mask(), gamma=0.99, lam=0.95
    ),
    "compute_grpo_outcome_advantage": lambda: dict(
        token_level_rewards=_x(1),
        response_mask=_mask(),
        index=["a", "a", "b"],
        epsilon=1e-6,
        norm_adv_by_std_in_grpo=True,
    ),
    "compute_rloo_outcome_advantage": lambda: dict(
        token_level_rewards=_x(1), response_mask=_mask(), index=torch.tensor([0, 0, 1])
    ),
    "compute_reinforce_plus_plus_outcome_advantage": lambda: dict(
        token_level_rewards=_x(1), response_mask=_mask(), gamma=0.99
    ),
    "compute_reinforce_plus_plus_baseline_outcome_advantage": lambda: dict(
        token_level_rewards=_x(1), response_mask=_mask(), index=["a", "a", "b"]
    ),
    "compute_gpg_outcome_advantage": lambda: dict(
        token_level_rewards=_x(1), response_mask=_mask(), index=torch.tensor([0, 0, 1])
    ),
    "compute_opo_outcome_advantage": lambda: dict(
        token_level_rewards=_x(1), response_mask=_mask(), index=torch.tensor([0, 0, 1])
    ),
    "compute_grpo_passk_outcome_advantage": lambda: dict(
        token_level_rewards=_x(1),
        response_mask=_mask(),
        index=["a", "a", "a"],
        epsilon=1e-6,
        norm_adv_by_std_in_grpo=True,
    ),
    "compute_remax_outcome_advantage": lambda: dict(
        token_level_rewards=_x(1), reward_baselines=torch.randn(B), response_mask=_mask()
    ),
    "needs_critic": lambda: dict(adv_estimator="gae"),
    "group_scores": lambda: dict(token_level_rewards=_x(1), response_mask=_mask(), index=["a", "a", "b"], min_valid=2),
    "group_mean": lambda: dict(count=torch.tensor([2.0, 2.0, 1.0]), total=torch.tensor([0.5, 0.5, 3.0])),
    "compute_advantage": lambda: dict(
        data=dict(token_level_rewards=_x(1), response_mask=_mask(), index=["a", "a", "b"]),
        adv_estimator="grpo",
        adv_estimator_fn=advantages.get_adv_estimator_fn("grpo"),
        config=Config().algorithm,
    ),
    **{
        name: _verl_estimator
        for name in (
            "grpo_vectorized_advantage",
            "rloo_advantage",
            "reinforce_plus_plus_advantage",
            "reinforce_plus_plus_baseline_advantage",
            "gpg_advantage",
            "opo_advantage",
        )
    },
    "grpo_passk_advantage": lambda: _verl_estimator() | {"index": ["a", "a", "a"]},
    "compute_gdpo_outcome_advantage": lambda: dict(
        token_level_rewards=_x(1),
        response_mask=_mask(),
        index=["a", "a", "b"],
        epsilon=1e-6,
        norm_adv_by_std_in_grpo=True,
        config=ConfigView(gdpo_reward_keys=["fmt", "acc"], gdpo_reward_weights=[1.0, 0.5]),
        non_tensor_batch={"fmt": [1.0, 0.0, 1.0], "acc": torch.randn(B, dtype=torch.float64)},
        batch=None,
    ),
    **{
        name: lambda: dict(
            token_level_rewards=_x(1),
            response_mask=_mask(),
            index=["a", "a", "b"],
            old_log_probs=_lp(2),
            sum_pi_squared=torch.rand(B, T, dtype=torch.float64),
            rollout_is_weights=_x(4).abs(),
            handle_zero_tail=True,
            epsilon=1e-8,
        )
        for name in (
            "compute_optimal_token_baseline_advantage",
            "compute_multi_turn_optimal_token_baseline_advantage",
        )
    },
    "remax_advantage": lambda: _verl_estimator(reward_baselines=torch.randn(B)),
    "policy_loss_config": lambda: dict(actor=Config().actor, loss_scale_factor=8.0),
    **{
        f"{name}_loss": _verl_pair if name not in ("gspo", "sapo", "geo_mean") else _verl_pair_by_sequence
        for name in POLICY_LOSS_NAMES
    },
    "agg_loss": lambda: dict(
        loss_mat=_x(), loss_mask=_mask(), loss_agg_mode="seq-mean-token-sum-norm", loss_scale_factor=8.0
    ),
    "agg_loss_weight": lambda: dict(micro_mask=_mask()[:2, :3], mini_mask=_mask(), loss_agg_mode="token-mean"),
    "compute_policy_loss": lambda: _pair(
        clip_ratio=0.2,
        clip_ratio_low=0.2,
        clip_ratio_high=0.28,
        clip_ratio_c=3.0,
        loss_agg_mode="token-mean",
        rollout_is_weights=_x(4).abs(),
        loss_scale_factor=8.0,
    ),
    "compute_ppo_penalty_loss": lambda: _pair(
        penalty_kl_coef=0.1, penalty_kl_type="k3", loss_agg_mode="token-mean", loss_scale_factor=8.0
    ),
    "compute_policy_loss_gspo": lambda: _pair(
        clip_ratio=0.2, clip_ratio_low=3e-4, clip_ratio_high=4e-4, rollout_is_weights=_x(4).abs()
    ),
    "check_loss_inputs": lambda: dict(response_mask=_mask(), advantages=_x(1), rollout_is_weights=_x(2).abs()),
    "check_pair_inputs": lambda: _pair(rollout_is_weights=_x(4).abs()),
    "clip_bounds": lambda: dict(clip_ratio=0.2, clip_ratio_low=0.1, clip_ratio_high=0.28),
    "compute_policy_loss_sapo": lambda: _pair(tau_pos=1.0, tau_neg=1.05, rollout_is_weights=_x(4).abs()),
    "compute_policy_loss_geo_mean": lambda: _pair(
        clip_ratio=0.2, clip_ratio_low=0.2, clip_ratio_high=0.28, rollout_is_weights=_x(4).abs()
    ),
    **{
        f"compute_policy_loss_dppo_{d}": lambda: _pair(
            clip_ratio=0.2,
            clip_ratio_low=0.2,
            clip_ratio_high=0.28,
            clip_ratio_c=3.0,
            loss_agg_mode="token-mean",
            rollout_is_weights=_x(4).abs(),
            loss_scale_factor=8.0,
        )
        for d in ("tv", "kl")
    },
    "compute_policy_loss_dro": lambda: _pair(
        dro_beta=0.5, loss_agg_mode="token-mean", rollout_is_weights=_x(4).abs(), loss_scale_factor=8.0
    ),
    "compute_policy_loss_cispo": lambda: _pair(
        clip_ratio=0.2,
        clip_ratio_low=0.2,
        clip_ratio_high=0.28,
        loss_agg_mode="token-mean",
        rollout_is_weights=_x(4).abs(),
        loss_scale_factor=8.0,
    ),
    "compute_policy_loss_clip_cov": lambda: _pair(
        clip_ratio=0.2,
        clip_ratio_low=0.2,
        clip_ratio_high=0.28,
        clip_cov_ratio=0.5,
        clip_cov_lb=0.0,
        clip_cov_ub=5.0,
        loss_agg_mode="token-mean",
        rollout_is_weights=_x(4).abs(),
        loss_scale_factor=None,
    ),
    "compute_policy_loss_kl_cov": lambda: _pair(
        kl_cov_ratio=0.5,
        ppo_kl_coef=0.1,
        loss_agg_mode="token-mean",
        rollout_is_weights=_x(4).abs(),
        loss_scale_factor=None,
    ),
    "compute_policy_loss_gpg": lambda: dict(
        log_prob=_lp(2),
        advantages=_x(3),
        response_mask=_mask(),
        loss_agg_mode="token-mean",
        rollout_is_weights=_x(4).abs(),
        loss_scale_factor=8.0,
    ),
    "compute_value_loss": lambda: dict(
        vpreds=_x(1),
        returns=_x(2),
        values=_x(3),
        response_mask=_mask(),
        cliprange_value=0.5,
        loss_agg_mode="token-mean",
        loss_scale_factor=8.0,
    ),
    "kl_k1": lambda: dict(logprob=_lp(1), ref_logprob=_lp(2)),
    "kl_k2": lambda: dict(logprob=_lp(1), ref_logprob=_lp(2)),
    "kl_k3": lambda: dict(logprob=_lp(1), ref_logprob=_lp(2)),
    "kl_abs": lambda: dict(logprob=_lp(1), ref_logprob=_lp(2)),
    "kl_penalty": lambda: dict(logprob=_lp(1), ref_logprob=_lp(2), kl_penalty="k3+"),
    "kl_full": lambda: dict(logits=torch.randn(B, T, 7), ref_logits=torch.randn(B, T, 7), temperature=0.7),
    "kl_penalty_types": lambda: dict(),
    "register_kl_estimator": lambda: dict(),
    "FixedKLController": lambda: dict(kl_coef=0.1),
    "AdaptiveKLController": lambda: dict(init_kl_coef=0.1, target_kl=0.05, horizon=1000.0),
    "PPOPaperKLController": lambda: dict(init_kl_coef=0.1, target_kl=0.05),
    "FixedKLController.update": lambda: dict(current_kl=0.02, n_steps=8),
    "AdaptiveKLController.update": lambda: dict(current_kl=0.02, n_steps=8),
    "PPOPaperKLController.update": lambda: dict(current_kl=0.02, n_steps=8),
    "get_kl_controller": lambda: dict(type="adaptive", kl_coef=0.1, target_kl=0.05, horizon=1000.0),
    "place_score_on_last_token": lambda: dict(scores=_x()[:, 0], response_mask=_mask()),
    "clip_reward": lambda: dict(scores=_x()[:, 0], clip_reward_value=5.0),
    "apply_missing_eos_penalty": lambda: dict(
        scores=_x()[:, 0], is_truncated=torch.tensor([True, False, True]), penalty=1.0
    ),
    "overlong_penalty": lambda: dict(
        response_length=torch.tensor([1, 3, 4]), max_response_length=4, buffer_len=2, penalty_factor=1.0
    ),
    "overlong_shaped": lambda: dict(
        scores=_x()[:, 0], response_mask=_mask(), max_response_length=4, buffer_len=2, penalty_factor=1.0, log=True
    ),
    "rs_thresholds": lambda: dict(rollout_rs="token_k1", threshold=2.0),
    "compute_policy_loss_reinforce": lambda: dict(
        rollout_log_prob=_lp(1),
        log_prob=_lp(2),
        advantages=_x(3),
        response_mask=_mask(),
        loss_agg_mode="token-mean",
        rollout_is_weights=_x(4).abs(),
        loss_scale_factor=8.0,
        batch_num_tokens=9,
        global_batch_size=3,
    ),
    "compute_policy_loss_bypass_mode": lambda: _pair(
        loss_agg_mode="token-mean",
        config=bypass.apply_bypass_mode(_loss_config(), _BYPASS),
        rollout_is_weights=None,
    ),
    "apply_bypass_mode": lambda: dict(config=_loss_config(), rollout_correction=_BYPASS),
    "is_bounds": lambda: dict(threshold=2.0),
    "compute_rollout_rs_mask": lambda: dict(
        old_log_prob=_lp(2), rollout_log_prob=_lp(3), response_mask=_mask(), rollout_rs="token_k1", threshold=2.0
    ),
    "apply_kl_penalty": lambda: dict(
        token_level_scores=_x(1),
        old_log_probs=_lp(2),
        ref_log_prob=_lp(3),
        response_mask=_mask(),
        kl_coef=0.1,
        kl_penalty="k1",
    ),
    "compute_rollout_is_weights": lambda: dict(
        old_log_prob=_lp(1), rollout_log_prob=_lp(2), response_mask=_mask(), threshold=2.0
    ),
    "is_batch_norm_factor": lambda: dict(rollout_is_weights=_x(4).abs(), response_mask=_mask(), level="sequence"),
}
INSTANCES = {
    "FixedKLController.update": lambda: kl.FixedKLController(0.1),
    "AdaptiveKLController.update": lambda: kl.AdaptiveKLController(0.1, 0.05, 1000.0),
    "PPOPaperKLController.update": lambda: kl.PPOPaperKLController(0.1, 0.05),
}
# (function, argument, bad-input label): valid input after all, and why
VALID = {
    # a KL estimate (k1) may be negative; the controller moves on it
    ("FixedKLController.update", "current_kl", "-1"),
    ("AdaptiveKLController.update", "current_kl", "-1"),
    ("PPOPaperKLController.update", "current_kl", "-1"),
    ("check_kl_update", "current_kl", "-1"),
    # no truncation at all
    ("compute_rollout_is_weights", "threshold", "inf"),
    # verl's thresholds may be texts: "0.1" is a truncation at 0.1
    ("compute_rollout_is_weights", "threshold", "a string"),
    ("is_bounds", "threshold", "a string"),
    ("is_bounds", "threshold", "inf"),
    # None turns the option off
    *(
        (f, "loss_scale_factor", "None")
        for f in ("agg_loss", "compute_policy_loss", "compute_ppo_penalty_loss", "compute_value_loss")
    ),
    ("compute_policy_loss", "clip_ratio_c", "None"),
    *(
        ("compute_policy_loss_reinforce", arg, "None")
        for arg in ("loss_scale_factor", "batch_num_tokens", "global_batch_size", "rollout_is_weights")
    ),
    *(
        (f, arg, "None")
        for f in (
            "compute_policy_loss",
            "compute_policy_loss_gspo",
            "compute_policy_loss_cispo",
            "compute_policy_loss_geo_mean",
            "compute_policy_loss_clip_cov",
            "compute_policy_loss_dppo_tv",
            "compute_policy_loss_dppo_kl",
        )
        for arg in ("clip_ratio_low", "clip_ratio_high", "rollout_is_weights")
    ),
    *(
        (f"compute_policy_loss_dppo_{d}", arg, "None")
        for d in ("tv", "kl")
        for arg in ("clip_ratio_c", "loss_scale_factor")
    ),
    ("compute_policy_loss_dro", "rollout_is_weights", "None"),
    ("compute_policy_loss_dro", "loss_scale_factor", "None"),
    ("compute_policy_loss_gpg", "rollout_is_weights", "None"),
    ("check_pair_inputs", "rollout_is_weights", "None"),
    ("compute_policy_loss_kl_cov", "rollout_is_weights", "None"),
    # a covariance bound may be any number (the window is refused only when empty)
    ("compute_policy_loss_clip_cov", "clip_cov_lb", "-1"),
    ("clip_bounds", "clip_ratio_low", "None"),
    ("clip_bounds", "clip_ratio_high", "None"),
    ("compute_policy_loss_sapo", "rollout_is_weights", "None"),
    *(
        (f, "loss_scale_factor", "None")
        for f in (
            "compute_policy_loss_cispo",
            "compute_policy_loss_gpg",
            "compute_policy_loss_clip_cov",
            "compute_policy_loss_kl_cov",
        )
    ),
    ("compute_value_loss", "cliprange_value", "None"),
    # optional by verl's signature
    *((f"{name}_loss", "rollout_is_weights", "None") for name in POLICY_LOSS_NAMES),
    ("policy_loss_config", "loss_scale_factor", "None"),
    # index is passed to every estimator; these two do not read it
    *(
        (f, "index", label)
        for f in ("reinforce_plus_plus_advantage", "remax_advantage")
        for label in ("shape", "unhashable")
    ),
    # verl's gpg reads neither the old policy nor a ratio
    *(("gpg_loss", "old_log_prob", label) for label in ("meta", "shape", "nan")),
    # computing on a meta tensor alone is shape inference: nothing reads a value
    ("entropy_from_logits", "logits", "meta"),
    # the raw estimators compute what they are given: kl_penalty, which dispatches to them, checks values
    *((f, arg, "nan") for f in ("kl_k1", "kl_k2", "kl_k3", "kl_abs") for arg in ("logprob", "ref_logprob")),
    # any response width goes with (batch,) scores; a micro-batch may be narrower than its mini-batch
    ("place_score_on_last_token", "response_mask", "shape"),
    ("check_score_inputs", "response_mask", "shape"),
    ("overlong_shaped", "response_mask", "shape"),
    ("agg_loss_weight", "mini_mask", "shape"),
    # the logits are not scanned (a pass over the vocabulary); the functions that take them check
    # their small results instead
    ("check_logits", "logits", "nan"),
    # the structural checks read no values: the labels' values are checked with the result
    # (check_log_probs), so that one host sync serves both
    *((f, "labels", label) for f in ("check_logits", "check_labels") for label in ("meta", "range")),
}


def _function(name):
    for module in MODULES:
        head, _, method = name.partition(".")
        if hasattr(module, head) and getattr(getattr(module, head), "__module__", None) == module.__name__:
            return getattr(getattr(module, head), method) if method else getattr(module, head)
    raise KeyError(name)


def _call(name, kwargs):
    if name in INSTANCES:
        return getattr(INSTANCES[name](), name.partition(".")[2])(**kwargs)
    return _function(name)(**kwargs)


def _is_mask(arg):
    return "mask" in arg or arg == "is_truncated"


def _bad_inputs(name):
    """(argument, label, bad value) for every argument of a valid call of ``name``."""
    good = GOOD[name]()
    tensors = [arg for arg, v in good.items() if isinstance(v, torch.Tensor)]
    for arg, value in good.items():
        if isinstance(value, torch.Tensor):
            yield arg, "meta", value.to("meta")
            if len(tensors) > 1 and arg != tensors[0]:  # against the first tensor
                yield arg, "shape", torch.cat([value, value[..., :1]], dim=-1)
            if arg == "labels":
                yield arg, "dtype", value.double()
                yield arg, "range", value + 7
            elif arg == "index":
                yield arg, "shape", value[:, None]
            elif _is_mask(arg):
                yield arg, "0.5", torch.where(value.bool(), 0.5, 0.0)
                yield arg, "2", value.double() * 2
            elif value.is_floating_point():
                yield arg, "nan", value.clone().fill_(math.nan)
        elif isinstance(value, bool):
            yield arg, "a string", "false"
        elif isinstance(value, str):
            yield arg, "unknown", "no-such-" + value
        elif isinstance(value, (int, float)) and arg != "axis":
            for label, bad in (("nan", math.nan), ("inf", math.inf), ("-1", -1.0), ("a string", "0.1"), ("None", None)):
                yield arg, label, bad
        elif isinstance(value, list):
            yield arg, "shape", value[:-1]
            yield arg, "unhashable", [[v] for v in value]
    if "axis" in good:
        yield "axis", "out of range", 2
    if name == "agg_loss_weight":
        yield "micro_mask", "wider than the mini-batch", torch.ones(2, T + 1)


def _cases():
    for name in sorted(GOOD):
        for arg, label, bad in _bad_inputs(name):
            if (name, arg, label) not in VALID:
                yield pytest.param(name, arg, label, bad, id=f"{name}-{arg}-{label}")


def test_every_public_function_has_a_valid_call():
    public = {name for module in MODULES for name, _ in _public(module)}
    assert public == set(GOOD), f"add to GOOD: {sorted(public - set(GOOD))}; gone: {sorted(set(GOOD) - public)}"


@pytest.mark.parametrize("name", sorted(GOOD))
def test_the_valid_call_runs(name):
    if name == "register_kl_estimator":
        with pytest.raises(ValueError, match="trailing"):
            _function(name)("k9+")
        return
    out = _call(name, GOOD[name]())
    for t in out if isinstance(out, tuple) else (out,):
        if isinstance(t, torch.Tensor) and t.is_floating_point():
            assert torch.isfinite(t).all(), f"{name}'s valid call gave a non-finite result"


@pytest.mark.parametrize("name, arg, label, bad", list(_cases()))
def test_bad_input_is_a_value_error_naming_it(name, arg, label, bad):
    kwargs = GOOD[name]() | {arg: bad}
    with pytest.raises(ValueError) as refused:
        _call(name, kwargs)
    message = str(refused.value)
    assert type(refused.value) in (ValueError, NonFiniteError), message
    assert message.strip(), name


@pytest.mark.parametrize("name, arg, label, bad", [c.values for c in _cases() if c.values[2] in ("nan", "inf")])
def test_no_bad_number_is_passed_on(name, arg, label, bad):
    """A refused non-finite input names its argument."""
    with pytest.raises(ValueError) as refused:
        _call(name, GOOD[name]() | {arg: bad})
    assert arg in str(refused.value), str(refused.value)


def test_every_kind_of_bad_input_is_tried():
    """The generator covers each class of the README's promise at least once per module."""
    labels = {label for name in GOOD for _, label, _ in _bad_inputs(name)}
    assert {
        "meta",
        "shape",
        "dtype",
        "range",
        "0.5",
        "2",
        "nan",
        "inf",
        "-1",
        "a string",
        "None",
        "unknown",
        "unhashable",
        "out of range",
    } <= labels


@pytest.mark.parametrize("name", sorted(set(GOOD) - {"register_kl_estimator"}))
def test_a_call_reads_the_device_at_most_once(name, monkeypatch):
    """All value checks of one call, its inner calls' included, share a single host sync."""
    reads = []
    tolist = torch.Tensor.tolist
    monkeypatch.setattr(torch.Tensor, "tolist", lambda t: reads.append(t) or tolist(t))
    _call(name, GOOD[name]())
    assert len(reads) <= 1, f"{name} read the device {len(reads)} times"


@pytest.mark.parametrize(
    "name, arg, bad",
    [("check_kl_update", "n_steps", 0), ("check_masked", "min_valid", -1), ("check_outcome_inputs", "min_valid", -1)],
)
def test_an_int_below_its_bound_is_refused(name, arg, bad):
    """The bad-input table tries -1.0 (a float); an int just below the bound must be refused too."""
    with pytest.raises(ValueError, match=f"{arg} must be an int >= "):
        _call(name, GOOD[name]() | {arg: bad})
