"""What one PPO step computes, pinned against plain re-implementations written here.

The trainer's pieces (losses, advantages, KL estimators) have their own tests; these check the
wiring between them: which log-probs, values, masks and coefficients reach each loss, and what
each logged metric means. The references run every sequence on its own, unpadded, and write
every formula out, so they share no code path with the trainer beyond the model itself.
"""

import contextlib
import copy
import math

import pytest
import torch
from _tolerances import reordered
from _trainers import MODES, TOK, first_char_is_seven, make_trainer, micro_batch_loss, minibatch_stats
from torch.utils.data import DataLoader

import refppo.training.trainer
from refppo.rollout.forward import compute_log_probs, compute_values
from refppo.rollout.prompts import decode_texts
from refppo.training.metrics import data_metrics, gather, throughput_metrics

# The trainer's passes against plain recomputations of the same numbers: the same float32 sums in
# other orders (micro-batches, blocks), over a 32-wide hidden state and a 50-token vocabulary, of
# values (log-probs, entropies, values) smaller than 10 in size (_tolerances, rule 1).
PASSES = reordered(32 + 50) * 10
BATCH = [
    "data.train_batch_size=8",
    "actor.ppo_mini_batch_size=8",
    "actor.optim.clip_grad=1e9",
    "critic.optim.clip_grad=1e9",
]


def plain_forward(model, batch, temperature=1.0):
    """Row by row on the unpadded sequence: log pi(a_t | prefix) and the entropy of pi(. | prefix),
    both (B, R) with gradients, 0 after the response."""
    prompt_width = batch["prompts"].shape[1]
    rows_logp, rows_entropy = [], []
    for i in range(batch["responses"].shape[0]):
        ids = batch["input_ids"][i][batch["attention_mask"][i].bool()]
        n_prompt = int(batch["attention_mask"][i, :prompt_width].sum())
        n_resp = int(batch["response_mask"][i].sum())
        logits = model(input_ids=ids[None]).logits[0].float() / temperature
        logp_all = torch.log_softmax(logits[n_prompt - 1 : n_prompt - 1 + n_resp], -1)
        logp = logp_all.gather(-1, ids[n_prompt : n_prompt + n_resp, None])[:, 0]
        entropy = -(logp_all.exp() * logp_all).sum(-1)
        pad = batch["responses"].shape[1] - n_resp
        rows_logp.append(torch.nn.functional.pad(logp, (0, pad)))
        rows_entropy.append(torch.nn.functional.pad(entropy, (0, pad)))
    return torch.stack(rows_logp), torch.stack(rows_entropy)


def plain_values(critic, batch):
    """V(s_t) of the state before each response token, row by row, (B, R), 0 after the response."""
    prompt_width = batch["prompts"].shape[1]
    rows = []
    for i in range(batch["responses"].shape[0]):
        ids = batch["input_ids"][i][batch["attention_mask"][i].bool()]
        n_prompt = int(batch["attention_mask"][i, :prompt_width].sum())
        n_resp = int(batch["response_mask"][i].sum())
        v = critic(input_ids=ids[None]).logits[0, n_prompt - 1 : n_prompt - 1 + n_resp, 0].float()
        rows.append(torch.nn.functional.pad(v, (0, batch["responses"].shape[1] - n_resp)))
    return torch.stack(rows)


def plain_agg(x, mask, mode, scale=None):
    """Every loss_agg_mode, written out; ``scale`` is seq-mean-token-sum-norm's constant."""
    if mode == "token-mean":
        return (x * mask).sum() / mask.sum()
    if mode == "token-sum":
        return (x * mask).sum()
    if mode == "seq-mean-token-sum":
        return (x * mask).sum(-1).mean()
    if mode == "seq-mean-token-mean":  # a row rejection sampling emptied adds 0 and still counts
        return ((x * mask).sum(-1) / mask.sum(-1).clamp(min=1)).mean()
    assert mode == "seq-mean-token-sum-norm"
    return ((x * mask).sum(-1) / scale).mean()


def plain_gae(rewards, values, mask, gamma, lam):
    """Backward loop over each row's valid tokens; advantages whitened over the batch (unbiased
    variance), returns = raw advantages + values."""
    raw = torch.zeros_like(rewards)
    for i in range(rewards.shape[0]):
        n, last = int(mask[i].sum()), 0.0
        for t in reversed(range(n)):
            next_value = values[i, t + 1] if t + 1 < n else 0.0
            last = rewards[i, t] + gamma * next_value - values[i, t] + gamma * lam * last
            raw[i, t] = last
    valid = raw[mask.bool()]
    whitened = (raw - valid.mean()) / torch.sqrt(valid.var(unbiased=True) + 1e-8)
    return whitened * mask, (raw + values) * mask


def capture(trainer):
    """Record every evaluated batch the trainer makes, and run ``checks["actor"]()`` (or
    ``"critic"``) at every step of that model's optimiser, before it is applied (the gradients are
    then final)."""
    batches, checks = [], {}
    evaluate = trainer.evaluate

    def recording(batch, scores, extras, timing):
        stats = evaluate(batch, scores, extras, timing)
        batches.append(batch)  # evaluated in place
        return stats

    trainer.evaluate = recording
    for name, learner in trainer.learners.items():
        hook = lambda opt, args, kwargs, _name=name: checks[_name]() if _name in checks else None
        learner.optimizer.register_step_pre_hook(hook)
    return batches, checks


def perturb_rollout_log_probs(trainer, scale=0.3):
    """Make the recorded sampling log-probs differ from the actor's, as a bf16 or lagging
    inference engine's would, so that bypass and rollout correction have something to do."""
    generate = trainer.generate

    def noisy(records, n, do_sample=True, **rows):
        batch = generate(records, n, do_sample, **rows)
        gen = torch.Generator().manual_seed(trainer.step)
        noise = scale * torch.randn(batch["rollout_log_probs"].shape, generator=gen)
        batch["rollout_log_probs"] = (batch["rollout_log_probs"] + noise) * batch["response_mask"]
        return batch

    trainer.generate = noisy


def grads(params):
    return torch.cat([p.grad.flatten() for p in params])


def assert_grad_close(got, expected):
    """Equal up to float32 noise; returns False where both are exactly zero (every token clipped)."""
    scale = expected.abs().max()
    assert (got - expected).abs().max() <= 1e-4 * scale, ((got - expected).abs().max().item(), scale.item())
    return bool(scale > 0)


