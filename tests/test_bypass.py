"""Bypass mode's loss against verl 0.9's ``compute_policy_loss_bypass_mode`` and
``compute_policy_loss_reinforce`` (``verl/trainer/ppo/core_algos.py``), written out plainly in
float64: the importance weights and the rejection against log pi_theta taken as a constant, PPO's clip
or REINFORCE on the kept tokens, and token-mean and the sequence means dividing by the micro-batch's
tokens and rows before the rejection, as verl's engine passes them (``global_batch_info`` in
``verl/workers/utils/losses.py``)."""

import math

import pytest
import torch
from test_rollout_correction import _plain_rs, _plain_weights

from refppo.algorithms.bypass import apply_bypass_mode, compute_policy_loss_bypass_mode, compute_policy_loss_reinforce
from refppo.losses import get_policy_loss_fn, policy_loss_config
from refppo.registry import ConfigView
from refppo.settings.config import ActorConfig, RolloutCorrectionConfig

MODES = ["token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"]


def _plain_agg(loss, kept, counted, mode, scale):
    """verl's agg_loss over the kept tokens with the engine's counts of ``counted``, in float64."""
    tokens = sum(sum(row) for row in counted)
    rows = sum(1 for row in counted if sum(row) > 0)
    per_row = []
    for values, k in zip(loss, kept):
        total = sum(v * m for v, m in zip(values, k))
        if mode == "seq-mean-token-mean":
            total = total / (sum(k) + 1e-8)
        elif mode == "seq-mean-token-sum-norm":
            total = total / scale
        per_row.append(total if sum(k) > 0 else 0.0)
    if mode == "token-mean":
        return sum(v * m for values, k in zip(loss, kept) for v, m in zip(values, k)) / tokens
    if mode == "token-sum":
        return sum(v * m for values, k in zip(loss, kept) for v, m in zip(values, k))
    return sum(per_row) / rows


def _plain_bypass(rollout, logp, adv, mask, rc, mode, scale, clip=(0.2, 0.2, 0.28, 3.0)):
    """verl 0.9's bypass loss in float64: returns the loss as a differentiable function of logp."""
    weights = None
    if rc["rollout_is"] is not None:
        threshold = rc["rollout_is_threshold"]
        normalize = rc["rollout_is_batch_normalize"]
        weights = _plain_weights(logp.detach(), rollout, mask, threshold, rc["rollout_is"], normalize)
    kept = mask.tolist()
    if rc["rollout_rs"] is not None:
        keep_rows, _, _ = _plain_rs(logp.detach(), rollout, mask, {"token_k1": (0.8, 1.25)})
        kept = [[m * k for m, k in zip(mr, kr)] for mr, kr in zip(mask.tolist(), keep_rows)]
    if rc["loss_type"] == "reinforce":
        token_loss = -adv * logp * (1.0 if weights is None else weights)
    else:
        _, low, high, c = clip
        ratio = torch.exp(logp - rollout)
        pg = torch.maximum(-adv * ratio, -adv * ratio.clamp(1 - low, 1 + high))
        token_loss = torch.where(adv < 0, torch.minimum(pg, -adv * c), pg)
    return _plain_agg([list(row) for row in token_loss.unbind(0)], kept, mask.tolist(), mode, scale)


def _inputs(seed=0):
    gen = torch.Generator().manual_seed(seed)
    rollout = -torch.rand(4, 6, generator=gen, dtype=torch.float64) * 2
    logp = (rollout + 0.3 * torch.randn(4, 6, generator=gen, dtype=torch.float64)).clamp(max=0.0)
    adv = torch.randn(4, 6, generator=gen, dtype=torch.float64)
    mask = (torch.arange(6)[None, :] < torch.tensor([[6], [3], [1], [5]])).double()
    return rollout * mask, logp.requires_grad_(), adv, mask


def _config(loss_type, rollout_is=None, normalize=False, rollout_rs=None, scale=None):
    actor = ActorConfig(clip_ratio=0.2, clip_ratio_high=0.28)
    rc = RolloutCorrectionConfig(
        bypass_mode=True,
        loss_type=loss_type,
        rollout_is=rollout_is,
        rollout_is_batch_normalize=normalize,
        rollout_rs=rollout_rs,
        rollout_rs_threshold="0.8_1.25" if rollout_rs else None,
    )
    return apply_bypass_mode(policy_loss_config(actor, loss_scale_factor=scale), rc), vars(rc)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("loss_type", ["ppo_clip", "reinforce"])
