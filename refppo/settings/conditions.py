"""When a setting is read: the conditions on other settings (:func:`refppo.settings.declare.when`) that
:mod:`refppo.settings.config`'s declarations name, and the critic settings that fall back to the actor's."""

from __future__ import annotations

from refppo.advantages import ADV_ESTIMATORS, needs_critic
from refppo.losses import POLICY_LOSSES
from refppo.settings.declare import when

NORM = "seq-mean-token-sum-norm"


def _critic_norm(c) -> bool:
    return needs_critic(c.algorithm.adv_estimator) and critic_setting(c, "loss_agg_mode") == NORM


HAS_CRITIC = when(
    lambda s: needs_critic(s.config.algorithm.adv_estimator),
    "algorithm.adv_estimator=gae (the estimator with a critic)",
)


def critic_only_steps(critic_warmup: int) -> int:
    """The steps that update only the critic for ``trainer.critic_warmup``: verl 0.9's
    ``RayPPOTrainer.fit`` (``verl/trainer/ppo/ray_trainer.py``) updates the actor unless
    ``critic_warmup > global_steps``, its steps counted from 1, so N gives N - 1 (0 and 1: none)."""
    return max(critic_warmup - 1, 0)


FRESH_CRITIC_WARMUP = 6  # refppo's default warm-up with a critic: a fresh value head follows the returns


def critic_warmup(config) -> int:
    """``trainer.critic_warmup``, or when null refppo's default: :data:`FRESH_CRITIC_WARMUP` with a
    critic, 0 without. verl's ``fit`` skips the actor's update while ``critic_warmup >
    global_steps`` whether or not there is a critic (``RayPPOTrainer.fit``; the V1 trainer's
    ``_step_once`` in ``verl/trainer/ppo/v1/trainer_base.py`` alike), so a given value delays a
    critic-less actor too."""
    if config.trainer.critic_warmup is not None:
        return config.trainer.critic_warmup
    return FRESH_CRITIC_WARMUP if needs_critic(config.algorithm.adv_estimator) else 0


def policy_loss_in_use(config) -> str:
    """The policy loss a step calls: ``actor.policy_loss``, or in bypass mode verl's own
    ``bypass_mode``, which replaces it (``apply_bypass_mode`` in
    ``verl/trainer/ppo/rollout_corr_helper.py``)."""
    return "bypass_mode" if config.algorithm.rollout_correction.bypass_mode else config.actor.policy_loss


def _loss_reads(s) -> bool:
    rc = s.config.algorithm.rollout_correction
    if rc.bypass_mode and rc.loss_type == "reinforce":  # REINFORCE has no clip
        return False
    return POLICY_LOSSES.reads(policy_loss_in_use(s.config), s.name)


def _loss_readers(s) -> str:
    readers = POLICY_LOSSES.readers(s.name)
    bypass = s.config.algorithm.rollout_correction.bypass_mode
    if bypass and "bypass_mode" in readers:
        return "algorithm.rollout_correction.loss_type=ppo_clip (bypass mode's REINFORCE has no clip)"
    losses = " or ".join(name for name in readers if name != "bypass_mode")
    return f"actor.policy_loss={losses}" + (" and algorithm.rollout_correction.bypass_mode=false" if bypass else "")