def plain_clipped(adv, ratio, a, dual_clip=True):
    """PPO's clipped loss per token with the actor's bounds ``a`` (a side left null takes
    clip_ratio), and the dual clip where ``a.clip_ratio_c`` is set (GSPO has none)."""
    low = a.clip_ratio if a.clip_ratio_low is None else a.clip_ratio_low
    high = a.clip_ratio if a.clip_ratio_high is None else a.clip_ratio_high
    pg = torch.maximum(-adv * ratio, -adv * ratio.clamp(1 - low, 1 + high))
    if dual_clip and a.clip_ratio_c is not None:
        pg = torch.where(adv < 0, torch.minimum(pg, -adv * a.clip_ratio_c), pg)
    return pg


def expected_actor_loss(trainer, batch):
    """The actor's loss on the whole batch (one mini-batch), written out from the config."""
    a = trainer.config.actor
    mask = batch["response_mask"].float()
    logp, entropy = plain_forward(trainer.actor, batch, trainer.config.rollout.temperature)
    old, adv = batch["old_log_probs"], batch["advantages"]
    ratio = torch.exp(logp - old)
    pg_mode = a.loss_agg_mode
    if a.policy_loss == "gspo":
        # verl 0.9's compute_policy_loss_gspo: one ratio a sequence, the geometric mean of its
        # tokens' (value), each token's own gradient; seq-mean-token-mean whatever the mode says
        seq_log_ratio = ((logp - old) * mask).sum(-1, keepdim=True) / mask.sum(-1, keepdim=True).clamp(min=1)
        seq_ratio = torch.exp((logp - logp.detach() + seq_log_ratio.detach()).clamp(max=10.0))
        pg = plain_clipped(adv, seq_ratio, a, dual_clip=False)
        pg_mode = "seq-mean-token-mean"
    elif a.policy_loss == "penalty":
        kl_old = old - logp  # k1 of KL(pi_old || pi_theta) on tokens from pi_old
        pg = -adv * ratio + a.penalty_kl_coef * kl_old
    elif trainer.config.algorithm.rollout_correction.bypass_mode:
        pg = expected_bypass_token_losses(trainer, logp, old, adv, mask)
    else:
        pg = plain_clipped(adv, ratio, a)
        rc = trainer.config.algorithm.rollout_correction
        if rc.rollout_is is not None:  # verl's truncated importance weights, written plainly
            log_ratio = (old - batch["rollout_log_probs"]) * mask
            if rc.rollout_is == "sequence":
                log_ratio = log_ratio.sum(-1, keepdim=True)
            weights = (log_ratio.exp() * mask).clamp(max=rc.rollout_is_threshold)
            if rc.rollout_is_batch_normalize:
                weights = weights / (weights.sum() / mask.sum() if rc.rollout_is == "token" else weights[:, 0].mean())
            pg = pg * weights
    scale = a.loss_scale_factor or trainer.config.data.max_response_length
    loss = plain_agg(pg, mask, pg_mode, scale) - a.entropy_coeff * plain_agg(entropy, mask, a.loss_agg_mode, scale)
    if a.use_kl_loss:
        assert a.kl_loss_type in ("k2", "mse")
        k2 = 0.5 * (logp - batch["ref_log_prob"]) ** 2
        loss = loss + a.kl_loss_coef * plain_agg(k2, mask, a.loss_agg_mode, scale)
    return loss


def expected_bypass_token_losses(trainer, logp, rollout, adv, mask):
    """verl 0.9's bypass loss per token (``compute_policy_loss_bypass_mode``), for token-mean
    aggregated over every valid token: the weights and a token-k1 rejection against pi_theta as a
    constant; a rejected token's loss is 0, and it still counts in the mean (verl's engine)."""
    a = trainer.config.actor
    rc = trainer.config.algorithm.rollout_correction
    assert a.loss_agg_mode == "token-mean" and rc.rollout_rs in (None, "token_k1")
    log_ratio = (logp.detach() - rollout) * mask
    kept = mask
    if rc.rollout_rs == "token_k1":
        lower, upper = (float(b) for b in rc.rollout_rs_threshold.split("_"))
        kept = mask * ((-log_ratio >= math.log(lower)) & (-log_ratio <= math.log(upper))).float()
    if rc.loss_type == "reinforce":
        weights = torch.ones_like(mask)
        if rc.rollout_is is not None:
            assert rc.rollout_is == "token"
            weights = (log_ratio.exp() * mask).clamp(max=rc.rollout_is_threshold)
        return -adv * logp * weights * kept
    return plain_clipped(adv, torch.exp(logp - rollout), a) * kept


def expected_critic_loss(trainer, batch):
    c, a = trainer.config.critic, trainer.config.actor
    mask = batch["response_mask"].float()
    v, old_v, ret = plain_values(trainer.critic, batch), batch["values"], batch["returns"]
    clipped = old_v + (v - old_v).clamp(-c.cliprange_value, c.cliprange_value)
    # verl's config: an unset critic setting is the actor's
    mode = a.loss_agg_mode if c.loss_agg_mode is None else c.loss_agg_mode
    scale = c.loss_scale_factor or a.loss_scale_factor or trainer.config.data.max_response_length
    return 0.5 * plain_agg(torch.maximum((v - ret) ** 2, (clipped - ret) ** 2), mask, mode, scale)


def response_length(prompts, responses, records):
    """A reward that differs between most responses."""
    return torch.tensor([float(len(r)) for r in responses])


def check_every_update(overrides, steps=2, prepare=None, **kw):
    """Run ``steps`` steps; at every optimiser step compare the trainer's gradient with the plain one
    (``prepare(trainer)`` first, if given; ``kw`` to make_trainer)."""
    trainer = make_trainer([*BATCH, *overrides], **kw)
    if prepare is not None:
        prepare(trainer)
    rc = trainer.config.algorithm.rollout_correction
    if rc.bypass_mode or rc.rollout_is is not None:
        perturb_rollout_log_probs(trainer)
    batches, checks = capture(trainer)
    seen = {"actor": 0, "critic": 0}
    nonzero = dict(seen)

    def check(name, params, loss_fn):
        def run():
            expected = torch.autograd.grad(loss_fn(trainer, batches[-1]), params)
            nonzero[name] += assert_grad_close(grads(params), torch.cat([g.flatten() for g in expected]))
            seen[name] += 1

        checks[name] = run

    check("actor", trainer.learners["actor"].params, expected_actor_loss)
    if trainer.use_critic:
        check("critic", trainer.learners["critic"].params, expected_critic_loss)
    trainer.every_update_stats = []
    for _ in range(steps):
        trainer.train_step()
        trainer.every_update_stats += trainer.last_update_stats
    epochs = trainer.config.actor.ppo_epochs
    assert seen["actor"] == steps * epochs
    assert seen["critic"] == (steps * epochs if trainer.use_critic else 0)
    assert nonzero["actor"] > 0 and (nonzero["critic"] > 0 or not trainer.use_critic), "a vacuous check"
    trainer.evaluated_batches = batches
    return trainer


