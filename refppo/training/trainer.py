"""The RLHF PPO loop (ch 5, 6): :meth:`PPOTrainer.train_step` reads as one step, in the notes'
three phases.

Generate

1. the actor samples ``rollout.n`` responses per prompt, recording their log-probs;
2. a reward model or a reward function scores them (here, beside the rollout, so that DAPO's
   dynamic sampling can repeat 1 and 2 until enough groups' scores differ).

Evaluate, without gradients

3. the reference's and the old policy's (the actor before this step's update) log-probs of the
   sampled tokens;
4. the critic's values, when the advantage estimator is GAE;
5. token-level rewards: the score on the last token, minus beta * KL per token with the KL in the
   reward; then rollout correction's weights and rejection;
6. advantages, from the estimator chosen by name, called as verl calls it.

Update

7. the critic's, then 8. the actor's (from step ``trainer.critic_warmup`` on, as verl counts):
   ``ppo_epochs`` x shuffled mini-batches x micro-batches (gradient accumulation; of a row count,
   or of a token budget with ``use_dynamic_bsz``), each model with its own optimiser, gradient
   clipping and LR schedule (:mod:`refppo.training.update`). Rows are reshuffled every epoch, as
   textbook PPO does, in verl's seeded order (``data_loader_seed``); with ``actor.shuffle=false``
   (verl's default) every epoch cuts the batch in its order, as verl does on one GPU (with several,
   verl first reorders the batch to balance their tokens).

9. Metrics, in verl's names, gathered to the host in one transfer.

:meth:`PPOTrainer.rollout` is 1-2, :meth:`PPOTrainer.evaluate` 3-6 (both together
:meth:`PPOTrainer.make_experience`) and :meth:`PPOTrainer.update` 7-8. With several processes
each generates, scores and evaluates its share of the rows; the rows are gathered before step 5
and each process takes its share of every mini-batch (:mod:`refppo.distributed`, whose calls do
nothing in one process).

The batch of a step: generate gives the keys listed in :mod:`refppo.rollout.prompts` and
:func:`refppo.rollout.generation.generate`; evaluate adds, all (B, R) float32 and 0 after the response
unless said:

- ``ref_log_prob``: log pi_ref of each response token (when a KL uses the reference);
- ``old_log_probs``: log pi_old, the actor before this step's update (the rollout's own
  log-probs in bypass mode); ``rollout_is_weights``: the truncated pi_old / pi_rollout (with
  ``algorithm.rollout_correction.rollout_is`` only);
- ``values``: the critic's V(s_t) (GAE only);
- ``token_level_scores``: the score on the last valid token; ``token_level_rewards``: the
  same minus beta * KL per token when ``algorithm.use_kl_in_reward``, else equal to it;
- ``reward_baselines``: (B,) the score of each prompt's greedy response (ReMax only);
- ``advantages``, ``returns``: from the advantage estimator.

The reward model and the reference are frozen. The values the update reads are checked once, at
the end of step 6.
"""

from __future__ import annotations

import dataclasses
import random
import time
from collections.abc import Callable
from pathlib import Path

import torch

from refppo import accel, distributed
from refppo.advantages import compute_advantage, get_adv_estimator_fn, needs_critic
from refppo.algorithms.bypass import apply_bypass_mode
from refppo.algorithms.overlong import overlong_shaped
from refppo.algorithms.rollout_correction import compute_rollout_is_weights, compute_rollout_rs_mask
from refppo.distributed import SINGLE, World
from refppo.functional import masked_mean
from refppo.guards.checks import broken_by_update, check_values, value_checks
from refppo.kl import get_kl_controller, kl_penalty
from refppo.losses import POLICY_LOSSES, agg_loss, compute_value_loss, get_policy_loss_fn, policy_loss_config
from refppo.rewards import apply_kl_penalty, apply_missing_eos_penalty, place_score_on_last_token
from refppo.rollout.forward import compute_scores, response_values
from refppo.rollout.generation import generate, row_uniforms
from refppo.rollout.models import make_reference
from refppo.rollout.prompts import decode_texts, tokenize_records
from refppo.rollout.router_replay import Routing
from refppo.settings.conditions import critic_only_steps, critic_warmup, policy_loss_in_use
from refppo.settings.config import Config, critic_setting
from refppo.training.checkpoint import STATE_FILE, load_models, save_models
from refppo.training.data import EpochSampler, schedule_steps
from refppo.training.dynamic_sampling import DynamicSampling
from refppo.training.metrics import (
    data_metrics,
    gather,
    gdpo_metrics,
    gradient_noise_proxies,
    peak_memory_gb,
    throughput_metrics,
    timer,
    variance_proxy_metrics,
)
from refppo.training.optim import make_optimizer
from refppo.training.reward_fns import RewardFn, check_scores, describe, reward_answers, split_reward_result
from refppo.training.update import Learner, LossTerm, UpdateSettings, minibatch_updates