LOSS_TAKES = when(_loss_reads, _loss_readers)  # a setting of the policy loss: read by the losses that declare it
BYPASSING = when(lambda s: s.owner.bypass_mode, "algorithm.rollout_correction.bypass_mode=true")
NOT_BYPASSING = when(
    lambda s: not s.config.algorithm.rollout_correction.bypass_mode,
    "algorithm.rollout_correction.bypass_mode=false (bypass mode's own loss replaces it, as in verl)",
)
ESTIMATOR_TAKES = when(  # a setting of the advantage estimator: read by those that declare it
    lambda s: ADV_ESTIMATORS.reads(s.config.algorithm.adv_estimator, s.name),
    lambda s: f"algorithm.adv_estimator={' or '.join(ADV_ESTIMATORS.readers(s.name))}",
)
KL_IN_REWARD = when(lambda s: s.config.algorithm.use_kl_in_reward, "algorithm.use_kl_in_reward=true")
ENDS_AT_EOS = when(lambda s: not s.config.rollout.ignore_eos, "rollout.ignore_eos=false (responses that can end)")
KL_LOSS = when(lambda s: s.config.actor.use_kl_loss, "actor.use_kl_loss=true")
REFERENCE = when(
    lambda s: s.config.algorithm.use_kl_in_reward or s.config.actor.use_kl_loss,
    "algorithm.use_kl_in_reward=true or actor.use_kl_loss=true (the reference pass)",
)
OLD_LOG_PROB_PASS = when(
    lambda s: not s.config.algorithm.rollout_correction.bypass_mode,
    "algorithm.rollout_correction.bypass_mode=false (bypass reuses the sampler's log-probs)",
)
REJECTING = when(lambda s: s.owner.rollout_rs is not None, "algorithm.rollout_correction.rollout_rs=<criteria>")
IS_WEIGHTS = when(lambda s: s.owner.rollout_is is not None, "algorithm.rollout_correction.rollout_is=token or sequence")
ONE_CLIP_BOUND_UNSET = when(
    lambda s: s.owner.clip_ratio_low is None or s.owner.clip_ratio_high is None,
    "actor.clip_ratio_low or actor.clip_ratio_high null (both are set)",
)
ACTOR_NORM = when(
    lambda s: s.owner.loss_agg_mode == NORM or (_critic_norm(s.config) and s.config.critic.loss_scale_factor is None),
    f"actor.loss_agg_mode={NORM}, or a critic whose loss mode is that with critic.loss_scale_factor null",
)
CRITIC_NORM = when(lambda s: _critic_norm(s.config), f"critic.loss_agg_mode={NORM} (null: actor.loss_agg_mode)")
NO_ENTROPY_BONUS = when(
    lambda s: s.owner.entropy_coeff == 0, "actor.entropy_coeff=0 (a coefficient computes the entropy anyway)"
)
DYNAMIC_BSZ = when(lambda s: s.owner.use_dynamic_bsz, lambda s: f"{s.section}use_dynamic_bsz=true")
# verl reads a micro-batch's row count only without token-budget micro-batches; the actor's
# setting also governs the old-log-prob and reference passes (verl's log_prob_* keys default to it)
ACTOR_ROWS = when(
    lambda s: not s.config.actor.use_dynamic_bsz,
    "actor.use_dynamic_bsz=false (true sizes micro-batches by actor.ppo_max_token_len_per_gpu)",
)
CRITIC_ROWS = when(
    lambda s: not s.config.critic.use_dynamic_bsz,
    "critic.use_dynamic_bsz=false (true sizes micro-batches by critic.ppo_max_token_len_per_gpu)",
)
# verl's DataLoader reads its generator only to shuffle (make_iterator in verl/utils/tensordict_utils.py)
SHUFFLED = when(
    lambda s: s.config.actor.shuffle if s.section == "actor." else critic_setting(s.config, "shuffle"),
    lambda s: f"{s.section}shuffle=true",
)
# verl's engines take the warm-up from the ratio whenever lr_warmup_steps <= 0 (FSDPEngine._build_lr_scheduler)
WARMUP_BY_RATIO = when(lambda s: s.owner.lr_warmup_steps <= 0, lambda s: f"{s.section}lr_warmup_steps=-1 (or any <= 0)")
COSINE = when(lambda s: s.owner.lr_scheduler_type == "cosine", lambda s: f"{s.section}lr_scheduler_type=cosine")
DECAYING = when(lambda s: s.owner.weight_decay > 0, lambda s: f"{s.section}weight_decay > 0")
KL_CTRL_TARGET = when(lambda s: s.owner.type != "fixed", "algorithm.kl_ctrl.type=adaptive or ppo_paper")
KL_CTRL_ADAPTIVE = when(lambda s: s.owner.type == "adaptive", "algorithm.kl_ctrl.type=adaptive")
# verl's fit validates at step 0 with val_before_train whatever test_freq says, then every test_freq steps
EVALUATING = when(
    lambda s: s.config.trainer.test_freq > 0 or s.config.trainer.val_before_train,
    "trainer.test_freq > 0 or trainer.val_before_train=true",
)
VAL_SAMPLING = when(lambda s: s.owner.temperature > 0, "rollout.val_kwargs.temperature > 0 (0 decodes greedily)")
LORA = when(lambda s: s.owner.lora_rank > 0, "model.lora_rank > 0")
MEGATRON_LORA = when(lambda s: s.config.model.lora.rank > 0, "model.lora.rank > 0")
NO_SAVED_ADAPTER = when(
    lambda s: s.command != "ppo" or s.config.model.lora_adapter_path is None,
    "model.lora_adapter_path=null (a saved adapter brings its own rank and scale)",
)
FILE_TASK = when(lambda s: s.config.data.task == "file", "data.task=file")
ARITHMETIC = when(lambda s: s.config.data.task == "arithmetic", "data.task=arithmetic")
PREFERENCE = when(lambda s: s.config.data.task == "preference", "data.task=preference")
RM_FILE = when(  # refppo rm checks the lengths of a file's comparisons; synthetic ones fit anyway
    lambda s: s.command != "rm" or s.config.data.task == "file", "data.task=file (a file's comparisons)"
)
REWARD_MODEL = when(lambda s: s.config.reward_model.enable, "reward_model.enable=true")
RULE_SCORES = when(lambda s: not s.config.reward_model.enable, "reward_model.enable=false (a rule or reward_fn scores)")
DAPO_MANAGER = when(lambda s: s.config.reward_model.reward_manager == "dapo", "reward_model.reward_manager=dapo")
REWARD_FILE = when(lambda s: s.owner.path is not None, "reward_model.custom_reward_function.path=<a .py file>")
OVERLONG = when(lambda s: s.config.reward_model.overlong_buffer.enable, "reward_model.overlong_buffer.enable=true")
CONTINUOUS_TOKEN = when(lambda s: s.owner.enable, "data.continuous_token.enable=true")
FILTERING = when(lambda s: s.owner.enable, "algorithm.filter_groups.enable=true")
FRESH_MODEL = when(
    lambda s: s.config.model.path is None, "model.path=null (a fresh tiny model; a checkpoint brings its own shape)"
)
# refppo rm and ppo need model.path; refppo sft without one builds a tiny model from refppo's own code
MODEL_FOLDER = when(
    lambda s: s.command != "sft" or s.config.model.path is not None,
    "model.path=<a model folder> (not a fresh tiny model)",
)
TINY_MODEL = {"commands": ("sft",), "needs": FRESH_MODEL, "unread_because": "the model's shape comes from model.path"}


EVALUATION_PROMPTS = when(
    lambda s: not (s.config.data.task == "file" and (s.config.data.val_files or s.command == "sft")),
    lambda s: (
        "data.val_files=null (data.val_files holds the evaluation prompts)"
        if s.command == "ppo"
        else "data.task=arithmetic or preference (refppo sft holds out data.val_fraction of a file)"
    ),
)
HELD_OUT_SHARE = when(
    lambda s: not s.config.data.val_files, "data.val_files=null (data.val_files holds the held-out records)"
)


# The critic settings that are the actor's when unset (verl's config interpolates them).
CRITIC_FROM_ACTOR = ("ppo_epochs", "ppo_mini_batch_size", "shuffle", "loss_agg_mode", "loss_scale_factor")


def critic_setting(config, name: str):
    """``critic.<name>``, or ``actor.<name>`` when unset, for a name in ``CRITIC_FROM_ACTOR``:
    ``ppo_epochs``, ``ppo_mini_batch_size`` (prompts), ``shuffle``, ``loss_agg_mode``, ``loss_scale_factor``
    (still None when both are: the trainer then divides by ``data.max_response_length``)."""
    value = getattr(config.critic, name)
    return getattr(config.actor, name) if value is None else value