@pytest.mark.parametrize(
    "mode", ["token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"]
)
@pytest.mark.parametrize("micro", [None, 2])
def test_every_update_has_the_plain_gradient_for_every_aggregation(mode, micro):
    check_every_update(
        [
            f"actor.loss_agg_mode={mode}",
            f"critic.loss_agg_mode={mode}",
            "actor.ppo_epochs=2",
            *(
                [f"actor.ppo_micro_batch_size_per_gpu={micro}", f"critic.ppo_micro_batch_size_per_gpu={micro}"]
                if micro
                else []
            ),
        ]
    )


@pytest.mark.parametrize("mode", ["token-mean", "token-sum"])
def test_gspo_aggregates_its_own_way_beside_a_kl_loss_in_another_mode(mode):
    """verl 0.9's GSPO aggregates its policy loss with seq-mean-token-mean whatever
    ``loss_agg_mode`` says, and the KL loss with ``loss_agg_mode``: micro-batches of different
    token counts weigh each term by its own mode, so every update has the plain gradient."""
    check_every_update(
        [
            "algorithm.adv_estimator=grpo",
            "rollout.n=2",
            "actor.policy_loss=gspo",
            f"actor.loss_agg_mode={mode}",
            "actor.use_kl_loss=true",
            "actor.kl_loss_type=k2",
            "actor.kl_loss_coef=0.5",
            "actor.ppo_micro_batch_size_per_gpu=4",
        ],
        reward_fn=response_length,
    )


@pytest.mark.parametrize(
    "actor_only",
    [
        ["actor.loss_agg_mode=seq-mean-token-sum"],
        ["actor.loss_agg_mode=seq-mean-token-sum-norm", "actor.loss_scale_factor=3"],
    ],
)
def test_the_critic_takes_the_actors_loss_mode_and_constant_when_its_own_are_unset(actor_only):
    """verl's critic.loss_agg_mode and (0.9) critic.loss_scale_factor default to the actor's."""
    trainer = check_every_update(actor_only)
    assert trainer.config.critic.loss_agg_mode is None and trainer.config.critic.loss_scale_factor is None


def test_seq_mean_token_sum_norm_divides_by_the_configured_length_not_the_batch_width():
    """Responses that all end early make the batch narrower than data.max_response_length; verl
    0.9 still divides by the constant, so the step's gradient does not grow."""

    def early_eos(trainer):
        with torch.no_grad():
            trainer.actor.lm_head.weight[TOK.eos_token_id] += 5.0  # ends most responses after 2-5 tokens

    trainer = check_every_update(
        [
            "actor.loss_agg_mode=seq-mean-token-sum-norm",
            "critic.loss_agg_mode=seq-mean-token-sum-norm",
            "data.max_response_length=8",
            "actor.ppo_micro_batch_size_per_gpu=2",
        ],
        prepare=early_eos,
    )
    widths = [b["responses"].shape[1] for b in trainer.evaluated_batches]
    assert min(widths) < 8, f"widths {widths}: no batch narrower than the limit, the check would be vacuous"


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-sum-norm"])
def test_token_budget_micro_batches_give_the_plain_gradient(mode):
    """use_dynamic_bsz: rows regrouped by length into micro-batches of at most 14 tokens, each cut
    to its own width; every update's gradient is still the whole mini-batch's loss's, and the
    evaluate-phase passes (old and reference log-probs, values) are unchanged."""

    def ragged(trainer):
        with torch.no_grad():
            trainer.actor.lm_head.weight[TOK.eos_token_id] += 3.0  # responses end after 1-8 tokens

    budget = [
        "data.max_prompt_length=6",
        "actor.use_dynamic_bsz=true",
        "actor.ppo_max_token_len_per_gpu=14",
        "critic.use_dynamic_bsz=true",
        "critic.ppo_max_token_len_per_gpu=14",
        "algorithm.use_kl_in_reward=true",
    ]
    trainer = check_every_update(
        [f"actor.loss_agg_mode={mode}", f"critic.loss_agg_mode={mode}", "data.max_response_length=8", *budget],
        prepare=ragged,
    )
    lengths = trainer.evaluated_batches[-1]["response_mask"].sum(-1)
    assert lengths.min() < lengths.max(), "a vacuous check: every response has the same length"
    assert len(trainer.accel.actor.micro_batches(trainer.evaluated_batches[-1], None)) > 3, (
        "a vacuous check: few micro-batches"
    )
    fresh = make_trainer([*BATCH, *budget])
    ragged(fresh)
    batch, _ = fresh.make_experience(fresh.sampler.next_batch(), {})
    for key, whole in [
        ("old_log_probs", compute_log_probs(fresh.actor, batch)),
        ("ref_log_prob", compute_log_probs(fresh.reference, batch)),
        ("values", compute_values(fresh.critic, batch)),
    ]:
        assert torch.allclose(batch[key], whole, atol=1e-5), key


# a token-k1 rejection narrow enough to reject some of perturb_rollout_log_probs' tokens
BYPASS_RS = [
    "algorithm.rollout_correction.rollout_rs=token_k1",
    "algorithm.rollout_correction.rollout_rs_threshold=0.8_1.25",
]


