"""The RLHF PPO loop (ch 5, 6): one step in the notes' three phases.

1. Generate: the actor samples ``rollout.n`` responses per prompt, recording their log-probs.
2. Evaluate: scores (reward model or rule), reference and old log-probs, values, token-level
   rewards (KL in the reward when ``algorithm.use_kl_in_reward``), advantages.
3. Update: ``ppo_epochs`` x shuffled mini-batches x micro-batches (gradient accumulation; of a
   row count, or of a token budget with ``use_dynamic_bsz``) for the critic and the actor, each
   with its own optimiser, gradient clipping and LR schedule. The rows are reshuffled every epoch,
   as textbook PPO does; verl cuts its batch in order (after reordering it by length to balance
   its GPUs), the same every epoch.

The batch of a step: generate gives the keys listed in :mod:`refppo.prompts` and :func:`refppo.generation.generate`; evaluate adds, all
(B, R) float32 and 0 after the response unless said:

- ``ref_log_prob``: log pi_ref of each response token (when a KL uses the reference);
- ``old_log_probs``: log pi_old, the actor before this step's update (the rollout's own
  log-probs in ``policy_mode=bypass``); ``rollout_is_weights``: min(pi_old / pi_rollout, C)
  (``policy_mode=rollout_correction`` only);
- ``values``: the critic's V(s_t) (when the advantage estimator reads values);
- ``token_level_scores``: the score on the last valid token; ``token_level_rewards``: the
  same minus beta * KL per token when ``algorithm.use_kl_in_reward``, else equal to it;
- ``advantages``, ``returns``: from the advantage estimator.

The reward model and the reference are frozen. Metrics use verl's names and are gathered in
one host transfer per step. The values the update reads are checked once, at the end of phase
2; the update loop runs without value checks (no host sync per micro-batch). Held-out
validation is :meth:`PPOTrainer.held_out_metrics`, not phase 2.
"""

from __future__ import annotations

import contextlib
import random
import resource
import time
from collections.abc import Callable, Iterator

import torch

from refppo import accel
from refppo.accel.checkpointing import enable_gradient_checkpointing
from refppo.accel.logprobs import check_fused_kernels
from refppo.advantages import ADV_ESTIMATORS, needs_critic
from refppo.checks import check_values, value_checks
from refppo.config import Config, critic_setting
from refppo.data import EpochSampler
from refppo.forward import compute_scores, response_values
from refppo.functional import masked_corr, masked_max_min, masked_mean, masked_var
from refppo.generation import generate
from refppo.kl import get_kl_controller, kl_penalty
from refppo.losses import POLICY_LOSSES, agg_loss, agg_loss_weight, compute_rollout_is_weights, compute_value_loss
from refppo.models import make_reference
from refppo.optim import make_optimizer
from refppo.prompts import tokenize_prompts
from refppo.registry import call_declared
from refppo.rewards import apply_kl_penalty, apply_missing_eos_penalty, place_score_on_last_token
from refppo.runs import STATE_FILE

# Stats aggregated with loss_agg_mode, as the loss is: micro-batches combine like the loss.
LOSS_STATS = frozenset({"actor/pg_loss", "actor/entropy_loss", "actor/kl_loss", "critic/vf_loss"})
# Consecutive skipped updates (non-finite gradient) of one model after which the run stops.
MAX_SKIPPED_UPDATES = 8

RewardFn = Callable[[list[str], list[str], list[dict]], torch.Tensor]


def check_scores(scores, rows: int, source: str) -> torch.Tensor:
    """A reward function's output as a (rows,) float32 tensor, or a ValueError naming ``source``."""
    try:
        scores = torch.as_tensor(scores, dtype=torch.float32)
    except (TypeError, ValueError, RuntimeError):
        raise ValueError(
            f"{source} returned a {type(scores).__name__}; expected {rows} numbers, one score per response "
            "(a list, tuple or tensor of floats)"
        ) from None
    if scores.shape != (rows,):
        raise ValueError(f"{source} returned shape {tuple(scores.shape)}; expected ({rows},), one score per response")
    if not bool(torch.isfinite(scores).all()):
        raise ValueError(f"{source} returned a non-finite score (NaN or inf)")
    return scores