class PPOTrainer:
    """Four-model PPO (or GRPO / RLOO without a critic) for a causal LM.

    Args:
        config: the run's Config (validated).
        tokenizer: a prepared tokenizer (pad distinct from EOS).
        actor: the causal LM to train (a peft model for LoRA), initialised from the SFT model;
            ``model.enable_gradient_checkpointing`` turns activation checkpointing on in it.
        critic: a scalar-head model when the advantage estimator is GAE, else None;
            ``critic.model.enable_gradient_checkpointing`` as for the actor.
        train_records, val_records: prompt dicts (``data.prompt_key`` plus whatever the reward
            function reads, e.g. "answer").
        reward_fn: ``fn(prompts, responses, records) -> (B,)`` scores, used when no reward model.
        reward_model: a frozen scalar-head model; takes precedence over ``reward_fn``.
        reference: the frozen reference; by default ``make_reference(actor)``.
        extra_reward_fns: name -> reward function reported (never trained on) for rollouts as
            ``reward/<name>/mean`` and at validation as ``val/<name>``, e.g. a gold reward.
        answer_fn: a response text's answer, for validation's maj@k (:mod:`refppo.training.validation`).
        world: this process's place among the run's processes (:mod:`refppo.distributed`).
    """

    def __init__(
        self,
        config: Config,
        tokenizer,
        actor,
        critic,
        train_records: list[dict],
        val_records: list[dict],
        reward_fn: RewardFn | None = None,
        reward_model=None,
        reference=None,
        extra_reward_fns: dict[str, RewardFn] | None = None,
        answer_fn: Callable[[str], str] | None = None,
        world: World = SINGLE,
    ):
        c = config
        distributed.check_world(c, world)
        if reward_fn is None and reward_model is None:
            raise ValueError("PPOTrainer needs a reward_fn or a reward_model")
        self.use_critic = needs_critic(c.algorithm.adv_estimator)
        if self.use_critic != (critic is not None):
            needs = "needs a critic" if self.use_critic else "uses no critic: pass critic=None"
            raise ValueError(f"algorithm.adv_estimator={c.algorithm.adv_estimator} {needs}")
        self.config = c
        self.tokenizer = tokenizer
        self.actor = actor
        self.critic = critic
        self.reward_fn = reward_fn
        self.reward_model = reward_model
        self.extra_reward_fns = extra_reward_fns or {}
        self.answer_fn = answer_fn
        self.val_records = val_records
        self.world = world
        self.device = actor.device
        self.need_ref = c.algorithm.use_kl_in_reward or c.actor.use_kl_loss
        if reference is None and self.need_ref:
            reference = make_reference(actor)
        self.reference = reference
        # the speed paths, chosen once (refppo.accel): the same numbers as the plain ones
        accel.prepare_models(c, actor, critic, self.reference, reward_model, world.distributed)
        # a mixture-of-experts actor's routing recorded and replayed (actor.router_replay)
        self.routing = Routing(actor, c.actor.router_replay)
        chosen = accel.select(c, self.device, world.distributed)
        self.accel = dataclasses.replace(chosen, actor=self.routing.passes(chosen.actor))
        self.sampling_model = self.accel.decoder(actor, c.data.max_prompt_length + c.data.max_response_length)
        for model in (actor, self.reference, critic, reward_model):  # under torchrun: FSDP2
            distributed.shard(model, world)
        self.sampler = EpochSampler(
            train_records, c.data.train_batch_size, c.trainer.seed, shuffle=c.data.shuffle, drop_last=True
        )
        self.kl_ctrl = get_kl_controller(**vars(c.algorithm.kl_ctrl))
        self.learners = {"actor": self._learner("actor", actor)}
        if self.use_critic:
            self.learners["critic"] = self._learner("critic", critic)
        self.step = 0
        self.last_update_stats: list[dict[str, float]] = []  # per actor mini-batch, for inspection

    def _learner(self, role: str, model) -> Learner:
        """``role``'s model ("actor" or "critic") with its optimiser and learning-rate schedule."""
        c = self.config
        params = [p for p in model.parameters() if p.requires_grad]
        steps = schedule_steps(c, len(self.sampler.records))
        optimizer, schedule = make_optimizer(params, getattr(c, role).optim, steps)
        return Learner(name=role, model=model, params=params, optimizer=optimizer, schedule=schedule)

    def _update_settings(self, role: str) -> UpdateSettings:
        """How ``role``'s update splits the batch, from the config and the speed paths as they are
        now (the critic's unset settings fall back to the actor's, as in verl)."""
        c = self.config

        def setting(name: str):
            return getattr(c.actor, name) if role == "actor" else critic_setting(c, name)

        return UpdateSettings(
            epochs=setting("ppo_epochs"),
            mini_rows=setting("ppo_mini_batch_size") * c.rollout.n,
            micro_rows=getattr(c, role).ppo_micro_batch_size_per_gpu,
            shuffle=setting("shuffle"),
            seed=getattr(c, role).data_loader_seed,
            grad_clip=getattr(c, role).optim.clip_grad,
            passes=self.accel.actor if role == "actor" else self.accel.critic,
        )

    # ---- one step ----------------------------------------------------------------------
    def train_step(self) -> dict[str, float]:
        """One PPO step, steps 1-9 of the module docstring; returns the step's metrics."""
        timing: dict[str, float] = {}
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        start = time.perf_counter()
        records = self.sampler.next_batch()
        # NaN or inf in these forward passes, after an update, means the update broke the model
        with broken_by_update(f"step {self.step + 1}", "actor.optim.lr or critic.optim.lr", self.step == 0):
            # generate: 1. sample responses, 2. score them
            batch, scores, extras, stats = self.rollout(records, timing)
            # evaluate: 3. log-probs, 4. values, 5. token-level rewards, 6. advantages
            stats |= self.evaluate(batch, scores, extras, timing)
        # update: 7. the critic, 8. the actor
        critic_stats, actor_stats = self.update(batch, timing)
        # 9. metrics
        metrics = self.step_metrics(batch, stats, critic_stats + actor_stats, timing, start)
        self.last_update_stats = [{k: float(v) for k, v in m.items()} for m in actor_stats]
        self.step += 1
        return metrics

    def make_experience(self, records: list[dict], timing: dict) -> tuple[dict, dict]:
        """Steps 1-6 (generate and evaluate) for a batch of prompt records: :meth:`rollout`, then
        :meth:`evaluate`.

        Args:
            records: the step's prompt records (``data.train_batch_size`` of them).
            timing: receives ``timing_s/gen``, ``timing_s/reward`` and the evaluate timings.

        Returns:
            (batch, stats): the batch holds every key of :func:`refppo.rollout.generation.generate` plus
            those ``evaluate`` adds, B = len(records) x rollout.n rows; the stats of both.
        """
        batch, scores, extras, stats = self.rollout(records, timing)
        return batch, stats | self.evaluate(batch, scores, extras, timing)

    # ---- generate: steps 1 and 2 ----------------------------------------------
    def rollout(self, records: list[dict], timing: dict):
        """Steps 1 and 2: this process's responses to ``records`` and their scores; with
        ``algorithm.filter_groups``, DAPO's dynamic sampling (:mod:`refppo.training.dynamic_sampling`):
        the groups whose scores differ, the sampler's next records generated for until there are
        ``len(records)`` of them.

        Returns:
            (batch, scores, extras, stats): as :meth:`generate_and_score`, and the dynamic
            sampling's stats (none without it).
        """
        c = self.config
        if not c.algorithm.filter_groups.enable:
            batch, scores, extras = self.generate_and_score(records, timing)
            return batch, scores, extras, {}
        limit = c.algorithm.filter_groups.max_num_gen_batches
        metric = c.algorithm.filter_groups.metric
        groups = DynamicSampling(len(records), c.rollout.n, limit, self.tokenizer.pad_token_id, metric=metric)
        groups.add(*self.generate_and_score(records, timing))
        while not groups.full:
            more = self.sampler.next_batch()
            groups.add(*self.generate_and_score(more, timing, first_row=groups.first_row))
        return groups.result()

    def generate_and_score(self, records: list[dict], timing: dict, first_row: int = 0):
        """This process's share of ``records``: its rollout (row ``first_row`` on of the step's
        draws) and the scores and extra scores of :meth:`score`; for ReMax, also the score of each
        prompt's greedy response (``reward_baselines``), as verl computes it."""
        n = self.config.rollout.n
        share = self.world.share(len(records))
        mine = records[share]
        remax = self.config.algorithm.adv_estimator == "remax"
        with timer(timing, "gen", self.device):
            with self.routing.sampling():
                batch = self.generate(mine, n, first_row=first_row + share.start * n)
            self.routing.keep_rollout_routes(batch)
            greedy = self.generate(mine, 1, do_sample=False) if remax else None  # ReMax's baseline
        batch["index"] += share.start
        with timer(timing, "reward", self.device):
            scores, extras = self.score(batch, [r for r in mine for _ in range(n)])
            if greedy is not None:  # each prompt's greedy score, for each of its n rows
                batch["reward_baselines"] = self.score(greedy, mine)[0].repeat_interleave(n)
        return batch, scores, extras

    def generate(
        self, records: list[dict], n: int, do_sample: bool = True, first_row: int = 0, stream: int = 0, sampling=None
    ) -> dict[str, torch.Tensor]:
        """Roll out ``n`` responses for each record's prompt (:func:`refppo.rollout.generation.generate`),
        row ``first_row + i`` of the step's whole batch drawn from its own numbers
        (:func:`refppo.rollout.generation.row_uniforms`; ``stream`` 1 or 2 for evaluation), at ``sampling``'s
        temperature, top_k and top_p (``rollout.val_kwargs``; None: ``rollout``'s)."""
        c = self.config
        s = sampling or c.rollout
        ids, mask = tokenize_records(self.tokenizer, records, c.data)
        limit = c.data.max_response_length
        rows = range(first_row, first_row + len(ids) * n)
        with distributed.Unsharded(self.actor, self.world):  # each token passes every layer: gather the weights once
            return generate(
                self.sampling_model,
                ids,
                mask,
                eos_token_id=self.tokenizer.eos_token_id,
                pad_token_id=self.tokenizer.pad_token_id,
                max_new_tokens=limit,
                do_sample=do_sample,
                temperature=s.temperature,
                top_k=s.top_k,
                top_p=s.top_p,
                ignore_eos=c.rollout.ignore_eos,
                n=n,
                uniforms=row_uniforms(c.trainer.seed, self.step, rows, limit, stream),
                logprobs_mode=c.rollout.logprobs_mode,
            )

    def score(self, batch: dict[str, torch.Tensor], rows: list[dict]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """Sequence scores (B,) for training, and the extra scores by name: the other numbers of a
        reward function's dict results (which GDPO reads), DAPO's overlong terms and the extra
        reward functions' (reported only).

        With ``reward_model.reward_manager=dapo`` a rule's score gets DAPO's overlong shaping, as
        verl's DAPO reward manager adds it. A response that hit the length limit without EOS loses
        ``reward_model.missing_eos_penalty``: a reward model never saw unfinished responses.
        """
        scores, extras, _ = self.score_and_answers(batch, rows)
        return scores, extras

    def score_and_answers(
        self, batch: dict[str, torch.Tensor], rows: list[dict]
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor], list | None]:
        """:meth:`score`, and the answers a reward function's dict results parsed (their ``"pred"``,
        which validation's maj@k votes on; :func:`refppo.training.reward_fns.reward_answers`), a
        (B,) list or None."""
        rm = self.config.reward_model
        texts = None
        extras = {}
        answers = None
        if self.reward_model is not None:
            scores = compute_scores(self.reward_model, batch, rm.micro_batch_size_per_gpu)
        else:
            texts = decode_texts(self.tokenizer, batch)
            source = f"reward function {describe(self.reward_fn)}"
            result = self.reward_fn(*texts, rows)
            scores, extras = split_reward_result(result, len(rows), source)
            answers = reward_answers(result, len(rows), source)
            if rm.reward_manager == "dapo" and rm.overlong_buffer.enable:
                buffer = rm.overlong_buffer
                limit = rm.max_resp_len or self.config.data.max_response_length
                scores, overlong = overlong_shaped(
                    scores, batch["response_mask"], limit, buffer.len, buffer.penalty_factor, buffer.log
                )
                extras |= overlong
        if rm.missing_eos_penalty > 0:
            scores = apply_missing_eos_penalty(scores.to(self.device), batch["is_truncated"], rm.missing_eos_penalty)
        for name, fn in self.extra_reward_fns.items():
            texts = texts or decode_texts(self.tokenizer, batch)
            extras[name] = check_scores(fn(*texts, rows), len(rows), f"reward function {name!r}")
        return scores.to(self.device), extras, answers

    # ---- evaluate: steps 3 to 6 ---------------------------------------------------------
    def evaluate(self, batch: dict[str, torch.Tensor], scores: torch.Tensor, extras: dict, timing: dict) -> dict:
        """Steps 3-6: add the keys listed in the module docstring to a scored batch.

        Args:
            batch: a rollout from :meth:`generate`, B rows.
            scores, extras: its scores (B,) and extra scores by name, from :meth:`score`.
            timing: receives ``timing_s/ref``, ``/old_log_prob``, ``/values``, ``/adv``.

        Returns:
            Metrics as detached scalars: ``reward/<name>/mean`` of the extra reward functions,
            ``actor/entropy`` (the sampling policy's, from the old-log-prob pass: none in
            bypass mode, as in verl 0.9), with KL in the reward its estimate and coefficient, and
            rollout correction's.
        """
        c = self.config
        # 3. the reference's and the old policy's log-probs of the sampled tokens
        entropy = self.log_probs(batch, timing)
        # 4. the critic's values of the states before each response token
        if self.use_critic:
            with timer(timing, "values", self.device):
                micro = c.critic.ppo_micro_batch_size_per_gpu
                batch["values"] = self.accel.critic.compute_values(self.critic, batch, micro)
        # with several processes each evaluated its own rows: from here on every process has them all
        pad = self.tokenizer.pad_token_id
        scores, extras, entropy = distributed.gather_evaluated(batch, scores, extras, entropy, pad, self.world)
        mask = batch["response_mask"]  # the sampled tokens, before rollout correction rejects any
        stats = {f"reward/{name}/mean": v.mean() for name, v in extras.items()}
        if c.algorithm.adv_estimator == "gdpo":
            stats |= gdpo_metrics(extras, c.algorithm.gdpo_reward_keys)
        with timer(timing, "adv", self.device):
            # 5. token-level rewards (with the KL in the reward), then rollout correction
            stats |= self.token_level_rewards(batch, scores)
            stats |= self.rollout_correction(batch)
            # 6. advantages
            name = c.algorithm.adv_estimator
            estimator = self.accel.adv_estimators.get(name) or get_adv_estimator_fn(name)
            advantages, returns = compute_advantage(
                batch, adv_estimator=name, adv_estimator_fn=estimator, config=c.algorithm, non_tensor_batch=extras
            )
            batch["advantages"] = advantages
            batch["returns"] = returns
        # The update reads these in every micro-batch: check their values here, once per step.
        read = ("old_log_probs", "ref_log_prob", "values", "advantages", "returns")
        finite = {k: batch[k] for k in read if k in batch}
        if entropy is not None:
            finite["entropy"] = entropy
        check_values(masks={"response_mask": mask}, finite=finite, where=mask)
        if entropy is not None:
            with value_checks(False):  # checked just above
                # verl 0.9's actor/entropy: the sampling policy's, over the batch, aggregated as the loss is
                scale = self._loss_scale_factor(c.actor.loss_scale_factor)
                stats["actor/entropy"] = agg_loss(entropy, mask, c.actor.loss_agg_mode, scale)
        return stats

    def log_probs(self, batch: dict[str, torch.Tensor], timing: dict) -> torch.Tensor | None:
        """Step 3: ``ref_log_prob`` (when a KL reads the reference) and ``old_log_probs`` (in
        bypass mode the sampler's own) of the sampled tokens, into ``batch``.

        Returns:
            The sampling policy's entropy (B, R) from the old-log-prob pass; None in bypass mode,
            which runs none.
        """
        c = self.config
        passes = self.accel.actor
        temperature = c.rollout.temperature
        if self.need_ref:
            with timer(timing, "ref", self.device):
                micro = c.ref.log_prob_micro_batch_size_per_gpu
                batch["ref_log_prob"] = passes.compute_log_probs(self.reference, batch, temperature, micro)
        if c.algorithm.rollout_correction.bypass_mode:
            batch["old_log_probs"] = batch["rollout_log_probs"]
            return None
        with timer(timing, "old_log_prob", self.device):
            micro = c.rollout.log_prob_micro_batch_size_per_gpu
            with self.routing.old_log_prob_pass(batch) as routed:
                old_log_probs, entropy = passes.compute_log_probs(self.actor, routed, temperature, micro, True)
            if c.actor.calculate_sum_pi_squared:  # verl computes it in the same pass; here a second one, routed alike
                with self.routing.replaying():
                    batch["sum_pi_squared"] = passes.compute_sum_pi_squared(self.actor, batch, temperature, micro)
        batch["old_log_probs"] = old_log_probs
        return entropy

    def token_level_rewards(self, batch: dict[str, torch.Tensor], scores: torch.Tensor) -> dict[str, torch.Tensor]:
        """Step 5: ``token_level_scores``, the score on each response's last token, and
        ``token_level_rewards``, the same minus beta * KL(old || ref) per token with
        ``algorithm.use_kl_in_reward`` (whose controller then updates beta); returns the KL's
        metrics."""
        c = self.config
        mask = batch["response_mask"]
        batch["token_level_scores"] = place_score_on_last_token(scores, mask)
        batch["token_level_rewards"] = batch["token_level_scores"]
        if not c.algorithm.use_kl_in_reward:
            return {}
        beta = self.kl_ctrl.value
        rewards, current_kl = apply_kl_penalty(
            batch["token_level_scores"],
            old_log_probs=batch["old_log_probs"],
            ref_log_prob=batch["ref_log_prob"],
            response_mask=mask,
            kl_coef=beta,
            kl_penalty=c.algorithm.kl_penalty,
        )
        batch["token_level_rewards"] = rewards
        self.kl_ctrl.update(float(current_kl), n_steps=mask.shape[0])
        return {"actor/reward_kl_penalty": current_kl, "actor/reward_kl_penalty_coeff": torch.tensor(beta)}

    def rollout_correction(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Step 5, rollout correction (:mod:`refppo.algorithms.rollout_correction`):
        ``rollout_is_weights`` for the loss, then rejection sampling, which zeroes the rejected
        tokens of ``response_mask`` before the advantages (in that order, as verl); returns the
        rejection's metrics. Bypass mode has none here: its loss computes both, against the policy
        being updated (:mod:`refppo.algorithms.bypass`)."""
        rc = self.config.algorithm.rollout_correction
        if rc.bypass_mode:
            return {}
        mask = batch["response_mask"]
        old = batch["old_log_probs"]
        if rc.rollout_is is not None:
            batch["rollout_is_weights"] = compute_rollout_is_weights(
                old,
                batch["rollout_log_probs"],
                mask,
                threshold=rc.rollout_is_threshold,
                level=rc.rollout_is,
                batch_normalize=rc.rollout_is_batch_normalize,
            )
        if rc.rollout_rs is None:
            return {}
        batch["response_mask"], rejected = compute_rollout_rs_mask(
            old, batch["rollout_log_probs"], mask, rc.rollout_rs, rc.rollout_rs_threshold
        )
        return rejected

    # ---- update: steps 7 and 8 ------------------------------------------------------------
    def update(self, batch: dict[str, torch.Tensor], timing: dict) -> tuple[list[dict], list[dict]]:
        """Steps 7 and 8: the critic's update, then the actor's (from step ``trainer.critic_warmup``
        on, counted from 1 as verl counts, with or without a critic: :func:`critic_only_steps`).

        Args:
            batch: an evaluated batch (see :meth:`make_experience`).
            timing: receives ``timing_s/update_critic`` and ``timing_s/update_actor``.

        Returns:
            (critic stats, actor stats): one dict of detached scalars per mini-batch update.
        """
        critic_stats = []
        if self.use_critic:
            critic_stats = self.update_model(self.learners["critic"], self._critic_loss, batch, timing)
        actor_stats = []
        if self.step >= critic_only_steps(critic_warmup(self.config)):
            with self.routing.replaying():
                actor_stats = self.update_model(self.learners["actor"], self._actor_loss, batch, timing)
        return critic_stats, actor_stats

    def update_model(self, learner: Learner, micro_loss: Callable, batch: dict, timing: dict) -> list[dict]:
        """``learner``'s mini-batch updates (:func:`refppo.training.update.minibatch_updates`) with
        ``micro_loss``, then its schedule's step; ``<name>/lr`` is the rate after it, as verl logs
        it."""
        learner.model.train()
        with timer(timing, f"update_{learner.name}", self.device):
            settings = self._update_settings(learner.name)
            stats = minibatch_updates(batch, learner, settings, micro_loss, self.world)
        learner.model.eval()
        learner.schedule.step()
        lr = torch.tensor(learner.schedule.get_last_lr()[0])
        return [s | {f"{learner.name}/lr": lr} for s in stats]

    def _actor_loss(self, mb: dict[str, torch.Tensor]) -> tuple[dict[str, LossTerm], dict[str, torch.Tensor]]:
        """A micro-batch's actor loss as its terms: the policy loss chosen by name (called as verl
        calls it, aggregated as it aggregates), the entropy bonus and the KL loss; and the policy
        loss's other stats."""
        a = self.config.actor
        mask = mb["response_mask"]
        # actor/entropy comes from the old-log-prob pass (verl 0.9); here only for the bonus or if asked
        with_entropy = a.entropy_coeff != 0 or a.calculate_entropy
        temperature = self.config.rollout.temperature
        log_prob, entropy = self.accel.actor.log_probs(self.actor, mb, temperature, with_entropy)
        scale = self._loss_scale_factor(a.loss_scale_factor)
        loss_name = policy_loss_in_use(self.config)
        config = policy_loss_config(a, loss_scale_factor=scale)
        if loss_name == "bypass_mode":
            config = apply_bypass_mode(config, self.config.algorithm.rollout_correction)
        policy_loss_fn = get_policy_loss_fn(loss_name)
        pg_loss, pg_metrics = policy_loss_fn(  # verl 0.9's call
            old_log_prob=mb["old_log_probs"],
            log_prob=log_prob,
            advantages=mb["advantages"],
            response_mask=mask,
            loss_agg_mode=a.loss_agg_mode,
            config=config,
            rollout_is_weights=mb.get("rollout_is_weights"),
        )
        pg_mode = POLICY_LOSSES.aggregation(loss_name, a.loss_agg_mode)  # GSPO, SAPO, GMPO: their own
        terms = {"actor/pg_loss": LossTerm(pg_loss, pg_mode)}
        stats = {}
        for name, value in pg_metrics.items():  # a loss written for verl returns floats
            # verl's _update_actor puts actor/ before every name without it (bypass mode's rollout_corr/*)
            logged = name if name.startswith("actor/") else f"actor/{name}"
            stats[logged] = torch.as_tensor(value, device=mask.device)
        if entropy is not None:  # without the bonus only logged (verl adds 0 x entropy_loss)
            entropy_loss = agg_loss(entropy, mask, a.loss_agg_mode, scale)
            terms["actor/entropy_loss"] = LossTerm(entropy_loss, a.loss_agg_mode, coefficient=-a.entropy_coeff)
        if a.use_kl_loss:
            kl_loss = agg_loss(kl_penalty(log_prob, mb["ref_log_prob"], a.kl_loss_type), mask, a.loss_agg_mode, scale)
            terms["actor/kl_loss"] = LossTerm(kl_loss, a.loss_agg_mode, coefficient=a.kl_loss_coef)
        return terms, stats

    def _loss_scale_factor(self, configured: float | None) -> float:
        """seq-mean-token-sum-norm's constant divisor: as configured, else the longest response
        allowed (never the batch's width, which changes when generation stops early)."""
        return self.config.data.max_response_length if configured is None else configured

    def _critic_loss(self, mb: dict[str, torch.Tensor]) -> tuple[dict[str, LossTerm], dict[str, torch.Tensor]]:
        """A micro-batch's value loss, as its one term, and the critic's other stats."""
        c = self.config
        mask = mb["response_mask"]
        vpreds = response_values(self.critic, mb)
        mode = critic_setting(c, "loss_agg_mode")
        scale = self._loss_scale_factor(critic_setting(c, "loss_scale_factor"))
        vf_loss, vf_clipfrac = compute_value_loss(
            vpreds, mb["returns"], mb["values"], mask, c.critic.cliprange_value, mode, scale
        )
        vpred_mean = masked_mean(vpreds.detach(), mask)
        terms = {"critic/vf_loss": LossTerm(vf_loss, mode)}
        return terms, {"critic/vf_clipfrac": vf_clipfrac, "critic/vpred_mean": vpred_mean}

    # ---- step 9: metrics ----------------------------------------------------------------
    def step_metrics(self, batch: dict, stats: dict, update_stats: list[dict], timing: dict, start: float) -> dict:
        """Step 9: the step's metrics in verl's names, gathered to the host in one transfer, with
        the timings (the step's from ``start``, a ``time.perf_counter()``), throughput, peak
        memory, and the step (from 1) and the data's epoch (from 0) as verl's ``fit`` logs them."""
        c = self.config
        with value_checks(False):  # the batch was checked before the updates
            data = data_metrics(batch, c, self.use_critic)
            if "sum_pi_squared" in batch:  # verl logs these whenever the actor computed it
                data |= variance_proxy_metrics(batch)
            metrics = gather(data | stats, update_stats, self.device)
        if "sum_pi_squared" in batch:
            metrics |= gradient_noise_proxies(metrics, rows=batch["response_mask"].shape[0])
        timing["timing_s/step"] = time.perf_counter() - start
        metrics.update(timing)
        metrics |= throughput_metrics(batch, timing, processes=self.world.size)
        metrics["perf/max_memory_allocated_gb"] = peak_memory_gb(self.device)
        metrics["training/global_step"] = self.step + 1  # verl's fit counts steps from 1
        metrics["training/epoch"] = self.sampler.batch_epoch
        if c.actor.use_kl_loss:
            metrics["actor/kl_coef"] = c.actor.kl_loss_coef
        return metrics

    # ---- checkpoints -------------------------------------------------------------------
    def _models_and_optimizers(self) -> dict:
        """The trained models and their optimisers by name, as the checkpoint files hold them."""
        return {name: (learner.model, learner.optimizer) for name, learner in self.learners.items()}

    def save_checkpoint(self, folder: Path) -> None:
        """Everything a resumed run needs to continue exactly: the models and optimisers
        (:func:`refppo.training.checkpoint.save_models`; every process its shard), and in ``folder/trainer_state.pt``
        the step, the schedules, the KL controller, the data position and the generators."""
        save_models(folder, self._models_and_optimizers(), self.world)
        if not self.world.main:
            return
        state = {"step": self.step, "kl_ctrl": vars(self.kl_ctrl).copy(), "sampler": self.sampler.state_dict()}
        state |= {f"{name}_sched": learner.schedule.state_dict() for name, learner in self.learners.items()}
        state |= {
            "torch_rng": torch.get_rng_state(),
            "python_rng": random.getstate(),
        }
        torch.save(state, folder / STATE_FILE)

    def load_checkpoint(self, folder: Path, state: dict) -> None:
        """Restore :meth:`save_checkpoint`'s ``folder``, whose ``trainer_state.pt`` holds ``state``
        (a run saved by any number of processes)."""
        load_models(folder, self._models_and_optimizers(), self.world)
        for name, learner in self.learners.items():
            learner.schedule.load_state_dict(state[f"{name}_sched"])
        self.step = state["step"]
        vars(self.kl_ctrl).update(state["kl_ctrl"])
        self.sampler.load_state_dict(state["sampler"])
        torch.set_rng_state(state["torch_rng"])
        random.setstate(state["python_rng"])