@pytest.mark.parametrize(
    "overrides",
    [
        ["actor.clip_ratio=0.01", "actor.clip_ratio_high=0.03", "actor.ppo_epochs=3"],  # the clip bites after epoch 1
        ["actor.clip_ratio_c=1.01", "actor.clip_ratio=0.01", "actor.ppo_epochs=3"],  # and the dual clip
        ["actor.entropy_coeff=0.3"],
        ["actor.use_kl_loss=true", "actor.kl_loss_type=k2", "actor.kl_loss_coef=0.5"],
        ["actor.policy_loss=penalty", "actor.penalty_kl_coef=2.0", "actor.ppo_epochs=2"],
        ["algorithm.rollout_correction.bypass_mode=true", "actor.ppo_epochs=2"],
        [*MODES["bypass"], *BYPASS_RS, "actor.ppo_epochs=2"],  # PPO's clip on the kept tokens
        [*MODES["bypass"], "algorithm.rollout_correction.loss_type=reinforce", "actor.ppo_epochs=2"],
        [
            *MODES["bypass"],
            "algorithm.rollout_correction.loss_type=reinforce",
            "algorithm.rollout_correction.rollout_is=token",
            *BYPASS_RS,
            "actor.ppo_epochs=2",
            "actor.ppo_micro_batch_size_per_gpu=2",  # the counts of each micro-batch, weighed
        ],
        [*MODES["token_is"], "algorithm.rollout_correction.rollout_is_threshold=1.2", "actor.ppo_epochs=2"],
        [*MODES["sequence_is"], "algorithm.rollout_correction.rollout_is_batch_normalize=true", "actor.ppo_epochs=2"],
        ["algorithm.adv_estimator=grpo", "rollout.n=4", "data.train_batch_size=2", "actor.ppo_mini_batch_size=2"],
        ["rollout.temperature=0.7"],
        # log-probs from the hidden states (the LM head fused into the log-softmax), every term on
        [
            "model.use_fused_kernels=true",
            "actor.entropy_coeff=0.3",
            "actor.use_kl_loss=true",
            "actor.kl_loss_type=k2",
            "actor.kl_loss_coef=0.5",
            "rollout.temperature=0.7",
        ],
    ],
)
def test_every_update_has_the_plain_gradient(overrides):
    # GRPO's groups of 4 need scores that differ within a group, or every advantage is 0
    grpo = "algorithm.adv_estimator=grpo" in overrides
    trainer = check_every_update(overrides, steps=3, **({"reward_fn": response_length} if grpo else {}))
    stats = trainer.every_update_stats
    if "actor.clip_ratio=0.01" in overrides:  # the clipped branches were exercised, not only the plain one
        assert max(s["actor/pg_clipfrac"] for s in stats) > 0
    if "actor.clip_ratio_c=1.01" in overrides:
        assert max(s["actor/pg_clipfrac_lower"] for s in stats) > 0
    if BYPASS_RS[0] in overrides:  # some tokens were rejected, not none or all
        assert 0 < max(s["actor/rollout_corr/rollout_rs_masked_fraction"] for s in stats) < 1


def test_bypass_modes_loss_metrics_are_logged_under_actor_and_reduced_by_name_as_verls():
    """verl 0.9's V1 trainer (``_update_actor`` in ``verl/trainer/ppo/v1/trainer_base.py``) puts
    ``actor/`` before every name of the update's metrics that lacks it (``rename_dict``), so bypass
    mode's loss logs ``actor/rollout_corr/*``; ``reduce_metrics`` (``verl/utils/metric/utils.py``)
    then takes the largest value over the mini-batches of a name with "max" in it, the smallest of
    one with "min", the mean of the others."""
    trainer = make_trainer([*MODES["bypass"], "algorithm.rollout_correction.rollout_is=token", "actor.ppo_epochs=2"])
    metrics = trainer.train_step()
    stats = trainer.last_update_stats
    assert len(stats) > 1, "a vacuous check: one mini-batch"
    names = [k for k in metrics if "rollout_corr/" in k]
    assert names and all(k.startswith("actor/rollout_corr/") for k in names), names
    high = "actor/rollout_corr/rollout_is_max"
    low = "actor/rollout_corr/rollout_is_min"
    mean = "actor/rollout_corr/rollout_is_mean"
    assert metrics[high] == pytest.approx(max(s[high] for s in stats), rel=1e-6)
    assert metrics[low] == pytest.approx(min(s[low] for s in stats), rel=1e-6)
    assert metrics[mean] == pytest.approx(sum(s[mean] for s in stats) / len(stats), rel=1e-6)
    assert len({s[high] for s in stats}) > 1, "a vacuous check: every mini-batch's max the same"


@pytest.mark.parametrize("mode", ["seq-mean-token-mean", "seq-mean-token-sum", "token-mean"])
def test_rows_rejection_sampling_empties_still_count_in_the_sequence_means(mode):
    """verl 0.9's engine divides a sequence mean by every row of the mini-batch (global_batch_size),
    one whose tokens a sequence-level rejection all dropped included; a micro-batch with no token
    left adds nothing. Every gradient equals the plain loss over all rows."""
    trainer = check_every_update(
        [
            *MODES["decoupled"],
            "algorithm.rollout_correction.rollout_rs=seq_mean_k3",
            "algorithm.rollout_correction.rollout_rs_threshold=0.12",
            f"actor.loss_agg_mode={mode}",
            f"critic.loss_agg_mode={mode}",
            "actor.ppo_micro_batch_size_per_gpu=2",
            "critic.ppo_micro_batch_size_per_gpu=2",
        ],
        steps=3,
        prepare=lambda t: perturb_rollout_log_probs(t, scale=0.5),
    )
    emptied = [int((b["response_mask"].sum(-1) == 0).sum()) for b in trainer.evaluated_batches]
    assert 0 < max(emptied) and min(emptied) < trainer.evaluated_batches[0]["response_mask"].shape[0], emptied