def describe(fn) -> str:
    """A function's ``module:qualname``, as ``reward_model.reward_fn`` spells it."""
    return f"{getattr(fn, '__module__', '?')}:{getattr(fn, '__qualname__', repr(fn))}"


@contextlib.contextmanager
def timer(timing: dict, name: str, device: torch.device) -> Iterator[None]:
    """Store the block's wall time (its device work included) in ``timing["timing_s/<name>"]``;
    in a ``torch.profiler`` trace its operators sit under a range of that name."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    with torch.profiler.record_function(f"timing_s/{name}"):
        yield
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    timing[f"timing_s/{name}"] = time.perf_counter() - start


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
    ):
        c = config
        if reward_fn is None and reward_model is None:
            raise ValueError("PPOTrainer needs a reward_fn or a reward_model")
        self.use_critic = needs_critic(c.algorithm.adv_estimator)
        if self.use_critic != (critic is not None):
            needs = "needs a critic" if self.use_critic else "uses no critic: pass critic=None"
            raise ValueError(f"algorithm.adv_estimator={c.algorithm.adv_estimator} {needs}")
        self.config, self.tokenizer, self.actor, self.critic = c, tokenizer, actor, critic
        self.reward_fn, self.reward_model = reward_fn, reward_model
        self.extra_reward_fns = extra_reward_fns or {}
        self.val_records = val_records
        self.device = actor.device
        if c.rollout.cuda_graphs and self.device.type != "cuda":
            raise ValueError(f"rollout.cuda_graphs=true needs the actor on a CUDA device, not {self.device}")
        # the speed paths, chosen once (refppo.accel): the same numbers as the plain ones
        self.accel = accel.select(c, self.device)
        self.sampling_model = self.accel.decoder(actor, c.data.max_prompt_length + c.data.max_response_length)
        self.need_ref = c.algorithm.use_kl_in_reward or c.actor.use_kl_loss
        self.reference = reference if reference is not None or not self.need_ref else make_reference(actor)
        if c.model.enable_gradient_checkpointing:  # after the reference's copy, which is never trained
            enable_gradient_checkpointing(actor)
        if self.use_critic and c.critic.model.enable_gradient_checkpointing:
            enable_gradient_checkpointing(critic, "critic.model.enable_gradient_checkpointing")
        if c.model.use_fused_kernels:
            check_fused_kernels(actor)
            if self.need_ref:
                check_fused_kernels(self.reference, "reference")
        self.sampler = EpochSampler(train_records, c.data.train_batch_size, c.trainer.seed)
        self.kl_ctrl = get_kl_controller(
            c.algorithm.kl_ctrl.type, c.algorithm.kl_ctrl.kl_coef, c.algorithm.kl_ctrl.target_kl, c.algorithm.kl_ctrl.horizon
        )
        total = c.trainer.total_training_steps
        self.actor_params = [p for p in actor.parameters() if p.requires_grad]
        self.actor_opt, self.actor_sched = make_optimizer(self.actor_params, c.actor.optim, total)
        if self.use_critic:
            self.critic_params = [p for p in critic.parameters() if p.requires_grad]
            self.critic_opt, self.critic_sched = make_optimizer(self.critic_params, c.critic.optim, total)
        self.gen = torch.Generator(self.device).manual_seed(c.trainer.seed)  # sampling
        self.shuffle_gen = torch.Generator().manual_seed(c.trainer.seed + 1)  # mini-batch order
        self.step = 0
        self.last_update_stats: list[dict[str, float]] = []  # per actor mini-batch, for inspection
        self.skipped_in_a_row: dict[str, int] = {}  # "actor" / "critic" -> updates skipped (non-finite grad)

    # ---- phase 1: generate -------------------------------------------------------------
    def generate(self, records: list[dict], n: int, do_sample: bool = True) -> dict[str, torch.Tensor]:
        """Roll out ``n`` responses for each record's prompt (:func:`refppo.generation.generate`)."""
        c = self.config
        prompts = [r[c.data.prompt_key] for r in records]
        ids, mask = tokenize_prompts(self.tokenizer, prompts, c.data.max_prompt_length, c.data.truncation)
        return generate(
            self.sampling_model, ids, mask, self.tokenizer.eos_token_id, self.tokenizer.pad_token_id, c.data.max_response_length,
            temperature=c.rollout.temperature, top_k=c.rollout.top_k, top_p=c.rollout.top_p, do_sample=do_sample,
            ignore_eos=c.rollout.ignore_eos, n=n, generator=self.gen,
        )  # fmt: skip

    def _texts(self, batch: dict[str, torch.Tensor]) -> tuple[list[str], list[str]]:
        decode = self.tokenizer.batch_decode
        responses = batch["responses"].masked_fill(batch["response_mask"] == 0, self.tokenizer.pad_token_id)
        return decode(batch["prompts"], skip_special_tokens=True), decode(responses, skip_special_tokens=True)

    def score(self, batch: dict[str, torch.Tensor], rows: list[dict]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """Sequence scores (B,) for training, and the extra (reported-only) scores by name.

        A response that hit the length limit without EOS loses ``reward_model.missing_eos_penalty``:
        a reward model never saw unfinished responses, and may score them anything.
        """
        texts = None
        rm = self.config.reward_model
        if self.reward_model is not None:
            scores = compute_scores(self.reward_model, batch, rm.micro_batch_size_per_gpu)
        else:
            texts = self._texts(batch)
            scores = check_scores(self.reward_fn(*texts, rows), len(rows), f"reward function {describe(self.reward_fn)}")
        if rm.missing_eos_penalty > 0:
            scores = apply_missing_eos_penalty(scores.to(self.device), batch["is_truncated"], rm.missing_eos_penalty)
        extras = {}
        for name, fn in self.extra_reward_fns.items():
            texts = texts or self._texts(batch)
            extras[name] = check_scores(fn(*texts, rows), len(rows), f"reward function {name!r}")
        return scores.to(self.device), extras

    # ---- phase 2: evaluate -------------------------------------------------------------
    def evaluate(self, batch: dict[str, torch.Tensor], rows: list[dict], timing: dict) -> dict[str, torch.Tensor]:
        """Score the responses and add the keys listed in the module docstring to ``batch``.

        Args:
            batch: a rollout from :meth:`generate`, B rows.
            rows: the B records the rows answer (what the reward function reads).
            timing: receives ``timing_s/reward``, ``/ref``, ``/old_log_prob``, ``/values``, ``/adv``.

        Returns:
            Metrics as detached scalars: ``reward/<name>/mean`` of the extra reward functions,
            ``actor/entropy`` (the sampling policy's, from the old-log-prob pass: none in
            ``policy_mode=bypass``, as in verl 0.9) and, with KL in the reward, its estimate and
            coefficient.
        """
        c, mask, device = self.config, batch["response_mask"], self.device
        temp = c.rollout.temperature
        # 2a. the score of each response: a reward model or a rule
        with timer(timing, "reward", device):
            scores, extras = self.score(batch, rows)
        stats = {f"reward/{name}/mean": v.mean() for name, v in extras.items()}
        # 2b. log pi_ref and log pi_old of the sampled tokens (bypass takes the sampler's as pi_old)
        if self.need_ref:
            with timer(timing, "ref", device):
                micro = c.ref.log_prob_micro_batch_size_per_gpu
                batch["ref_log_prob"] = self.accel.actor.compute_log_probs(self.reference, batch, temp, micro)
        entropy = None  # (B, R): the sampling policy's, from the old-log-prob pass (bypass runs none)
        if c.actor.policy_mode == "bypass":
            batch["old_log_probs"] = batch["rollout_log_probs"]
        else:
            with timer(timing, "old_log_prob", device):
                micro = c.rollout.log_prob_micro_batch_size_per_gpu
                batch["old_log_probs"], entropy = self.accel.actor.compute_log_probs(self.actor, batch, temp, micro, True)
        if c.actor.policy_mode == "rollout_correction":
            batch["rollout_is_weights"] = compute_rollout_is_weights(
                batch["old_log_probs"], batch["rollout_log_probs"], mask, c.actor.rollout_is_threshold
            )
        # 2c. the critic's values
        if self.use_critic:
            with timer(timing, "values", device):
                batch["values"] = self.accel.critic.compute_values(self.critic, batch, c.critic.ppo_micro_batch_size_per_gpu)
        # 2d. token-level rewards (KL in the reward) and advantages
        with timer(timing, "adv", device):
            stats |= self._rewards_and_advantages(batch, scores)
        # The update reads these in every micro-batch: check their values here, once per step.
        finite = {k: batch[k] for k in ("old_log_probs", "ref_log_prob", "values", "advantages", "returns") if k in batch}
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
        """Token-level scores and rewards (KL in the reward), then the advantage estimator."""
        c, mask = self.config, batch["response_mask"]
        stats = {}
        batch["token_level_scores"] = place_score_on_last_token(scores, mask)
        batch["token_level_rewards"] = batch["token_level_scores"]
        if c.algorithm.use_kl_in_reward:
            beta = self.kl_ctrl.value
            batch["token_level_rewards"], current_kl = apply_kl_penalty(
                batch["token_level_scores"], batch["old_log_probs"], batch["ref_log_prob"], mask, beta, c.algorithm.kl_penalty
            )
            self.kl_ctrl.update(float(current_kl), n_steps=mask.shape[0])
            stats = {"actor/reward_kl_penalty": current_kl, "actor/reward_kl_penalty_coeff": torch.tensor(beta)}
        name = c.algorithm.adv_estimator
        estimator = self.accel.adv_estimators.get(name) or ADV_ESTIMATORS.get(name)
        batch["advantages"], batch["returns"] = call_declared(estimator, f"advantage estimator {name!r}", batch | vars(c.algorithm))
        return stats

    # ---- phase 3: update ---------------------------------------------------------------
    def _minibatch_updates(self, batch: dict[str, torch.Tensor], role: str) -> list[dict[str, torch.Tensor]]:
        """The ``role`` model's update ("actor" or "critic"): ``ppo_epochs`` x shuffled mini-batches
        of ``ppo_mini_batch_size`` prompts x micro-batches (of ``ppo_micro_batch_size_per_gpu``
        rows, or of a token budget with ``use_dynamic_bsz``); returns per-mini-batch stats.

        Each micro-batch's loss is weighted so the accumulated gradient is the mini-batch loss's
        gradient exactly; the stats in ``LOSS_STATS`` get the same weights (so they log the
        mini-batch's value in every ``loss_agg_mode``), the others (token means) the micro-batch's
        share of valid tokens. An update whose gradient norm is not finite is skipped;
        ``MAX_SKIPPED_UPDATES`` in a row stop the run.
        """
        c = self.config
        if role == "actor":
            optimizer, params, passes, micro_loss = self.actor_opt, self.actor_params, self.accel.actor, self._actor_loss
            epochs, mini_size, agg_mode = c.actor.ppo_epochs, c.actor.ppo_mini_batch_size, c.actor.loss_agg_mode
        else:
            optimizer, params, passes, micro_loss = self.critic_opt, self.critic_params, self.accel.critic, self._critic_loss
            epochs, mini_size, agg_mode = (critic_setting(c, k) for k in ("ppo_epochs", "ppo_mini_batch_size", "loss_agg_mode"))
        role_config = getattr(c, role)
        rows = batch["response_mask"].shape[0]
        per_mini = []
        with value_checks(False):  # evaluate checked the batch once; no host sync per micro-batch
            for _ in range(epochs):
                order = torch.randperm(rows, generator=self.shuffle_gen).to(self.device)
                for idx in order.split(mini_size * c.rollout.n):
                    mini = {k: v[idx] for k, v in batch.items()}
                    optimizer.zero_grad(set_to_none=True)
                    stats: dict[str, torch.Tensor] = {}
                    for _, mb in passes.micro_batches(mini, role_config.ppo_micro_batch_size_per_gpu):
                        loss, micro_stats = micro_loss(mb)
                        weight = agg_loss_weight(mb["response_mask"], mini["response_mask"], agg_mode)
                        (loss * weight).backward()
                        share = mb["response_mask"].sum() / mini["response_mask"].sum()
                        for k, v in micro_stats.items():
                            stats[k] = stats.get(k, 0.0) + (weight if k in LOSS_STATS else share) * v
                    grad_norm = torch.nn.utils.clip_grad_norm_(params, role_config.grad_clip)
                    finite = bool(torch.isfinite(grad_norm))
                    if finite:
                        optimizer.step()
                    self._count_skips(role, finite)
                    optimizer.zero_grad(set_to_none=True)
                    stats[f"{role}/grad_norm"] = grad_norm.detach()
                    stats[f"{role}/lr"] = torch.tensor(optimizer.param_groups[0]["lr"])  # the update's, as verl logs it
                    stats[f"{role}/skipped_nonfinite_grad"] = torch.tensor(float(not finite))
                    per_mini.append(stats)
        return per_mini

    def _count_skips(self, prefix: str, finite: bool) -> None:
        self.skipped_in_a_row[prefix] = 0 if finite else self.skipped_in_a_row.get(prefix, 0) + 1
        if self.skipped_in_a_row[prefix] >= MAX_SKIPPED_UPDATES:
            raise FloatingPointError(
                f"the last {MAX_SKIPPED_UPDATES} {prefix} updates were all skipped: the gradient norm was NaN or inf. "
                "Check the scores (critic/score/mean), the learning rate and the loss settings"
            )

    def _actor_loss(self, mb):
        a, temp = self.config.actor, self.config.rollout.temperature
        mask = mb["response_mask"]
        # actor/entropy comes from the old-log-prob pass (verl 0.9); here only for the bonus or if asked
        bonus = a.entropy_coeff != 0
        log_prob, entropy = self.accel.actor.log_probs(self.actor, mb, temp, bonus or a.calculate_entropy)
        scale = self._loss_scale_factor(a.loss_scale_factor)
        pg_loss, pg_metrics = POLICY_LOSSES.call(
            a.policy_loss, old_log_prob=mb["old_log_probs"], log_prob=log_prob, advantages=mb["advantages"],
            response_mask=mask, rollout_is_weights=mb.get("rollout_is_weights"), **(vars(a) | {"loss_scale_factor": scale}),
        )  # fmt: skip
        loss, stats = pg_loss, {"actor/pg_loss": pg_loss.detach(), **pg_metrics}
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
        vf_loss, vf_clipfrac = compute_value_loss(
            vpreds, mb["returns"], mb["values"], mb["response_mask"], c.critic.cliprange_value,
            critic_setting(c, "loss_agg_mode"), self._loss_scale_factor(critic_setting(c, "loss_scale_factor")),
        )  # fmt: skip
        vpred_mean = masked_mean(vpreds.detach(), mb["response_mask"])
        return vf_loss, {"critic/vf_loss": vf_loss.detach(), "critic/vf_clipfrac": vf_clipfrac, "critic/vpred_mean": vpred_mean}

    # ---- one step ----------------------------------------------------------------------
    def make_experience(self, records: list[dict], timing: dict) -> tuple[dict, dict]:
        """Phases 1 and 2 for a batch of prompt records: generate, then evaluate.

        Args:
            records: the step's prompt records (``data.train_batch_size`` of them).
            timing: receives ``timing_s/gen`` and the evaluate timings.

        Returns:
            (batch, stats): the batch holds every key of :func:`refppo.generation.generate` plus
            those ``evaluate`` adds, B = len(records) x rollout.n rows; stats as ``evaluate`` returns.
        """
        n = self.config.rollout.n
        with timer(timing, "gen", self.device):
            batch = self.generate(records, n)
        return batch, self.evaluate(batch, [r for r in records for _ in range(n)], timing)

    def update(self, batch: dict[str, torch.Tensor], timing: dict) -> tuple[list[dict], list[dict]]:
        """Phase 3: the critic's update, then the actor's (after ``trainer.critic_warmup`` steps).

        Args:
            batch: an evaluated batch (see :meth:`make_experience`).
            timing: receives ``timing_s/update_critic`` and ``timing_s/update_actor``.

        Returns:
            (critic stats, actor stats): one dict of detached scalars per mini-batch update.
        """
        critic_minis, actor_minis = [], []
        if self.use_critic:
            self.critic.train()
            with timer(timing, "update_critic", self.device):
                critic_minis = self._minibatch_updates(batch, "critic")
            self.critic.eval()
            self.critic_sched.step()
        if self.step >= self.config.trainer.critic_warmup:
            self.actor.train()
            with timer(timing, "update_actor", self.device):
                actor_minis = self._minibatch_updates(batch, "actor")
            self.actor.eval()
            self.actor_sched.step()
        return critic_minis, actor_minis

    def train_step(self) -> dict[str, float]:
        """One step: 1. generate, 2. evaluate, 3. update; returns the step's metrics."""
        c = self.config
        timing: dict[str, float] = {}
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        start = time.perf_counter()
        batch, stats = self.make_experience(self.sampler.next_batch(), timing)  # phases 1 and 2
        critic_minis, actor_minis = self.update(batch, timing)  # phase 3
        with value_checks(False):  # the batch was checked before the updates
            metrics = self._gather(batch, stats, critic_minis + actor_minis)  # the step's one host sync
        timing["timing_s/step"] = time.perf_counter() - start
        self.last_update_stats = [{k: float(v) for k, v in m.items()} for m in actor_minis]
        self.step += 1
        metrics.update(timing)
        metrics |= throughput_metrics(batch, timing)
        metrics["perf/max_memory_allocated_gb"] = self._peak_memory_gb()
        if c.actor.use_kl_loss:
            metrics["actor/kl_coef"] = c.actor.kl_loss_coef
        return metrics

    def _peak_memory_gb(self) -> float:
        """CUDA: peak allocated this step. CPU: the process's peak resident set (Linux KiB)."""
        if self.device.type == "cuda":
            return torch.cuda.max_memory_allocated(self.device) / 2**30
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20

    def _gather(self, batch, stats, per_mini) -> dict[str, float]:
        """All step metrics in one host transfer; the batch's are verl's ``compute_data_metrics``
        and ``calculate_debug_metrics``."""
        mask = batch["response_mask"]
        rows = torch.ones_like(mask[:, 0])
        out = dict(stats)

        def mean_max_min(name: str, values: torch.Tensor, valid: torch.Tensor) -> None:
            out[f"{name}/mean"] = masked_mean(values, valid)
            out[f"{name}/max"], out[f"{name}/min"] = masked_max_min(values, valid)

        mean_max_min("critic/score", batch["token_level_scores"].sum(-1), rows)
        mean_max_min("critic/rewards", batch["token_level_rewards"].sum(-1), rows)
        mean_max_min("critic/advantages", batch["advantages"], mask)
        mean_max_min("critic/returns", batch["returns"], mask)
        if self.use_critic:
            mean_max_min("critic/values", batch["values"], mask)
            residual_var = masked_var(batch["returns"] - batch["values"], mask)
            out["critic/vf_explained_var"] = 1.0 - residual_var / (masked_var(batch["returns"], mask) + 1e-5)
        if self.config.actor.policy_mode != "bypass":
            # verl's debug metrics: the sampler's token probabilities against the trainer's own
            # recomputation; far from 0 (and a correlation below 1) when the two disagree
            old, rollout = batch["old_log_probs"].exp(), batch["rollout_log_probs"].exp()
            diff = (old - rollout).abs()
            out["training/rollout_probs_diff_mean"] = masked_mean(diff, mask)
            out["training/rollout_probs_diff_max"] = masked_max_min(diff, mask)[0]
            out["training/rollout_probs_diff_std"] = masked_var(diff, mask).sqrt()
            out["training/rollout_actor_probs_pearson_corr"] = masked_corr(old, rollout, mask)
        for name, length, limit in (
            ("response_length", mask.sum(-1).float(), self.config.data.max_response_length),
            ("prompt_length", batch["attention_mask"][:, : batch["prompts"].shape[1]].sum(-1).float(), self.config.data.max_prompt_length),
        ):
            mean_max_min(name, length, rows)
            out[f"{name}/clip_ratio"] = (length == limit).float().mean()
        keys = sorted({k for m in per_mini for k in m})
        for k in keys:
            values = [m[k] for m in per_mini if k in m]
            out[k] = sum(torch.as_tensor(v, device=self.device, dtype=torch.float32) for v in values) / len(values)
        names = list(out)
        flat = torch.stack([torch.as_tensor(out[k], dtype=torch.float32, device=self.device) for k in names]).tolist()
        return dict(zip(names, flat))

    @torch.no_grad()
    def held_out_metrics(self) -> dict[str, float]:
        """Validation (verl's ``_validate``): held-out prompts, one greedy response each
        (``val/score``, ``val/<extra>``) and one sampled at the rollout temperature
        (``val/score_sampled``, what training optimises). verl logs the greedy mean as
        ``val-core/<data_source>/reward/mean@1`` (``acc`` for ``reward`` when the reward function
        returns one); refppo has one data source and keeps the short name."""
        out = {}
        for suffix, do_sample in (("", False), ("_sampled", True)):
            batch = self.generate(self.val_records, n=1, do_sample=do_sample)
            scores, extras = self.score(batch, self.val_records)
            out[f"val/score{suffix}"] = scores.mean()
            out |= {f"val/{k}{suffix}": v.mean() for k, v in extras.items()}
            out[f"val/response_length{suffix}"] = batch["response_mask"].sum(-1).float().mean()
        return {k: float(v) for k, v in out.items()}

    # ---- checkpoints -------------------------------------------------------------------
    def state_dict(self) -> dict:
        """Everything a resumed run needs to continue exactly: weights, optimisers, schedulers,
        the KL controller, the data position, every random generator and the step."""
        state = {
            "step": self.step,
            "actor": self.actor.state_dict(),
            "actor_opt": self.actor_opt.state_dict(),
            "actor_sched": self.actor_sched.state_dict(),
            "kl_ctrl": vars(self.kl_ctrl).copy(),
            "sampler": self.sampler.state_dict(),
            "gen": self.gen.get_state(),
            "shuffle_gen": self.shuffle_gen.get_state(),
            "torch_rng": torch.get_rng_state(),
            "python_rng": random.getstate(),
        }
        if torch.cuda.is_available():
            state["cuda_rng"] = torch.cuda.get_rng_state_all()
        if self.use_critic:
            state |= {
                "critic": self.critic.state_dict(),
                "critic_opt": self.critic_opt.state_dict(),
                "critic_sched": self.critic_sched.state_dict(),
            }
        return state

    def load_state_dict(self, state: dict) -> None:
        """Restore :meth:`state_dict`."""
        self.step = state["step"]
        self.actor.load_state_dict(state["actor"])
        self.actor_opt.load_state_dict(state["actor_opt"])
        self.actor_sched.load_state_dict(state["actor_sched"])
        vars(self.kl_ctrl).update(state["kl_ctrl"])
        self.sampler.load_state_dict(state["sampler"])
        self.gen.set_state(state["gen"])
        self.shuffle_gen.set_state(state["shuffle_gen"])
        torch.set_rng_state(state["torch_rng"])
        random.setstate(state["python_rng"])
        if "cuda_rng" in state and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(state["cuda_rng"])
        if self.use_critic:
            self.critic.load_state_dict(state["critic"])
            self.critic_opt.load_state_dict(state["critic_opt"])
            self.critic_sched.load_state_dict(state["critic_sched"])


# The progress bar's fields: (label, metric); a metric the step did not compute is left out.
BAR_FIELDS = (
    ("score", "critic/score/mean"),
    ("val", "val/score"),
    ("ref_kl", "actor/reward_kl_penalty"),  # KL to the reference, in the reward ...
    ("kl_loss", "actor/kl_loss"),  # ... or in the loss
    ("ppo_kl", "actor/ppo_kl"),  # old vs new policy
    ("step_s", "timing_s/step"),
)


def throughput_metrics(batch: dict[str, torch.Tensor], timing: dict[str, float]) -> dict[str, float]:
    """verl's ``compute_timing_metrics`` per-token part and ``compute_throughout_metrics`` (one GPU).

    Args:
        batch: needs ``attention_mask`` (B, P + R) and ``response_mask`` (B, R).
        timing: ``timing_s/<phase>`` seconds, ``timing_s/step`` included.

    Returns:
        ``timing_per_token_ms/<phase>`` (generation per response token, the other phases per
        prompt + response token), ``perf/total_num_tokens``, ``perf/time_per_step`` and
        ``perf/throughput`` (tokens per second).
    """
    counts = torch.stack([batch["attention_mask"].sum(), batch["response_mask"].sum()]).tolist()
    total, responses = (int(c) for c in counts)
    step = timing["timing_s/step"]
    out = {"perf/total_num_tokens": total, "perf/time_per_step": step, "perf/throughput": total / step}
    for phase in ("gen", "ref", "values", "adv", "update_critic", "update_actor"):
        if f"timing_s/{phase}" in timing:
            tokens = responses if phase == "gen" else total
            out[f"timing_per_token_ms/{phase}"] = timing[f"timing_s/{phase}"] * 1000 / tokens
    return out


def bar_fields(metrics: dict[str, float]) -> dict[str, str]:
    """The progress bar's postfix for one step's metrics."""
    return {label: f"{metrics[key]:.4g}" for label, key in BAR_FIELDS if key in metrics}


def fit(trainer: PPOTrainer, run=None, progress_bar: bool = True) -> list[dict[str, float]]:
    """Train to ``trainer.total_training_steps``, validating every ``test_freq`` steps (and at
    step 0, the SFT level), logging one metrics line per step and checkpointing every
    ``save_freq`` steps and at the end.

    Args:
        trainer: a PPOTrainer, possibly restored from a checkpoint.
        run: a ``refppo.runs.RunFolder``; None keeps everything in memory.
        progress_bar: show tqdm with score, KL and step time.

    Returns:
        The metrics of the steps run (each with its "step").
    """
    from tqdm.auto import tqdm

    t = trainer.config.trainer
    history = []

    def record(step: int, metrics: dict[str, float]) -> None:
        history.append({"step": step, **metrics})
        if run is not None:
            run.log(step, metrics)

    if trainer.step == 0 and t.test_freq > 0:
        record(0, trainer.held_out_metrics())
    bar = tqdm(total=t.total_training_steps, initial=trainer.step, disable=not progress_bar, desc="ppo")
    while trainer.step < t.total_training_steps:
        metrics = trainer.train_step()
        step = trainer.step
        last = step == t.total_training_steps
        if t.test_freq > 0 and (step % t.test_freq == 0 or last):
            metrics.update(trainer.held_out_metrics())
        record(step, metrics)
        if run is not None and ((t.save_freq > 0 and step % t.save_freq == 0) or last):
            run.save_checkpoint(step, lambda folder: torch.save(trainer.state_dict(), folder / STATE_FILE))
        bar.set_postfix(bar_fields(metrics))
        bar.update(1)
    bar.close()
    return history
