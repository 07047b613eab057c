"""Any configuration that validates trains: random combinations of the trainer's options.

Each example draws estimator, policy mode and loss, aggregation modes, both KL placements and
their estimators, epochs, mini- and micro-batches (by rows or by a token budget), fused and
compiled kernels, activation checkpointing, sampling settings, warm-up and a LoRA actor or a
whole one, then runs three steps on the 1-layer model. What must hold in every combination:
finite metrics and weights, a first decoupled mini-batch at ratio 1, a zero KL to the reference
in step 1 (the reference is a copy of the actor, or the LoRA actor with its adapter off), and an
actor that moved exactly when a gradient reached it.
"""

import math

import torch
from _trainers import MODES, make_trainer
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

AGG = ("token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")
PROMPT_LEN = 16  # data.max_prompt_length's default
# The built-in names, not the registries' (other tests register their own there).
KL_TYPES = (
    "kl",
    "k1",
    "abs",
    "mse",
    "k2",
    "low_var_kl",
    "k3",
    "kl+",
    "k1+",
    "abs+",
    "mse+",
    "k2+",
    "low_var_kl+",
    "k3+",
)
LOSSES = ("clip", "penalty")


def _batching(draw, role: str, rows_per_mini: int, longest: int) -> list[str]:
    """Rows per micro-batch that divide the mini-batch, a token budget, or the whole mini-batch."""
    kind = draw(st.sampled_from(["whole", "rows", "tokens"]))
    if kind == "rows":
        return [
            f"{role}.ppo_micro_batch_size_per_gpu={draw(st.sampled_from([d for d in (1, 2, 4) if rows_per_mini % d == 0]))}"  # noqa: E501
        ]
    if kind == "tokens":
        return [f"{role}.use_dynamic_bsz=true", f"{role}.ppo_max_token_len_per_gpu={longest * draw(st.integers(1, 3))}"]
    return []


@st.composite
def configs(draw) -> tuple[list[str], int]:
    """Overrides of a valid config, the step from which the actor is updated, and a LoRA rank
    (0: the whole actor is trained)."""
    estimator = draw(st.sampled_from(["gae", "grpo", "rloo"]))
    n = draw(st.sampled_from([1, 2] if estimator == "gae" else [2, 3]))
    prompts = draw(st.sampled_from([2, 4]))
    response_len = draw(st.integers(1, 4))
    longest = PROMPT_LEN + response_len
    mini = draw(st.sampled_from([d for d in (1, 2, 4) if prompts % d == 0]))
    critic_mini = draw(st.sampled_from([d for d in (1, 2, 4) if prompts % d == 0]))
    mode = draw(st.sampled_from(["decoupled", "bypass", "token_is", "sequence_is"]))  # every loss takes weights
    if mode == "bypass":  # its own loss replaces actor.policy_loss (verl's apply_bypass_mode)
        bypass_loss = draw(st.sampled_from(["ppo_clip", "reinforce"]))
        loss = "clip"
        loss_setting = f"algorithm.rollout_correction.loss_type={bypass_loss}"
    else:
        bypass_loss = None
        loss = draw(st.sampled_from(LOSSES))
        loss_setting = f"actor.policy_loss={loss}"
    warmup = draw(st.sampled_from([0, 2])) if estimator == "gae" else 0  # a warm-up is for a critic
    overrides = [
        f"algorithm.adv_estimator={estimator}",
        f"rollout.n={n}",
        f"data.train_batch_size={prompts}",
        f"data.max_response_length={response_len}",
        f"actor.ppo_mini_batch_size={mini}",
        f"actor.ppo_epochs={draw(st.integers(1, 2))}",
        *MODES[mode],
        loss_setting,
        f"actor.loss_agg_mode={draw(st.sampled_from(AGG))}",
        f"actor.entropy_coeff={(coeff := draw(st.sampled_from([0.0, 0.01])))}",
        *([f"actor.calculate_entropy={draw(st.booleans())}"] if coeff == 0 else []),
        f"model.use_fused_kernels={draw(st.booleans())}",
        f"actor.use_torch_compile={draw(st.booleans())}",
        f"model.enable_gradient_checkpointing={draw(st.booleans())}",
        f"rollout.temperature={draw(st.sampled_from([0.7, 1.0]))}",
        f"rollout.top_k={draw(st.sampled_from([-1, 3]))}",
        f"rollout.top_p={draw(st.sampled_from([1.0, 0.8]))}",
        f"reward_model.missing_eos_penalty={draw(st.sampled_from([0.0, 1.0]))}",
        f"trainer.critic_warmup={warmup}",
        "trainer.total_training_steps=3",
        *_batching(draw, "actor", mini * n, longest),
    ]
    # Settings another one turns off are drawn only where they are read (validate refuses the rest).
    if loss == "penalty":
        overrides += [f"actor.penalty_kl_type={draw(st.sampled_from(KL_TYPES))}"]
    elif bypass_loss != "reinforce":  # REINFORCE has no clip
        overrides += [
            f"actor.clip_ratio_c={draw(st.sampled_from(['null', '3.0']))}",
            f"actor.clip_ratio_high={draw(st.sampled_from(['null', '0.28']))}",
        ]
    if draw(st.booleans()):
        overrides += ["actor.use_kl_loss=true", f"actor.kl_loss_type={draw(st.sampled_from(KL_TYPES))}"]
    if draw(st.booleans()):
        overrides += [
            "algorithm.use_kl_in_reward=true",
            f"algorithm.kl_penalty={draw(st.sampled_from(KL_TYPES))}",
            f"algorithm.kl_ctrl.type={draw(st.sampled_from(['fixed', 'adaptive', 'ppo_paper']))}",
        ]
    if estimator == "gae":
        overrides += [
            f"critic.ppo_mini_batch_size={critic_mini}",
            f"critic.ppo_epochs={draw(st.integers(1, 2))}",
            f"critic.loss_agg_mode={draw(st.sampled_from([*AGG, 'null']))}",  # null: the actor's
            f"critic.cliprange_value={draw(st.sampled_from(['null', '0.5']))}",
            f"critic.model.enable_gradient_checkpointing={draw(st.booleans())}",
            *_batching(draw, "critic", critic_mini * n, longest),
        ]
    return overrides, max(warmup, 1), draw(st.sampled_from([0, 4]))  # verl: the actor from step critic_warmup