def test_terms_change_the_gradient_by_exactly_their_own_term():
    """entropy_coeff and kl_loss_coef each add c * grad(agg(term)) and nothing else."""
    base = make_trainer([*BATCH, "actor.use_kl_loss=true", "actor.kl_loss_type=k2", "actor.kl_loss_coef=0.0"])
    base.train_step()  # move the actor away from the reference
    batch, *_ = base.make_experience(base.sampler.next_batch(), {})
    params = base.learners["actor"].params

    def actor_grad(**settings):
        for k, v in settings.items():
            setattr(base.config.actor, k, v)
        loss = micro_batch_loss(base._actor_loss(batch)[0])
        out = torch.cat([g.flatten() for g in torch.autograd.grad(loss, params)])
        base.config.actor.entropy_coeff, base.config.actor.kl_loss_coef = 0.0, 0.0
        return out

    g0 = actor_grad()
    mask = batch["response_mask"].float()
    logp, entropy = plain_forward(base.actor, batch)
    g_entropy = torch.cat(
        [g.flatten() for g in torch.autograd.grad(plain_agg(entropy, mask, "token-mean"), params, retain_graph=True)]
    )
    g_k2 = torch.cat(
        [
            g.flatten()
            for g in torch.autograd.grad(
                plain_agg(0.5 * (logp - batch["ref_log_prob"]) ** 2, mask, "token-mean"), params
            )
        ]
    )
    assert assert_grad_close(actor_grad(entropy_coeff=0.25) - g0, -0.25 * g_entropy)
    assert assert_grad_close(actor_grad(kl_loss_coef=0.5) - g0, 0.5 * g_k2)


def test_fused_kernels_never_run_the_lm_head_over_the_responses():
    """model.use_fused_kernels: the old-log-prob, reference and update passes never call the LM
    head (whose output would be the whole logits); sampling still does, one position at a time."""
    for fused in (False, True):
        trainer = make_trainer(
            [*BATCH, "algorithm.use_kl_in_reward=true", f"model.use_fused_kernels={str(fused).lower()}"]
        )
        positions = []
        for model in (trainer.actor, trainer.reference):
            model.lm_head.register_forward_hook(lambda module, args, out, seen=positions: seen.append(args[0].shape[1]))
        trainer.train_step()
        assert positions and (max(positions) > 1) != fused, (fused, sorted(set(positions)))


@pytest.mark.parametrize("fused", [False, True])
def test_use_torch_compile_reaches_every_log_prob_pass(compiled_kernel_calls, monkeypatch, fused):
    """actor.use_torch_compile: the reference and old-log-prob passes and the actor's update reduce
    their logits (or, fused, their hidden states' blocks) with the compiled kernels, and the
    update's gradient goes through them too; without it no pass does."""
    timer, seen = refppo.training.trainer.timer, set()

    @contextlib.contextmanager
    def in_phase(timing, name, device):  # the compiled calls each phase made
        before = len(compiled_kernel_calls)
        with timer(timing, name, device):
            yield
        seen.update((name, call) for call in compiled_kernel_calls[before:])

    monkeypatch.setattr(refppo.training.trainer, "timer", in_phase)
    for compiled in (False, True):
        trainer = make_trainer(
            [
                *BATCH,
                "algorithm.use_kl_in_reward=true",
                f"model.use_fused_kernels={fused}",
                f"actor.use_torch_compile={compiled}",
            ]
        )
        seen.clear()
        trainer.train_step()
        passes = {"ref", "old_log_prob", "update_actor"}
        expected = {(p, "forward") for p in passes} | {("update_actor", "backward")}
        assert seen == (expected if compiled else set()), (compiled, seen)


@pytest.mark.parametrize(
    "mode, fused", [("decoupled", False), ("bypass", False), ("token_is", False), ("decoupled", True)]
)
def test_evaluate_phase_fills_every_key_from_the_right_model(mode, fused):
    """old log-probs from the actor (or the rollout), reference log-probs from the frozen copy,
    values from the critic, the score on the last token, KL in the reward, GAE, IS weights, and
    verl 0.9's actor/entropy (the sampling policy's, aggregated as the loss is); the same with
    the log-probs computed from the hidden states (model.use_fused_kernels)."""
    trainer = make_trainer(
        [
            *BATCH,
            "algorithm.use_kl_in_reward=true",
            "algorithm.kl_ctrl.kl_coef=0.3",
            "algorithm.lam=0.9",
            "algorithm.gamma=0.95",
            *MODES[mode],
            "actor.loss_agg_mode=seq-mean-token-sum-norm",
            "actor.loss_scale_factor=3",
            f"model.use_fused_kernels={str(fused).lower()}",
            *(["algorithm.rollout_correction.rollout_is_threshold=1.02"] if mode == "token_is" else []),
        ]
    )
    reference = copy.deepcopy(trainer.actor)
    perturb_rollout_log_probs(trainer)
    trainer.train_step()  # actor and critic move; the reference must not
    records = trainer.sampler.next_batch()
    batch, stats = trainer.make_experience(records, {})
    scores = batch["token_level_scores"].sum(-1)  # the sequence scores
    mask = batch["response_mask"].float()
    with torch.no_grad():
        actor_logp, actor_entropy = plain_forward(trainer.actor, batch)
        ref_logp, _ = plain_forward(reference, batch)
        values = plain_values(trainer.critic, batch)
    assert (actor_logp - ref_logp).abs().max() > 1e-3, "the actor should have moved"
    if mode == "bypass":  # no old-log-prob pass to take it from
        assert "actor/entropy" not in stats
    else:
        expected = plain_agg(actor_entropy, mask, "seq-mean-token-sum-norm", 3)
        assert stats["actor/entropy"].item() == pytest.approx(expected.item(), abs=PASSES)
    old = batch["rollout_log_probs"] if mode == "bypass" else actor_logp
    torch.testing.assert_close(batch["old_log_probs"], old, atol=PASSES, rtol=0)
    torch.testing.assert_close(batch["ref_log_prob"], ref_logp, atol=PASSES, rtol=0)
    torch.testing.assert_close(batch["values"], values, atol=PASSES, rtol=0)
    # the score of each response, from the reward function, on its last valid token only
    _, responses = decode_texts(trainer.tokenizer, batch)
    expected_scores = first_char_is_seven(None, responses, None)
    torch.testing.assert_close(scores, expected_scores)
    last = mask.sum(-1).long() - 1
    placed = torch.zeros_like(mask)
    placed[torch.arange(len(last)), last] = expected_scores
    torch.testing.assert_close(batch["token_level_scores"], placed)
    # KL in the reward: every valid token loses beta * (log pi_old - log pi_ref)
    kl = (batch["old_log_probs"] - batch["ref_log_prob"]) * mask
    torch.testing.assert_close(batch["token_level_rewards"], placed - 0.3 * kl)
    assert stats["actor/reward_kl_penalty"].item() == pytest.approx(
        ((kl.sum(-1) / mask.sum(-1)).mean()).item(), abs=1e-6
    )
    adv, returns = plain_gae(batch["token_level_rewards"], batch["values"], mask, 0.95, 0.9)
    valid = mask.bool()  # as verl's, padding holds whatever whitening leaves there; no loss reads it
    torch.testing.assert_close(batch["advantages"][valid], adv[valid], atol=1e-5, rtol=0)
    torch.testing.assert_close(batch["returns"][valid], returns[valid], atol=1e-5, rtol=0)
    if mode == "token_is":
        weights = torch.exp(batch["old_log_probs"] - batch["rollout_log_probs"]).clamp(max=1.02) * mask
        assert (weights[mask.bool()] < 0.9).any() and (weights == 1.02).any(), "both sides of 1 are exercised"
        torch.testing.assert_close(batch["rollout_is_weights"], weights)
    else:
        assert "rollout_is_weights" not in batch