@pytest.mark.parametrize(
    "rollout_is, normalize, rollout_rs",
    [
        (None, False, None),
        ("token", False, None),
        ("sequence", True, None),
        ("token", False, "token_k1"),
        (None, False, "token_k1"),
    ],
)
def test_bypass_loss_and_gradient_equal_verls(mode, loss_type, rollout_is, normalize, rollout_rs):
    rollout, logp, adv, mask = _inputs()
    config, rc = _config(loss_type, rollout_is, normalize, rollout_rs, scale=6.0)
    loss, metrics = get_policy_loss_fn("bypass_mode")(
        old_log_prob=rollout, log_prob=logp, advantages=adv, response_mask=mask, loss_agg_mode=mode, config=config,
        rollout_is_weights=None,
    )  # fmt: skip
    expected = _plain_bypass(rollout, logp, adv, mask, rc, mode, scale=6.0)
    torch.testing.assert_close(loss, torch.as_tensor(expected, dtype=torch.float64), rtol=1e-12, atol=1e-14)
    (got,) = torch.autograd.grad(loss, logp)
    (want,) = torch.autograd.grad(expected, logp)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-14)
    assert ("rollout_corr/rollout_is_mean" in metrics) == (rollout_is is not None)
    assert ("rollout_corr/rollout_rs_masked_fraction" in metrics) == (rollout_rs is not None)
    assert "rollout_corr/kl" in metrics and "actor/ppo_kl" in metrics


