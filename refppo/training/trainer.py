"""The RLHF PPO loop (ch 5, 6): one step in the notes' three phases.

1. Generate: the actor samples ``rollout.n`` responses per prompt, recording their log-probs.
2. Evaluate: scores (reward model or rule), reference and old log-probs, values, token-level
   rewards (KL in the reward when ``algorithm.use_kl_in_reward``), advantages.
3. Update: ``ppo_epochs`` x shuffled mini-batches x micro-batches (gradient accumulation; of a
   row count, or of a token budget with ``use_dynamic_bsz``) for the critic and the actor, each with
   its own optimiser, gradient clipping and LR schedule. Rows are reshuffled every epoch, as textbook
   PPO does; verl cuts its batch in order (reordered by length to balance its GPUs) every epoch.

The batch of a step: generate gives the keys listed in :mod:`refppo.rollout.prompts` and
:func:`refppo.rollout.generation.generate`; evaluate adds, all (B, R) float32 and 0 after the response
unless said:

- ``ref_log_prob``: log pi_ref of each response token (when a KL uses the reference);
- ``old_log_probs``: log pi_old, the actor before this step's update (the rollout's own
  log-probs in bypass mode); ``rollout_is_weights``: the truncated pi_old / pi_rollout (with
  ``algorithm.rollout_correction.rollout_is`` only);
- ``values``: the critic's V(s_t) (when the advantage estimator reads values);
- ``token_level_scores``: the score on the last valid token; ``token_level_rewards``: the
  same minus beta * KL per token when ``algorithm.use_kl_in_reward``, else equal to it;
- ``reward_baselines``: (B,) the score of each prompt's greedy response (ReMax only);
- ``advantages``, ``returns``: from the advantage estimator.

The reward model and the reference are frozen. Metrics use verl's names, gathered in one host
transfer per step; the values the update reads are checked once, at the end of phase 2.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from pathlib import Path

import torch

from refppo import accel, distributed
from refppo.advantages import compute_advantage, get_adv_estimator_fn, needs_critic
from refppo.algorithms.overlong import overlong_shaped
from refppo.algorithms.rollout_correction import compute_rollout_is_weights, compute_rollout_rs_mask
from refppo.distributed import SINGLE, World
from refppo.functional import masked_mean
from refppo.guards.checks import broken_by_update, check_values, value_checks
from refppo.kl import get_kl_controller, kl_penalty
from refppo.losses import agg_loss, compute_value_loss, get_policy_loss_fn, policy_loss_config
from refppo.rewards import apply_kl_penalty, apply_missing_eos_penalty, place_score_on_last_token
from refppo.rollout.forward import compute_scores, response_values
from refppo.rollout.generation import generate, row_uniforms
from refppo.rollout.models import make_reference
from refppo.rollout.prompts import decode_texts, tokenize_records
from refppo.settings.config import Config, critic_setting
from refppo.training.checkpoint import STATE_FILE, load_models, save_models
from refppo.training.data import EpochSampler
from refppo.training.dynamic_sampling import fill_batch
from refppo.training.metrics import data_metrics, gather, peak_memory_gb, throughput_metrics, timer
from refppo.training.optim import make_optimizer
from refppo.training.reward_fns import RewardFn, check_scores, describe
from refppo.training.update import minibatch_updates


class PPOTrainer:
    """Four-model PPO (or GRPO / RLOO without a critic) for a causal LM.

    Args:
        config: the run's Config (validated).
        tokenizer: a prepared tokenizer (pad distinct from EOS).
        actor: the causal LM to train (a peft model for LoRA), initialised from the SFT model;
            ``model.enable_gradient_checkpointing`` turns activation checkpointing on in it.
        critic: a scalar-head model when the advantage estimator reads ``values`` (GAE), else None;
            ``critic.model.enable_gradient_checkpointing`` as for the actor.
        train_records, val_records: prompt dicts (``data.prompt_key`` plus whatever the reward
            function reads, e.g. "answer").
        reward_fn: ``fn(prompts, responses, records) -> (B,)`` scores, used when no reward model.
        reward_model: a frozen scalar-head model; takes precedence over ``reward_fn``.
        reference: the frozen reference; by default ``make_reference(actor)``.
        extra_reward_fns: name -> reward function reported (never trained on) for rollouts as
            ``reward/<name>/mean`` and at validation as ``val/<name>``, e.g. a gold reward.
        answer_fn: a response text's answer, for validation's maj@k (:mod:`refppo.training.validation`).
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
        self.config, self.tokenizer, self.actor, self.critic = c, tokenizer, actor, critic
        self.reward_fn, self.reward_model = reward_fn, reward_model
        self.extra_reward_fns, self.answer_fn = extra_reward_fns or {}, answer_fn
        self.val_records, self.world = val_records, world
        self.device = actor.device
        self.need_ref = c.algorithm.use_kl_in_reward or c.actor.use_kl_loss
        self.reference = reference if reference is not None or not self.need_ref else make_reference(actor)
        # the speed paths, chosen once (refppo.accel): the same numbers as the plain ones
        accel.prepare_models(c, actor, critic, self.reference, reward_model, world.distributed)
        self.accel = accel.select(c, self.device, world.distributed)
        self.sampling_model = self.accel.decoder(actor, c.data.max_prompt_length + c.data.max_response_length)
        for model in (actor, self.reference, critic, reward_model):  # under torchrun: FSDP2
            distributed.shard(model, world)
        self.sampler = EpochSampler(train_records, c.data.train_batch_size, c.trainer.seed)
        self.kl_ctrl = get_kl_controller(**vars(c.algorithm.kl_ctrl))
        total = c.trainer.total_training_steps
        self.actor_params = [p for p in actor.parameters() if p.requires_grad]
        self.actor_opt, self.actor_sched = make_optimizer(self.actor_params, c.actor.optim, total)
        if self.use_critic:
            self.critic_params = [p for p in critic.parameters() if p.requires_grad]
            self.critic_opt, self.critic_sched = make_optimizer(self.critic_params, c.critic.optim, total)
        self.shuffle_gen = torch.Generator().manual_seed(c.trainer.seed + 1)  # mini-batch order
        self.step = 0
        self.last_update_stats: list[dict[str, float]] = []  # per actor mini-batch, for inspection
        self.skipped_in_a_row: dict[str, int] = {}  # "actor" / "critic" -> updates skipped (non-finite grad)

    # ---- phase 1: generate -------------------------------------------------------------
    def generate(
        self, records: list[dict], n: int, do_sample: bool = True, first_row: int = 0, stream: int = 0, sampling=None
    ) -> dict[str, torch.Tensor]:
        """Roll out ``n`` responses for each record's prompt (:func:`refppo.rollout.generation.generate`),
        row ``first_row + i`` of the step's whole batch drawn from its own numbers
        (:func:`refppo.rollout.generation.row_uniforms`; ``stream`` 1 or 2 for evaluation), at ``sampling``'s
        temperature, top_k and top_p (``rollout.val_kwargs``; None: ``rollout``'s)."""
        c, tok = self.config, self.tokenizer
        s = sampling or c.rollout
        ids, mask = tokenize_records(tok, records, c.data)
        limit, rows = c.data.max_response_length, range(first_row, first_row + len(ids) * n)
        kwargs = dict(temperature=s.temperature, top_k=s.top_k, top_p=s.top_p, ignore_eos=c.rollout.ignore_eos, n=n)
        kwargs["uniforms"] = row_uniforms(c.trainer.seed, self.step, rows, limit, stream)
        with distributed.Unsharded(self.actor, self.world):  # each token passes every layer: gather the weights once
            model, eos, pad = self.sampling_model, tok.eos_token_id, tok.pad_token_id
            return generate(model, ids, mask, eos, pad, limit, do_sample=do_sample, **kwargs)

    def score(self, batch: dict[str, torch.Tensor], rows: list[dict]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """Sequence scores (B,) for training, and the extra (reported-only) scores by name.

        With ``reward_model.reward_manager=dapo`` a rule's score gets DAPO's overlong shaping, as
        verl's DAPO reward manager adds it. A response that hit the length limit without EOS loses
        ``reward_model.missing_eos_penalty``: a reward model never saw unfinished responses.
        """
        texts, extras, rm = None, {}, self.config.reward_model
        if self.reward_model is not None:
            scores = compute_scores(self.reward_model, batch, rm.micro_batch_size_per_gpu)
        else:
            texts = decode_texts(self.tokenizer, batch)
            scores = check_scores(
                self.reward_fn(*texts, rows), len(rows), f"reward function {describe(self.reward_fn)}"
            )
            if rm.reward_manager == "dapo" and rm.overlong_buffer.enable:
                limit, b = rm.max_resp_len or self.config.data.max_response_length, rm.overlong_buffer
                scores, extras = overlong_shaped(scores, batch["response_mask"], limit, b.len, b.penalty_factor, b.log)
        if rm.missing_eos_penalty > 0:
            scores = apply_missing_eos_penalty(scores.to(self.device), batch["is_truncated"], rm.missing_eos_penalty)
        for name, fn in self.extra_reward_fns.items():
            texts = texts or decode_texts(self.tokenizer, batch)
            extras[name] = check_scores(fn(*texts, rows), len(rows), f"reward function {name!r}")
        return scores.to(self.device), extras

    # ---- phase 2: evaluate -------------------------------------------------------------
    def evaluate(self, batch: dict[str, torch.Tensor], scores: torch.Tensor, extras: dict, timing: dict) -> dict:
        """Add the keys listed in the module docstring to a scored batch.

        Args:
            batch: a rollout from :meth:`generate`, B rows.
            scores, extras: its scores (B,) and extra scores by name, from :meth:`score`.
            timing: receives ``timing_s/ref``, ``/old_log_prob``, ``/values``, ``/adv``.

        Returns:
            Metrics as detached scalars: ``reward/<name>/mean`` of the extra reward functions,
            ``actor/entropy`` (the sampling policy's, from the old-log-prob pass: none in
            bypass mode, as in verl 0.9) and, with KL in the reward, its estimate and
            coefficient.
        """
        c, mask, device, passes = self.config, batch["response_mask"], self.device, self.accel.actor
        temp, correction = c.rollout.temperature, c.algorithm.rollout_correction
        # 2b. log pi_ref and log pi_old of the sampled tokens (bypass takes the sampler's as pi_old)
        if self.need_ref:
            with timer(timing, "ref", device):
                micro = c.ref.log_prob_micro_batch_size_per_gpu
                batch["ref_log_prob"] = passes.compute_log_probs(self.reference, batch, temp, micro)
        entropy = None  # (B, R): the sampling policy's, from the old-log-prob pass (bypass runs none)
        if correction.bypass_mode:
            batch["old_log_probs"] = batch["rollout_log_probs"]
        else:
            with timer(timing, "old_log_prob", device):
                micro = c.rollout.log_prob_micro_batch_size_per_gpu
                batch["old_log_probs"], entropy = passes.compute_log_probs(self.actor, batch, temp, micro, True)
        # 2c. the critic's values
        if self.use_critic:
            with timer(timing, "values", device):
                micro = c.critic.ppo_micro_batch_size_per_gpu
                batch["values"] = self.accel.critic.compute_values(self.critic, batch, micro)
        # with several processes, each scored its own rows: from here on every process has them all
        scores, extras, entropy = distributed.gather_evaluated(
            batch, scores, extras, entropy, self.tokenizer.pad_token_id, self.world
        )
        mask = batch["response_mask"]
        stats = {f"reward/{name}/mean": v.mean() for name, v in extras.items()}
        # 2d. token-level rewards (KL in the reward) and advantages
        if correction.rollout_is is not None:
            old, rollout, level = batch["old_log_probs"], batch["rollout_log_probs"], correction.rollout_is
            threshold, normalize = correction.rollout_is_threshold, correction.rollout_is_batch_normalize
            batch["rollout_is_weights"] = compute_rollout_is_weights(old, rollout, mask, threshold, level, normalize)
        with timer(timing, "adv", device):
            stats |= self._rewards_and_advantages(batch, scores)
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

    def _rewards_and_advantages(self, batch: dict[str, torch.Tensor], scores: torch.Tensor) -> dict[str, torch.Tensor]:
        """Token-level scores and rewards (KL in the reward), rejection sampling, then the advantage estimator."""
        c, mask, stats = self.config, batch["response_mask"], {}
        batch["token_level_scores"] = place_score_on_last_token(scores, mask)
        batch["token_level_rewards"] = batch["token_level_scores"]
        if c.algorithm.use_kl_in_reward:
            beta, old, ref = self.kl_ctrl.value, batch["old_log_probs"], batch["ref_log_prob"]
            rewards, current_kl = apply_kl_penalty(
                batch["token_level_scores"], old, ref, mask, beta, c.algorithm.kl_penalty
            )
            batch["token_level_rewards"] = rewards
            self.kl_ctrl.update(float(current_kl), n_steps=mask.shape[0])
            stats = {"actor/reward_kl_penalty": current_kl, "actor/reward_kl_penalty_coeff": torch.tensor(beta)}
        rs = c.algorithm.rollout_correction  # verl rejects after the KL in the reward, before the advantages
        if rs.rollout_rs is not None and not rs.bypass_mode:
            old, sampled, threshold = batch["old_log_probs"], batch["rollout_log_probs"], rs.rollout_rs_threshold
            batch["response_mask"], rejected = compute_rollout_rs_mask(old, sampled, mask, rs.rollout_rs, threshold)
            stats |= rejected
        name = c.algorithm.adv_estimator
        estimator = self.accel.adv_estimators.get(name) or get_adv_estimator_fn(name)
        advantages, returns = compute_advantage(
            batch, adv_estimator=name, adv_estimator_fn=estimator, config=c.algorithm
        )
        batch["advantages"] = advantages
        batch["returns"] = returns
        return stats

    # ---- phase 3: update ---------------------------------------------------------------
    def _minibatch_updates(self, batch: dict[str, torch.Tensor], role: str) -> list[dict[str, torch.Tensor]]:
        """The ``role`` model's update ("actor" or "critic") with its own settings
        (:func:`refppo.training.update.minibatch_updates`); returns per-mini-batch stats."""
        c, actor = self.config, role == "actor"
        settings = ("ppo_epochs", "ppo_mini_batch_size", "loss_agg_mode")
        epochs, mini_size, agg_mode = (getattr(c.actor, k) if actor else critic_setting(c, k) for k in settings)
        passes, rows = (self.accel.actor if actor else self.accel.critic), getattr(c, role).ppo_micro_batch_size_per_gpu
        share = lambda mini: distributed.take_share(mini, self.world)
        return minibatch_updates(
            batch,
            role,
            self.actor_params if actor else self.critic_params,
            self.actor_opt if actor else self.critic_opt,
            self._actor_loss if actor else self._critic_loss,
            # this process's share of each mini-batch; the stats of all its micro-batches summed over processes
            micro_batches=lambda mini: [mb for _, mb in passes.micro_batches(share(mini), rows)],
            reduce=lambda stats: distributed.sum_stats(stats, self.world),
            epochs=epochs,
            mini_rows=mini_size * c.rollout.n,
            agg_mode=agg_mode,
            grad_clip=getattr(c, role).grad_clip,
            shuffle_gen=self.shuffle_gen,
            skipped=self.skipped_in_a_row,
        )

    def _actor_loss(self, mb):
        a, temp = self.config.actor, self.config.rollout.temperature
        mask = mb["response_mask"]
        # actor/entropy comes from the old-log-prob pass (verl 0.9); here only for the bonus or if asked
        bonus = a.entropy_coeff != 0
        log_prob, entropy = self.accel.actor.log_probs(self.actor, mb, temp, bonus or a.calculate_entropy)
        scale = self._loss_scale_factor(a.loss_scale_factor)
        policy_loss_fn = get_policy_loss_fn(a.policy_loss)
        pg_loss, pg_metrics = policy_loss_fn(  # verl 0.9's call
            old_log_prob=mb["old_log_probs"],
            log_prob=log_prob,
            advantages=mb["advantages"],
            response_mask=mask,
            loss_agg_mode=a.loss_agg_mode,
            config=policy_loss_config(a, loss_scale_factor=scale),
            rollout_is_weights=mb.get("rollout_is_weights"),
        )
        stats = {"actor/pg_loss": pg_loss.detach()}
        for name, value in pg_metrics.items():  # a loss written for verl returns floats
            stats[name] = torch.as_tensor(value, device=mask.device)
        loss = pg_loss
        if entropy is not None:
            entropy_loss = agg_loss(entropy, mask, a.loss_agg_mode, scale)
            if bonus:  # else no gradient through it (verl adds 0 x entropy_loss)
                loss = loss - a.entropy_coeff * entropy_loss
            stats["actor/entropy_loss"] = entropy_loss.detach()
        if a.use_kl_loss:
            kl_loss = agg_loss(kl_penalty(log_prob, mb["ref_log_prob"], a.kl_loss_type), mask, a.loss_agg_mode, scale)
            loss = loss + a.kl_loss_coef * kl_loss
            stats["actor/kl_loss"] = kl_loss.detach()
        return loss, stats

    def _loss_scale_factor(self, configured: float | None) -> float:
        """seq-mean-token-sum-norm's constant divisor: as configured, else the longest response
        allowed (never the batch's width, which changes when generation stops early)."""
        return self.config.data.max_response_length if configured is None else configured

    def _critic_loss(self, mb):
        c = self.config
        vpreds = response_values(self.critic, mb)
        mode = critic_setting(c, "loss_agg_mode")
        scale = self._loss_scale_factor(critic_setting(c, "loss_scale_factor"))
        vf_loss, vf_clipfrac = compute_value_loss(
            vpreds, mb["returns"], mb["values"], mb["response_mask"], c.critic.cliprange_value, mode, scale
        )
        vpred_mean = masked_mean(vpreds.detach(), mb["response_mask"])
        stats = {"critic/vf_loss": vf_loss.detach(), "critic/vf_clipfrac": vf_clipfrac}
        return vf_loss, stats | {"critic/vpred_mean": vpred_mean}

    # ---- one step ----------------------------------------------------------------------
    def make_experience(self, records: list[dict], timing: dict) -> tuple[dict, dict]:
        """Phases 1 and 2 for a batch of prompt records: generate, score, then evaluate (with
        ``algorithm.filter_groups``, DAPO's dynamic sampling: :func:`refppo.training.dynamic_sampling.fill_batch`).

        Args:
            records: the step's prompt records (``data.train_batch_size`` of them).
            timing: receives ``timing_s/gen``, ``timing_s/reward`` and the evaluate timings.

        Returns:
            (batch, stats): the batch holds every key of :func:`refppo.rollout.generation.generate` plus
            those ``evaluate`` adds, B = len(records) x rollout.n rows; stats as ``evaluate`` returns.
        """
        if self.config.algorithm.filter_groups.enable:
            batch, scores, extras, stats = fill_batch(self, records, timing)
        else:
            (batch, scores, extras), stats = self.generate_and_score(records, timing), {}
        return batch, stats | self.evaluate(batch, scores, extras, timing)

    def generate_and_score(self, records: list[dict], timing: dict, first_row: int = 0):
        """This process's share of ``records``: its rollout (row ``first_row`` on of the step's
        draws) and the scores and extra scores of :meth:`score`; for ReMax, also the score of each
        prompt's greedy response (``reward_baselines``), as verl computes it."""
        n = self.config.rollout.n
        share = self.world.share(len(records))
        mine = records[share]
        remax = self.config.algorithm.adv_estimator == "remax"
        with timer(timing, "gen", self.device):
            batch = self.generate(mine, n, first_row=first_row + share.start * n)
            greedy = self.generate(mine, 1, do_sample=False) if remax else None  # ReMax's baseline
        batch["index"] += share.start
        with timer(timing, "reward", self.device):
            scores, extras = self.score(batch, [r for r in mine for _ in range(n)])
            if greedy is not None:  # each prompt's greedy score, for each of its n rows
                batch["reward_baselines"] = self.score(greedy, mine)[0].repeat_interleave(n)
        return batch, scores, extras

    def update(self, batch: dict[str, torch.Tensor], timing: dict) -> tuple[list[dict], list[dict]]:
        """Phase 3: the critic's update, then the actor's (with a critic, after ``trainer.critic_warmup`` steps).

        Args:
            batch: an evaluated batch (see :meth:`make_experience`).
            timing: receives ``timing_s/update_critic`` and ``timing_s/update_actor``.

        Returns:
            (critic stats, actor stats): one dict of detached scalars per mini-batch update.
        """
        critic_minis = self._update_role(batch, "critic", timing) if self.use_critic else []
        warm = not self.use_critic or self.step >= self.config.trainer.critic_warmup
        return critic_minis, self._update_role(batch, "actor", timing) if warm else []

    def _update_role(self, batch: dict[str, torch.Tensor], role: str, timing: dict) -> list[dict[str, torch.Tensor]]:
        """``role``'s updates, then its schedule's step; ``<role>/lr`` is the rate after it, as verl logs it."""
        model, _, schedule = self._roles()[role]
        model.train()
        with timer(timing, f"update_{role}", self.device):
            minis = self._minibatch_updates(batch, role)
        model.eval()
        schedule.step()
        lr = torch.tensor(schedule.get_last_lr()[0])
        return [m | {f"{role}/lr": lr} for m in minis]

    def train_step(self) -> dict[str, float]:
        """One step: 1. generate, 2. evaluate, 3. update; returns the step's metrics."""
        c = self.config
        timing: dict[str, float] = {}
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        start = time.perf_counter()
        with broken_by_update(f"step {self.step + 1}", "actor.optim.lr or critic.optim.lr", self.step == 0):
            batch, stats = self.make_experience(self.sampler.next_batch(), timing)  # phases 1 and 2
        critic_minis, actor_minis = self.update(batch, timing)  # phase 3
        with value_checks(False):  # the batch was checked before the updates
            metrics = gather(
                data_metrics(batch, c, self.use_critic) | stats, critic_minis + actor_minis, self.device
            )  # one host sync
        timing["timing_s/step"] = time.perf_counter() - start
        self.last_update_stats = [{k: float(v) for k, v in m.items()} for m in actor_minis]
        self.step += 1
        metrics.update(timing)
        metrics |= throughput_metrics(batch, timing)
        metrics["perf/max_memory_allocated_gb"] = peak_memory_gb(self.device)
        if c.actor.use_kl_loss:
            metrics["actor/kl_coef"] = c.actor.kl_loss_coef
        return metrics

    # ---- checkpoints -------------------------------------------------------------------
    def _roles(self) -> dict:
        """The trained models by name: (model, optimiser, learning-rate schedule)."""
        roles = {"actor": (self.actor, self.actor_opt, self.actor_sched)}
        if self.use_critic:
            roles["critic"] = (self.critic, self.critic_opt, self.critic_sched)
        return roles

    def save_checkpoint(self, folder: Path) -> None:
        """Everything a resumed run needs to continue exactly: the models and optimisers
        (:func:`refppo.training.checkpoint.save_models`; every process its shard), and in ``folder/trainer_state.pt``
        the step, the schedules, the KL controller, the data position and the generators."""
        save_models(folder, {name: (model, opt) for name, (model, opt, _) in self._roles().items()}, self.world)
        if not self.world.main:
            return
        state = {"step": self.step, "kl_ctrl": vars(self.kl_ctrl).copy(), "sampler": self.sampler.state_dict()}
        state |= {f"{name}_sched": sched.state_dict() for name, (_, _, sched) in self._roles().items()}
        state |= {
            "shuffle_gen": self.shuffle_gen.get_state(),
            "torch_rng": torch.get_rng_state(),
            "python_rng": random.getstate(),
        }
        torch.save(state, folder / STATE_FILE)

    def load_checkpoint(self, folder: Path, state: dict) -> None:
        """Restore :meth:`save_checkpoint`'s ``folder``, whose ``trainer_state.pt`` holds ``state``
        (a run saved by any number of processes)."""
        load_models(folder, {name: (model, opt) for name, (model, opt, _) in self._roles().items()}, self.world)
        for name, (_, _, sched) in self._roles().items():
            sched.load_state_dict(state[f"{name}_sched"])
        self.step = state["step"]
        vars(self.kl_ctrl).update(state["kl_ctrl"])
        self.sampler.load_state_dict(state["sampler"])
        self.shuffle_gen.set_state(state["shuffle_gen"])
        torch.set_rng_state(state["torch_rng"])
        random.setstate(state["python_rng"])