def test_logged_data_metrics_match_their_formulas():
    """verl's compute_data_metrics: mean, max and min of each quantity, over rows or valid tokens."""
    trainer = make_trainer(
        [*BATCH, "data.max_response_length=3", "data.max_prompt_length=5", "algorithm.use_kl_in_reward=true"]
    )
    batches, _ = capture(trainer)
    trainer.train_step()
    m = trainer.train_step()
    assert m["prompt_length/clip_ratio"] == 1.0, "the task's prompts are all 5 tokens"
    b = dict(batches[-1])
    b["attention_mask"] = b["attention_mask"].clone()
    b["attention_mask"][:3, 0] = 0  # shorter, left-padded prompts in three rows
    b["attention_mask"][0, 1] = 0
    b["response_mask"] = b["response_mask"].clone()
    b["response_mask"][3:5, -1] = 0  # and two shorter responses
    b["attention_mask"][:, -3:] = b["response_mask"]
    mask = b["response_mask"].bool()
    for key in ("advantages", "returns", "values"):  # padding must not count
        b[key] = b[key].masked_fill(~mask, 1e3)
    m = gather(data_metrics(b, trainer.config, trainer.use_critic), [], trainer.device)
    b = {k: v.double() if v.is_floating_point() else v for k, v in b.items()}
    tokens = lambda key: [float(x) for x in b[key][mask]]
    rows = lambda key: [float(x) for x in b[key].sum(-1)]
    mean = lambda xs: sum(xs) / len(xs)
    var = lambda xs: sum((x - mean(xs)) ** 2 for x in xs) / (len(xs) - 1)
    response_length = [float(x) for x in b["response_mask"].sum(-1)]
    prompt_length = [float(x) for x in b["attention_mask"][:, : b["prompts"].shape[1]].sum(-1)]
    series = {
        "critic/score": rows("token_level_scores"),
        "critic/rewards": rows("token_level_rewards"),
        "critic/advantages": tokens("advantages"),
        "critic/returns": tokens("returns"),
        "critic/values": tokens("values"),
        "response_length": response_length,
        "prompt_length": prompt_length,
    }
    expected = {
        f"{name}/{stat}": f(xs)
        for name, xs in series.items()
        for stat, f in (("mean", mean), ("max", max), ("min", min))
    }
    residual = [r - v for r, v in zip(tokens("returns"), tokens("values"))]
    expected["critic/vf_explained_var"] = 1 - var(residual) / (var(tokens("returns")) + 1e-5)
    expected["response_length/clip_ratio"] = mean([float(x == 3) for x in response_length])
    expected["prompt_length/clip_ratio"] = mean(
        [float(x == trainer.config.data.max_prompt_length) for x in prompt_length]
    )
    assert 0 < expected["prompt_length/clip_ratio"] < 1 and 0 < expected["response_length/clip_ratio"] < 1
    assert expected["critic/advantages/max"] > expected["critic/advantages/min"]
    for key, value in expected.items():
        assert m[key] == pytest.approx(value, rel=1e-5, abs=1e-5), key


def test_aborted_responses_and_the_step_and_epoch_are_logged_as_verls():
    """verl's ``compute_data_metrics`` (``verl/trainer/ppo/metric_utils.py``) counts a response of no
    tokens as aborted: ``response/aborted_ratio`` and ``response_length_non_aborted/*`` over the
    others; its ``fit`` logs ``training/global_step`` (from 1) and ``training/epoch`` (the data
    loader's, from 0)."""
    trainer = make_trainer(["data.max_response_length=3"])
    batches, _ = capture(trainer)
    per_epoch = len(trainer.sampler.records) // trainer.config.data.train_batch_size
    steps = [trainer.train_step() for _ in range(per_epoch + 1)]
    assert [m["training/global_step"] for m in steps] == list(range(1, per_epoch + 2))
    assert [m["training/epoch"] for m in steps] == [0] * per_epoch + [1]
    assert steps[0]["response/aborted_ratio"] == 0
    assert steps[0]["response_length_non_aborted/mean"] == steps[0]["response_length/mean"]
    b = dict(batches[-1])
    width = b["responses"].shape[1]
    b["attention_mask"] = b["attention_mask"].clone()
    b["attention_mask"][:2, -width:] = 0  # two responses the engine aborted: no tokens
    m = gather(data_metrics(b, trainer.config, trainer.use_critic), [], trainer.device)
    lengths = [float(x) for x in b["attention_mask"][:, -width:].sum(-1)]
    kept = [x for x in lengths if x > 0]
    assert m["response/aborted_ratio"] == pytest.approx(2 / len(lengths))
    assert m["response_length_non_aborted/mean"] == pytest.approx(sum(kept) / len(kept))
    assert (m["response_length_non_aborted/max"], m["response_length_non_aborted/min"]) == (max(kept), min(kept))
    clipped = sum(x == 3 for x in kept) / len(kept)
    assert 0 < clipped < 1, "a vacuous check"
    assert m["response_length_non_aborted/clip_ratio"] == pytest.approx(clipped)


def test_vpred_mean_is_the_critic_s_mean_prediction_in_its_update():
    """verl's critic/vpred_mean: before the first update the critic predicts the batch's values."""
    trainer = make_trainer([*BATCH, "critic.ppo_micro_batch_size_per_gpu=2"])
    batch, _ = trainer.make_experience(trainer.sampler.next_batch(), {})
    batch["response_mask"] = batch["response_mask"].clone()
    batch["response_mask"][:3, 1:] = 0  # ragged, so the micro-batches hold different token counts
    first = minibatch_stats(trainer, batch, "critic")[0]
    mask = batch["response_mask"].bool()
    assert first["critic/vpred_mean"].item() == pytest.approx(batch["values"].double()[mask].mean().item(), rel=1e-5)