def test_rejection_in_bypass_mode_drops_tokens_yet_keeps_the_batchs_counts():
    """A token the loss rejects adds nothing, and token-mean still divides by every valid token
    (verl's engine counts the batch before the loss rejects): rejecting changes the loss by exactly
    the rejected tokens' share."""
    rollout, logp, adv, mask = _inputs(seed=3)
    plain, _ = _config("reinforce")
    rejecting, _ = _config("reinforce", rollout_rs="token_k1")
    loss_all, _ = compute_policy_loss_bypass_mode(rollout, logp, adv, mask, "token-mean", plain)
    loss_kept, metrics = compute_policy_loss_bypass_mode(rollout, logp, adv, mask, "token-mean", rejecting)
    keep_rows, _, _ = _plain_rs(logp.detach(), rollout, mask, {"token_k1": (0.8, 1.25)})
    rejected = mask * (1 - torch.tensor(keep_rows, dtype=torch.float64))
    assert 0 < rejected.sum() < mask.sum(), "a vacuous check: nothing or everything rejected"
    dropped = (-adv * logp * rejected).sum() / mask.sum()
    torch.testing.assert_close(loss_kept, loss_all - dropped, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(
        metrics["rollout_corr/rollout_rs_masked_fraction"], (rejected.sum() / mask.sum()).to(torch.float64)
    )


def test_reinforce_weighs_each_tokens_log_prob_gradient_by_its_advantage_and_weight():
    rollout, logp, adv, mask = _inputs(seed=5)
    weights = torch.rand(4, 6, dtype=torch.float64) * mask
    loss, metrics = compute_policy_loss_reinforce(rollout, logp, adv, mask, "token-sum", rollout_is_weights=weights)
    (grad,) = torch.autograd.grad(loss, logp)
    torch.testing.assert_close(grad, -adv * weights * mask, rtol=1e-12, atol=0)
    ppo_kl = ((rollout - logp.detach()) * mask).sum() / mask.sum()
    torch.testing.assert_close(metrics["actor/ppo_kl"], ppo_kl)


def test_bypass_loss_refuses_a_config_without_rollout_correction_and_an_unknown_loss_type():
    rollout, logp, adv, mask = _inputs()
    plain = policy_loss_config(ActorConfig(), loss_scale_factor=None)
    with pytest.raises(ValueError, match="config.policy_loss.rollout_correction"):
        compute_policy_loss_bypass_mode(rollout, logp, adv, mask, "token-mean", plain)
    bad = apply_bypass_mode(plain, {"loss_type": "ppo", "rollout_is": None, "rollout_rs": None})
    with pytest.raises(ValueError, match="rollout_correction.loss_type 'ppo'"):
        compute_policy_loss_bypass_mode(rollout, logp, adv, mask, "token-mean", bad)


def test_apply_bypass_mode_sets_verls_loss_mode_and_leaves_the_config_as_it_was():
    config = policy_loss_config(ActorConfig(), loss_scale_factor=None)
    rc = RolloutCorrectionConfig(bypass_mode=True, loss_type="reinforce")
    bypass = apply_bypass_mode(config, rc)
    assert bypass.policy_loss.loss_mode == "bypass_mode" and config.policy_loss.loss_mode == "clip"
    assert bypass.policy_loss.rollout_correction.loss_type == "reinforce"
    assert "rollout_correction" not in config.policy_loss and isinstance(bypass.policy_loss, ConfigView)
    assert math.isclose(bypass.clip_ratio, config.clip_ratio)


def test_verls_documented_bypass_line_names_the_loss_refppo_computes():
    """verl's documentation (``docs/algo/rollout_corr.md``) has a bypass-mode line also set
    ``policy_loss.loss_mode=bypass_mode``: verl's workers fix their loss from their own settings
    (``ActorRolloutRefWorker.init_model`` in ``verl/workers/engine_workers.py``:
    ``partial(ppo_loss, config=actor_config)``), and ``apply_bypass_mode``
    (``verl/trainer/ppo/rollout_corr_helper.py``) changes only the trainer's copy. refppo's bypass
    mode computes that loss, so the name is accepted beside ``bypass_mode=true`` (the same run) and
    refused without it."""
    from refppo.settings.conditions import policy_loss_in_use
    from refppo.settings.overrides import command_settings

    line = ["algorithm.rollout_correction.bypass_mode=true", "actor_rollout_ref.rollout.n=2"]
    named, notes = command_settings("ppo", [*line, "actor_rollout_ref.actor.policy_loss.loss_mode=bypass_mode"])
    plain, _ = command_settings("ppo", line)
    assert named == plain and policy_loss_in_use(named) == "bypass_mode"
    assert "actor_rollout_ref.actor.policy_loss.loss_mode=bypass_mode is refppo's loss in bypass mode" in notes[0]
    with pytest.raises(ValueError, match="give it with algorithm.rollout_correction.bypass_mode=true"):
        command_settings("ppo", ["actor_rollout_ref.actor.policy_loss.loss_mode=bypass_mode"])


def test_verls_worker_side_rollout_correction_settings_are_read_only_by_bypass_modes_loss():
    """verl 0.9's ``compute_policy_loss_bypass_mode`` (``verl/trainer/ppo/core_algos.py``) reads the
    rollout correction settings from the workers' ``policy_loss.rollout_correction`` (a field of
    ``PolicyLossConfig`` its YAML lacks, so a line adds it with ``+``), with ``.get`` defaults for
    those not given, and no other loss reads them. On a line that chooses that loss by name they are
    refppo's ``algorithm.rollout_correction.*``, which must agree where both are given (verl's
    documentation has a bypass line give both), and a loss setting given under ``algorithm`` alone,
    which verl's workers would not read, is refused; on any other line verl leaves the workers' copy
    unread, and so does refppo."""
    from refppo.settings.overrides import command_settings

    bypass = ["algorithm.rollout_correction.bypass_mode=true", "actor_rollout_ref.rollout.n=2"]
    by_name = [*bypass, "actor_rollout_ref.actor.policy_loss.loss_mode=bypass_mode"]
    worker = "+actor_rollout_ref.actor.policy_loss.rollout_correction"
    rs = [
        "algorithm.rollout_correction.rollout_rs=token_k1",
        "algorithm.rollout_correction.rollout_rs_threshold=0.5_2.0",
    ]
    workers_rs = [f"{worker}.rollout_rs=token_k1", f"{worker}.rollout_rs_threshold=0.5_2.0"]
    expected, _ = command_settings("ppo", [*bypass, *rs])
    given, notes = command_settings("ppo", [*by_name, *workers_rs])
    assert given == expected and given.algorithm.rollout_correction.rollout_rs == "token_k1"
    assert any("is refppo's algorithm.rollout_correction.rollout_rs, which its bypass-mode loss" in n for n in notes)
    both, _ = command_settings("ppo", [*by_name, *rs, *workers_rs])
    assert both == expected, "the same value in both places is one setting"
    with pytest.raises(ValueError, match="verl's bypass loss reads the first, and refppo's one setting is"):
        command_settings("ppo", [*by_name, *rs, f"{worker}.rollout_rs=seq_max_k2", workers_rs[1]])
    with pytest.raises(ValueError, match=r"from their own copy of the setting, \S+loss_type \(ppo_clip unless"):
        command_settings("ppo", [*by_name, "algorithm.rollout_correction.loss_type=reinforce"])
    with pytest.raises(ValueError, match="would not read this one"):
        command_settings("ppo", [*by_name, *rs])
    reinforce, _ = command_settings("ppo", [*bypass, "algorithm.rollout_correction.loss_type=reinforce"])
    assert reinforce == command_settings("ppo", [*by_name, f"{worker}.loss_type=reinforce"])[0]
    plain, _ = command_settings("ppo", bypass)
    at_default, _ = command_settings("ppo", [*by_name, "algorithm.rollout_correction.loss_type=ppo_clip"])
    assert at_default == plain
    unread, notes = command_settings("ppo", [*bypass, f"{worker}.rollout_rs=token_k1", f"{worker}.bypass_mode=true"])
    assert unread == plain
    assert sum("verl's workers read it only in bypass mode's loss" in n for n in notes) == 2
    named, notes = command_settings("ppo", [*by_name, f"{worker}.bypass_mode=false"])  # no worker reads it
    assert named == plain and any("verl's workers read it only in bypass mode's loss" in n for n in notes)