def spread_reward(prompts, responses, records):
    """Scores that differ between most responses, so groups (GRPO, RLOO) rarely tie."""
    return torch.tensor([sum(map(ord, r)) % 7 / 7 for r in responses])


@settings(max_examples=100, suppress_health_check=[HealthCheck.too_slow])
@given(configs(), st.integers(0, 2**16))
def test_every_valid_combination_trains(drawn, seed):
    overrides, first_actor_step, lora_rank = drawn
    trainer = make_trainer(
        [*overrides, f"trainer.seed={seed}"], seed=seed, reward_fn=spread_reward, lora_rank=lora_rank
    )
    actor_before = [p.detach().clone() for p in trainer.actor.parameters()]
    config = trainer.config
    grad_norms = []
    tol = 1e-5  # float32 rounding of two passes (compiled or plain), summed over tokens by token-sum
    for step in (1, 2, 3):
        metrics = trainer.train_step()
        grad_norms.append(metrics.get("actor/grad_norm", 0.0))
        bad = {k: v for k, v in metrics.items() if not math.isfinite(v)}
        assert not bad, (overrides, lora_rank, step, bad)
        if step == 1:
            # The reference is a copy of the actor: every estimator gives 0 before the first update.
            # (in bypass mode with top-k or top-p the old log-probs are the sampler's, verl's
            # processed_logprobs: renormalised over the kept tokens, so not the reference's)
            rollout = config.rollout
            filtered_old = config.algorithm.rollout_correction.bypass_mode and (rollout.top_k > 0 or rollout.top_p < 1)
            if config.algorithm.use_kl_in_reward and not filtered_old:
                assert abs(metrics["actor/reward_kl_penalty"]) <= tol, (overrides, lora_rank)
        if step == first_actor_step:
            first = trainer.last_update_stats[0]
            if config.actor.use_kl_loss and step == 1:
                assert abs(first["actor/kl_loss"]) <= tol, (overrides, lora_rank)
            if (
                not config.algorithm.rollout_correction.bypass_mode
                and config.algorithm.rollout_correction.rollout_is is None
            ):
                assert abs(first["actor/ppo_kl"]) <= tol and first.get("actor/pg_clipfrac", 0.0) == 0.0, (
                    overrides,
                    lora_rank,
                )
    after = list(trainer.actor.parameters())
    assert all(torch.isfinite(p).all() for p in after), (overrides, lora_rank)
    # Adam moves a weight only where a gradient was (no weight decay): tied scores give none.
    moved = any(not torch.equal(a, b) for a, b in zip(actor_before, after))
    assert moved == any(g > 0 for g in grad_norms), (overrides, lora_rank, grad_norms)