def test_throughput_metrics_are_verls():
    """verl's ``compute_timing_metrics`` counts a response's tokens from the attention mask
    (``_compute_response_info``), so rejection sampling, which masks tokens out of the loss, does
    not change them; ``compute_throughout_metrics`` divides by the time and the GPUs."""
    trainer = make_trainer([*BATCH, "data.max_response_length=3", "algorithm.use_kl_in_reward=true", *BYPASS_RS])
    perturb_rollout_log_probs(trainer)
    batches, _ = capture(trainer)
    m = trainer.train_step()
    b = batches[-1]
    width = b["responses"].shape[1]
    total, responses = int(b["attention_mask"].sum()), int(b["attention_mask"][:, -width:].sum())
    assert total > responses > int(b["response_mask"].sum()) > 0, "some sampled tokens rejected"
    assert m["perf/total_num_tokens"] == total and m["perf/time_per_step"] == m["timing_s/step"]
    assert m["perf/throughput"] == pytest.approx(total / m["timing_s/step"])
    assert throughput_metrics(b, {"timing_s/step": 2.0}, processes=4)["perf/throughput"] == total / 8
    assert m["timing_per_token_ms/gen"] == pytest.approx(m["timing_s/gen"] * 1000 / responses)
    for phase in ("ref", "values", "adv", "update_critic", "update_actor"):
        assert m[f"timing_per_token_ms/{phase}"] == pytest.approx(m[f"timing_s/{phase}"] * 1000 / total), phase
    assert not any(k.startswith("timing_per_token_ms/") for k in ("old_log_prob", "reward", "step"))


@pytest.mark.parametrize("mode", ["decoupled", "bypass"])
def test_rollout_probs_diff_is_verls_debug_metric(mode):
    trainer = make_trainer([*BATCH, "data.max_response_length=3", *MODES[mode]])
    batches, _ = capture(trainer)
    m = trainer.train_step()
    if mode == "bypass":  # old log-probs are the rollout's: nothing to compare
        assert not any(k.startswith("training/rollout_probs_diff") for k in m)
        return
    b = dict(batches[-1])
    # a sampler that disagrees with the trainer (as at a wrong temperature), and padding that
    # holds other numbers (two responses made one token shorter)
    b["old_log_probs"] = (b["rollout_log_probs"] + 0.5 * torch.randn_like(b["rollout_log_probs"])).clamp(max=0)
    b["response_mask"], b["attention_mask"] = b["response_mask"].clone(), b["attention_mask"].clone()
    b["response_mask"][:2, -1] = b["attention_mask"][:2, -1] = 0  # the sampled tokens, as generate records them
    mask = b["response_mask"].bool()
    b["rollout_log_probs"] = b["rollout_log_probs"].clone()
    b["old_log_probs"][:2, -1], b["rollout_log_probs"][:2, -1] = 0.0, -30.0  # the largest diff, in padding
    logged = gather(data_metrics(b, trainer.config, trainer.use_critic), [], trainer.device)
    every = (b["old_log_probs"].double().exp() - b["rollout_log_probs"].double().exp()).abs()
    diff = every[mask]
    expected = {"mean": diff.mean().item(), "max": diff.max().item(), "std": diff.std().item()}  # torch.std: unbiased
    assert expected["mean"] > 1e-3 and every.max() > expected["max"]
    for key, value in expected.items():
        assert logged[f"training/rollout_probs_diff_{key}"] == pytest.approx(value, rel=1e-5), key
    p, q = b["old_log_probs"].double().exp()[mask].tolist(), b["rollout_log_probs"].double().exp()[mask].tolist()
    mp, mq = sum(p) / len(p), sum(q) / len(q)
    cov = sum((x - mp) * (y - mq) for x, y in zip(p, q))
    pearson = cov / math.sqrt(sum((x - mp) ** 2 for x in p) * sum((y - mq) ** 2 for y in q))
    assert 0.2 < pearson < 0.999
    assert logged["training/rollout_actor_probs_pearson_corr"] == pytest.approx(pearson, rel=1e-4)
    assert m["training/rollout_actor_probs_pearson_corr"] > 0.9999
    assert m["training/rollout_probs_diff_max"] < 1e-4, "the trainer's own recomputation agrees with the sampler"


def test_kl_in_the_reward_reaches_the_critic_target_and_the_advantages_only():
    trainer = make_trainer([*BATCH, "algorithm.use_kl_in_reward=true", "algorithm.kl_ctrl.kl_coef=0.0"])
    trainer.train_step()
    records = trainer.sampler.next_batch()
    batch, _ = trainer.make_experience(records, {})
    with_beta = dict(batch)
    trainer.kl_ctrl.value = 0.7
    rows = [r for r in records for _ in range(trainer.config.rollout.n)]
    trainer.evaluate(with_beta, *trainer.score(with_beta, rows), {})  # the same responses, scored again
    mask = batch["response_mask"].bool()
    for key in ("token_level_rewards", "advantages", "returns"):
        assert (with_beta[key] - batch[key])[mask].abs().max() > 1e-4, key
    for key in ("old_log_probs", "ref_log_prob", "values", "token_level_scores"):
        torch.testing.assert_close(with_beta[key], batch[key], atol=PASSES, rtol=0)


def test_critic_warmup_updates_only_the_critic_and_then_both():
    trainer = make_trainer([*BATCH, "trainer.critic_warmup=3"])  # verl's count: 2 critic-only steps
    actor0 = [p.detach().clone() for p in trainer.learners["actor"].params]
    critic0 = [p.detach().clone() for p in trainer.learners["critic"].params]
    for step in range(3):
        trainer.train_step()
        actor_moved = any(not torch.equal(a, p) for a, p in zip(actor0, trainer.learners["actor"].params))
        critic_moved = any(not torch.equal(c, p) for c, p in zip(critic0, trainer.learners["critic"].params))
        assert critic_moved and actor_moved == (step >= 2), step


def test_reference_and_reward_inputs_never_get_gradients():
    trainer = make_trainer([*BATCH, "algorithm.use_kl_in_reward=true", "actor.use_kl_loss=true"])
    batches, _ = capture(trainer)
    trainer.train_step()
    for key, value in batches[-1].items():
        if torch.is_tensor(value) and value.is_floating_point():
            assert not value.requires_grad, key
    assert all(not p.requires_grad for p in trainer.reference.parameters())
    assert math.isfinite(trainer.train_step()["actor/kl_loss"])


def verl_minibatch_rows(rows: int, mini_batch_size: int, epochs: int, seed: int, shuffle: bool) -> list[int]:
    """The rows of verl 0.9's mini-batches, in training order: ``make_iterator`` in
    ``verl/utils/tensordict_utils.py`` as ``train_mini_batch`` (``verl/workers/engine_workers.py``)
    calls it on data-parallel rank 0 (seed + 0), transcribed: a fresh generator at every update, a
    DataLoader over the row numbers, one pass of it per epoch."""
    generator = torch.Generator()
    generator.manual_seed(seed)
    idx_lst = torch.arange(rows)
    train_dataloader = DataLoader(
        dataset=idx_lst, batch_size=mini_batch_size, collate_fn=lambda x: x, generator=generator, shuffle=shuffle
    )
    order = []
    for _ in range(epochs):
        for idx in train_dataloader:
            order += [int(i) for i in idx]
    return order


@pytest.mark.parametrize("shuffle", [True, False])
def test_mini_batches_come_in_verls_order(shuffle):
    """verl 0.9's ``_update_actor`` / ``_update_critic`` (``verl/trainer/ppo/v1/trainer_base.py``,
    and the legacy ``RayPPOTrainer``'s alike) pass ``seed=data_loader_seed`` and
    ``dataloader_kwargs={"shuffle": shuffle}`` (the critic's shuffle taken from the actor's by its
    YAML, its seed its own) to ``make_iterator`` (:func:`verl_minibatch_rows`): unshuffled, every
    epoch's mini-batches are the rows in order; shuffled, the orders of a generator seeded afresh at
    every update, so both steps' updates go through the same ones."""
    seeds = {"actor": 42, "critic": 7}
    trainer = make_trainer(
        [
            *BATCH,
            f"actor.shuffle={str(shuffle).lower()}",
            "actor.ppo_mini_batch_size=2",
            "actor.ppo_epochs=2",
            *([f"critic.data_loader_seed={seeds['critic']}"] if shuffle else []),
        ]
    )
    seen = {"actor": [], "critic": []}
    for name in seen:
        loss = getattr(trainer, f"_{name}_loss")
        setattr(
            trainer, f"_{name}_loss", lambda mb, _loss=loss, _name=name: seen[_name].append(mb["uid_row"]) or _loss(mb)
        )
    evaluate = trainer.evaluate

    def numbered(batch, *args, **kw):
        stats = evaluate(batch, *args, **kw)
        batch["uid_row"] = torch.arange(batch["response_mask"].shape[0])
        return stats

    trainer.evaluate = numbered
    for _ in range(2):
        trainer.train_step()
    orders = {name: torch.cat(rows).tolist() for name, rows in seen.items()}
    for name, order in orders.items():
        expected = verl_minibatch_rows(8, mini_batch_size=2, epochs=2, seed=seeds[name], shuffle=shuffle)
        assert order == expected * 2, (name, order)
        epochs = [order[:8], order[8:16]]
        assert all(sorted(epoch) == list(range(8)) for epoch in epochs), order
        assert (epochs[0] == epochs[1] == list(range(8))) == (not shuffle), (name, order)
    assert (orders["actor"] != orders["critic"]) == shuffle, "a vacuous check: the two seeds give one order"
    assert trainer.config.critic.shuffle is None, "the critic follows the actor's"


def test_a_verl_line_keeps_the_batchs_order():
    from refppo.settings.overrides import command_settings

    config, notes = command_settings("ppo", ["actor_rollout_ref.actor.optim.lr=1e-6"])
    assert config.actor.shuffle is False and "actor.shuffle=false" in notes[-1]
    config, _ = command_settings("ppo", ["actor_rollout_ref.actor.shuffle=true", "critic.shuffle=false"])
    assert config.actor.shuffle is True and config.critic.shuffle is False
    # verl reads the order's seed only to shuffle: at its default actor.shuffle=false it is unread
    seed = "actor_rollout_ref.actor.data_loader_seed=7"
    config, notes = command_settings("ppo", [seed, "actor_rollout_ref.actor.optim.lr=1e-6"])
    assert config.actor.data_loader_seed == 42 and "actor.data_loader_seed=7 is not read" in notes[0]
    config, _ = command_settings("ppo", [seed, "actor_rollout_ref.actor.shuffle=true"])
    assert config.actor.data_loader_seed == 7
    with pytest.raises(ValueError, match="actor.data_loader_seed is read only with actor.shuffle=true"):
        command_settings("ppo", ["actor.data_loader_seed=7", "actor.shuffle=false"])  # refppo's own line


def test_the_whole_loss_is_logged_as_verls_actor_loss_and_critic_loss():
    """verl's ``_postprocess_output`` (``verl/workers/engine_workers.py``) logs ``loss``, the sum of
    a mini-batch's micro-batch losses, as ``actor/loss`` and ``critic/loss`` (``_update_actor``
    renames it): the policy loss minus ``entropy_coeff`` x the entropy plus ``kl_loss_coef`` x the
    KL loss (``ppo_loss`` in ``verl/workers/utils/losses.py``), and the value loss."""
    trainer = make_trainer(
        [
            *BATCH,
            "actor.ppo_mini_batch_size=4",
            "actor.ppo_micro_batch_size_per_gpu=2",
            "actor.entropy_coeff=0.01",
            "actor.use_kl_loss=true",
            "actor.kl_loss_coef=0.3",
        ]
    )
    for stats in minibatch_stats(trainer, trainer.make_experience(trainer.sampler.next_batch(), {})[0], "actor"):
        terms = [stats["actor/pg_loss"], -0.01 * stats["actor/entropy_loss"], 0.3 * stats["actor/kl_loss"]]
        # both sides add the same 6 float32 products (3 terms x 2 micro-batches) in other orders
        scale = sum(abs(t.item()) for t in terms)
        assert stats["actor/loss"].item() == pytest.approx(sum(terms).item(), rel=0, abs=2 * reordered(6) * scale)
    m = trainer.train_step()
    assert m["critic/loss"] == m["critic/vf_loss"]  # one term of coefficient 1: the same sum
