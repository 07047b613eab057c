import copy
import dataclasses
import math

import pytest
import torch
from _tolerances import reordered
from _trainers import make_trainer, minibatch_stats

from refppo import accel
from refppo.rollout.forward import ForwardPasses
from refppo.rollout.megatron_lora import add_megatron_lora
from refppo.runs.folder import RunFolder, check_resume
from refppo.settings.config import MegatronLoraConfig, apply_overrides
from refppo.settings.validate import validate
from refppo.training import update
from refppo.training.fit import fit
from refppo.training.metrics import bar_fields
from refppo.training.reward_fns import check_scores
from refppo.training.update import MAX_SKIPPED_UPDATES, LossTerm, count_skips, minibatch_rows, minibatch_updates


def _run(trainer, steps):
    return [trainer.train_step() for _ in range(steps)]


def _no_timing(metrics):
    return {k: v for k, v in metrics.items() if not k.startswith(("timing_s/", "timing_per_token_ms/", "perf/"))}


def test_score_improves_end_to_end():
    trainer = make_trainer(["actor.ppo_epochs=2"])
    history = _run(trainer, 40)
    first = sum(m["critic/score/mean"] for m in history[:5]) / 5
    last = sum(m["critic/score/mean"] for m in history[-5:]) / 5
    assert last > first + 0.4, (first, last)


def test_step_metrics_use_verls_names_and_are_finite():
    metrics = make_trainer(["actor.use_kl_loss=true", "algorithm.use_kl_in_reward=true"]).train_step()
    expected = [
        "actor/pg_loss",
        "actor/pg_clipfrac",
        "actor/pg_clipfrac_lower",
        "actor/ppo_kl",
        "actor/entropy",
        "actor/kl_loss",
        "actor/kl_coef",
        "actor/grad_norm",
        "actor/lr",
        "critic/lr",
        "critic/vf_loss",
        "critic/vf_clipfrac",
        "critic/vf_explained_var",
        "critic/score/mean",
        "critic/rewards/mean",
        "critic/advantages/mean",
        "critic/returns/mean",
        "critic/values/mean",
        "response_length/mean",
        "response_length/clip_ratio",
        "timing_s/gen",
        "timing_s/ref",
        "timing_s/old_log_prob",
        "timing_s/values",
        "timing_s/adv",
        "timing_s/update_actor",
        "timing_s/update_critic",
        "timing_s/step",
        "perf/throughput",
        "perf/max_memory_allocated_gb",
        "actor/reward_kl_penalty",
        "actor/reward_kl_penalty_coeff",
        "critic/score/max",
        "critic/advantages/min",
        "critic/values/max",
        "critic/vpred_mean",
        "prompt_length/mean",
        "prompt_length/clip_ratio",
        "response_length/max",
        "training/rollout_actor_probs_pearson_corr",
        "perf/total_num_tokens",
        "perf/time_per_step",
        "timing_per_token_ms/gen",
        "timing_per_token_ms/update_actor",
    ]
    missing = [k for k in expected if k not in metrics]
    assert not missing
    assert all(math.isfinite(v) for v in metrics.values())


def test_first_minibatch_has_ratio_one_in_decoupled_mode():
    trainer = make_trainer(["actor.ppo_epochs=2", "actor.ppo_micro_batch_size_per_gpu=4"])
    trainer.train_step()
    first = trainer.last_update_stats[0]
    assert abs(first["actor/ppo_kl"]) <= 1e-6
    assert first["actor/pg_clipfrac"] == 0.0 and first["actor/pg_clipfrac_lower"] == 0.0
    assert len(trainer.last_update_stats) == 4  # 2 epochs x 2 mini-batches
    assert any(abs(s["actor/ppo_kl"]) > 1e-6 for s in trainer.last_update_stats[1:])


@pytest.mark.parametrize(
    "overrides",
    [
        ["algorithm.rollout_correction.bypass_mode=true"],
        ["algorithm.rollout_correction.rollout_is=token", "algorithm.rollout_correction.rollout_is_threshold=1.5"],
        ["actor.policy_loss=penalty", "actor.penalty_kl_coef=0.5"],
        ["algorithm.use_kl_in_reward=true", "algorithm.kl_ctrl.type=adaptive", "algorithm.kl_ctrl.horizon=100"],
        ["actor.use_kl_loss=true", "actor.kl_loss_type=k3"],
        ["algorithm.use_kl_in_reward=true", "actor.use_kl_loss=true"],
        ["algorithm.adv_estimator=grpo", "rollout.n=4"],
        ["algorithm.adv_estimator=rloo", "rollout.n=4", "actor.loss_agg_mode=seq-mean-token-mean"],
        ["actor.clip_ratio_c=null", "actor.clip_ratio_high=0.28", "rollout.top_k=5", "rollout.top_p=0.9"],
        [
            "actor.optim.lr_scheduler_type=cosine",
            "actor.optim.min_lr_ratio=0.1",
            "critic.optim.lr_warmup_steps=1",
            "trainer.critic_warmup=2",
        ],
    ],
)
def test_modes_run(overrides):
    history = _run(make_trainer(overrides), 2)
    for m in history:
        assert all(math.isfinite(v) for v in m.values()), overrides
    assert history[-1]["actor/lr"] > 0


def test_critic_has_its_own_epochs_and_mini_batches():
    trainer = make_trainer(["actor.ppo_epochs=2", "critic.ppo_epochs=3", "critic.ppo_mini_batch_size=4"])
    batch, _ = trainer.make_experience(trainer.sampler.next_batch(), {})
    critic_minis, actor_minis = trainer.update(batch, {})
    assert len(critic_minis) == 3 * 16 // 4 and len(actor_minis) == 2 * 16 // 8
    assert all("critic/vf_loss" in m for m in critic_minis) and all("actor/pg_loss" in m for m in actor_minis)
    defaults = make_trainer(["actor.ppo_epochs=2"])  # unset: the actor's schedule
    batch, _ = defaults.make_experience(defaults.sampler.next_batch(), {})
    assert [len(m) for m in defaults.update(batch, {})] == [4, 4]


def test_missing_eos_penalty_lowers_unfinished_responses_only():
    penalty = 0.75
    trainer = make_trainer(
        [f"reward_model.missing_eos_penalty={penalty}", "data.train_batch_size=64", "data.max_response_length=8"],
        reward_fn=lambda p, r, rec: torch.ones(len(r)),
    )
    batch, _ = trainer.make_experience(trainer.sampler.next_batch(), {})
    scores = batch["token_level_scores"].sum(-1)  # the sequence scores
    truncated = batch["is_truncated"]
    assert 0 < int(truncated.sum()) < len(truncated)  # a random tiny model ends some responses, not all
    assert torch.equal(scores, 1.0 - penalty * truncated.float())


def test_kl_controller_moves_in_the_reward():
    target, horizon = 0.01, 10
    trainer = make_trainer(
        [
            "algorithm.use_kl_in_reward=true",
            "algorithm.kl_penalty=abs",
            "algorithm.kl_ctrl.type=adaptive",
            "algorithm.kl_ctrl.kl_coef=0.1",
            f"algorithm.kl_ctrl.target_kl={target}",
            f"algorithm.kl_ctrl.horizon={horizon}",
        ]
    )
    m = _run(trainer, 4)
    assert m[0]["actor/reward_kl_penalty"] == 0.0  # the actor starts as the reference
    assert m[0]["actor/reward_kl_penalty_coeff"] == pytest.approx(0.1)
    assert m[-1]["actor/reward_kl_penalty"] > 0
    for now, nxt in zip(m, m[1:] + [{"actor/reward_kl_penalty_coeff": trainer.kl_ctrl.value}]):
        error = min(max(now["actor/reward_kl_penalty"] / target - 1, -0.2), 0.2)
        expected = now["actor/reward_kl_penalty_coeff"] * (1 + error * 16 / horizon)
        assert nxt["actor/reward_kl_penalty_coeff"] == pytest.approx(expected, rel=1e-6)


def test_critic_warmup_counts_as_verls_fit():
    """verl 0.9, ``RayPPOTrainer.fit`` in ``verl/trainer/ppo/ray_trainer.py``: ``global_steps`` starts
    at 1, and the actor is updated unless ``config.trainer.critic_warmup > self.global_steps``."""
    for warmup in (0, 1, 2, 3):
        trainer = make_trainer([f"trainer.critic_warmup={warmup}"])
        history = _run(trainer, 3)
        updated = [step for step, m in enumerate(history, start=1) if "actor/pg_loss" in m]
        verl = [global_steps for global_steps in (1, 2, 3) if not warmup > global_steps]
        assert updated == verl, (warmup, updated)
        assert all("critic/vf_loss" in m for m in history)


@pytest.mark.parametrize("test_freq", [-1, 2])
@pytest.mark.parametrize("val_before_train", [True, False])
def test_validation_steps_are_verls(test_freq, val_before_train):
    """verl 0.9, ``RayPPOTrainer.fit`` in ``verl/trainer/ppo/ray_trainer.py``: ``_validate()`` before
    the first step whenever ``trainer.val_before_train`` (whatever ``test_freq`` says), then at each
    step where ``test_freq > 0 and (is_last_step or global_steps % test_freq == 0)``."""
    overrides = [f"trainer.test_freq={test_freq}", f"trainer.val_before_train={val_before_train}"]
    overrides += ["trainer.total_training_steps=3", "data.val_size=4"]
    history = fit(make_trainer(overrides), progress_bar=False)
    validated = [m["step"] for m in history if "val/score" in m]
    verl = [0] if val_before_train else []
    verl += [step for step in (1, 2, 3) if test_freq > 0 and (step == 3 or step % test_freq == 0)]
    assert validated == verl


def test_without_a_critic_a_warm_up_delays_the_actor_as_verls_fit_and_the_default_does_not():
    """verl's ``RayPPOTrainer.fit`` (and the V1 trainer's ``_step_once``) updates the actor only
    when ``critic_warmup <= global_steps``, outside its ``use_critic`` branch: with GRPO,
    ``critic_warmup=3`` leaves the actor as it is at steps 1 and 2. refppo's default (null) is 0
    without a critic."""
    delayed = make_trainer(
        ["algorithm.adv_estimator=grpo", "rollout.n=2"], edit=lambda c: setattr(c.trainer, "critic_warmup", 3)
    )
    m = _run(delayed, 3)
    assert ["actor/pg_loss" in row for row in m] == [False, False, True]
    assert delayed.learners["actor"].schedule.last_epoch == 1  # the actor's optimiser stepped once
    default = make_trainer(
        ["algorithm.adv_estimator=grpo", "rollout.n=2"], edit=lambda c: setattr(c.trainer, "critic_warmup", None)
    )
    assert "actor/pg_loss" in _run(default, 1)[0]


def test_lr_metrics_are_the_rate_after_the_schedules_step_and_warm_up_starts_at_zero():
    lr = 3e-3  # make_trainer's, for both models
    trainer = make_trainer(
        ["actor.optim.lr_warmup_steps=2", "critic.optim.lr_warmup_steps=2", "trainer.critic_warmup=2"]
    )
    actor, critic = ([p.clone() for p in net.parameters()] for net in (trainer.actor, trainer.critic))
    m = [trainer.train_step()]
    # verl 0.9 logs what lr_scheduler_step() returns: the rate after the step, the next update's
    assert "actor/lr" not in m[0] and m[0]["critic/lr"] == pytest.approx(lr / 2)  # no actor update, no actor/lr
    assert all(torch.equal(a, b) for a, b in zip(critic, trainer.critic.parameters()))  # an update at lr 0
    m.append(trainer.train_step())
    assert m[1]["actor/lr"] == pytest.approx(lr / 2) and m[1]["critic/lr"] == pytest.approx(lr)
    assert all(torch.equal(a, b) for a, b in zip(actor, trainer.actor.parameters()))  # its first update, at 0
    m.append(trainer.train_step())
    assert m[2]["actor/lr"] == pytest.approx(lr) and m[2]["critic/lr"] == pytest.approx(lr)
    assert not all(torch.equal(a, b) for a, b in zip(actor, trainer.actor.parameters()))


def test_same_seed_same_metrics_and_different_seed_differs():
    one = [_no_timing(m) for m in _run(make_trainer(seed=3), 3)]
    two = [_no_timing(m) for m in _run(make_trainer(seed=3), 3)]
    other = [_no_timing(m) for m in _run(make_trainer(seed=4), 3)]
    assert one == two
    assert one != other


def _checkpointed(model) -> bool:
    return any(getattr(m, "gradient_checkpointing", False) for m in model.modules())


# the actor: a whole model, PEFT's LoRA, Megatron's LoRA (forward hooks, recomputed with the layer)
ADAPTED = {
    "none": {},
    "peft": {"lora_rank": 4},
    "megatron": {
        "adapt": lambda actor: add_megatron_lora(actor, MegatronLoraConfig(rank=4, lora_B_init_method="normal"))
    },
}


@pytest.mark.parametrize("actor", sorted(ADAPTED))
def test_gradient_checkpointing_changes_no_number(actor):
    """model.enable_gradient_checkpointing and critic.model.enable_gradient_checkpointing turn
    activation checkpointing on in the actor (a LoRA actor's base too) and the critic, not in a
    separate reference; three steps then give the same metrics and weights as without it."""
    runs = {}
    for on in ("false", "true"):
        flags = [f"model.enable_gradient_checkpointing={on}", f"critic.model.enable_gradient_checkpointing={on}"]
        trainer = make_trainer([*flags, "algorithm.use_kl_in_reward=true"], **ADAPTED[actor])
        runs[on] = trainer, [_no_timing(m) for m in _run(trainer, 3)]
    (plain, plain_metrics), (checkpointed, metrics) = runs["false"], runs["true"]
    assert _checkpointed(checkpointed.actor) and _checkpointed(checkpointed.critic)
    assert not _checkpointed(plain.actor) and not _checkpointed(plain.critic)
    if actor == "none":
        assert not _checkpointed(checkpointed.reference)
    assert metrics == plain_metrics
    for a, b in [(plain.actor, checkpointed.actor), (plain.critic, checkpointed.critic)]:
        assert all(torch.equal(x, y) for x, y in zip(a.parameters(), b.parameters(), strict=True))


def test_resume_gives_the_same_metrics(tmp_path):
    overrides = ["trainer.total_training_steps=4", "trainer.save_freq=2", "trainer.test_freq=2"]
    straight = make_trainer(overrides)
    full = fit(straight, RunFolder(tmp_path / "a", straight.config), progress_bar=False)

    first = make_trainer(overrides)
    first.config.trainer.total_training_steps = 2  # "stopped" after step 2
    fit(first, RunFolder(tmp_path / "b", first.config), progress_bar=False)
    run = RunFolder(tmp_path / "b", straight.config, resume=check_resume(tmp_path / "b", straight.config))
    resumed = make_trainer(overrides)
    with torch.no_grad():  # scrambled weights: everything must come from the checkpoint
        for p in [*resumed.actor.parameters(), *resumed.critic.parameters()]:
            p.add_(torch.randn_like(p))
    resumed.load_checkpoint(run.resume.folder, run.resume.state)
    rest = fit(resumed, run, progress_bar=False)
    assert [_no_timing(m) for m in rest] == [_no_timing(m) for m in full[3:]]
    assert [m["step"] for m in rest] == [3, 4]
    lines = (tmp_path / "b" / "metrics.jsonl").read_text().splitlines()
    assert len(lines) == 5  # step 0 (validation) + 4 steps


def test_nonfinite_gradient_skips_the_step():
    trainer = make_trainer()
    batch = {"response_mask": torch.ones(16, 3)}
    param = trainer.learners["actor"].params[0]
    before = param.detach().clone()
    trainer._actor_loss = lambda mb: ({"actor/pg_loss": LossTerm(param.sum() * float("nan"), "token-mean")}, {})
    stats = minibatch_stats(trainer, batch, "actor")
    assert torch.equal(param.detach(), before)
    assert all(s["actor/skipped_nonfinite_grad"] == 1.0 for s in stats)


# A skipped update still steps the learning-rate schedule (as verl's does), which torch warns about
# when no optimiser step has happened yet.
@pytest.mark.filterwarnings("ignore:Detected call of `lr_scheduler.step\\(\\)` before `optimizer.step\\(\\)`")
def test_a_run_whose_updates_are_all_skipped_stops_with_an_error():
    """Scores of 1e30 give a non-finite gradient in every update: the run must stop, not finish."""
    trainer = make_trainer(reward_fn=lambda p, r, rec: torch.full((len(r),), 1e30))
    limit = MAX_SKIPPED_UPDATES
    with pytest.raises(FloatingPointError, match=f"the last {limit} critic updates were all skipped"):
        _run(trainer, limit)  # 2 critic updates a step
    assert trainer.step == limit // 2 - 1
    learner = trainer.learners["actor"]
    for finite in [False] * (limit - 1) + [True] + [False] * (limit - 1):  # a good update resets the count
        count_skips(learner, finite)
    assert learner.skipped_in_a_row == limit - 1


SPLITS = {
    "rows": ["actor.ppo_micro_batch_size_per_gpu=2"],
    "tokens": ["actor.use_dynamic_bsz=true", "actor.ppo_max_token_len_per_gpu=32"],
}


def test_a_losss_other_stats_are_the_mini_batchs_token_mean_whatever_the_micro_batches():
    """A loss's own stats (clip fraction, ppo_kl, ...) are logged as the mini-batch's token mean: each
    micro-batch's value weighed by its share of the tokens, so the number does not change with the
    micro-batch split, a speed setting (verl 0.9 logs the plain mean over its micro-batches, which
    does). A probe stat, each micro-batch's mean token count per row, comes out as the mini-batch's."""
    trainer = make_trainer(["actor.ppo_micro_batch_size_per_gpu=2", "data.max_response_length=6"])
    batch, _ = trainer.make_experience(trainer.sampler.next_batch(), {})

    def probed(mb):
        terms, stats = trainer._actor_loss(mb)
        mask = mb["response_mask"].double()
        return terms, stats | {"probe": (mask.sum(-1) ** 2).sum() / mask.sum()}  # a token mean of row lengths

    settings = trainer._update_settings("actor")
    first = minibatch_updates(batch, trainer.learners["actor"], settings, probed, trainer.world)[0]
    order = minibatch_rows(batch["response_mask"].shape[0], settings)[0]
    lengths = batch["response_mask"][order].double().sum(-1)
    assert len(set(lengths.tolist())) > 1, "a vacuous check: every row as long"
    # each share is one float32 division (2^-24 relative), summed over at most 4 micro-batches
    assert float(first["probe"]) == pytest.approx(float((lengths**2).sum() / lengths.sum()), rel=4 * 2**-24)


@pytest.mark.parametrize("split_by", list(SPLITS))
@pytest.mark.parametrize(
    "mode", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm", "token-sum"]
)
def test_logged_losses_are_the_mini_batch_values_with_micro_batching(mode, split_by):
    """The first mini-batch's logged stats (before any update) equal with one micro-batch and
    with several (of 2 rows, or of a 32-token budget: rows regrouped, padding cut): the loss
    stats combine like the loss, the token means by token share."""
    settings = [
        f"actor.loss_agg_mode={mode}",
        f"critic.loss_agg_mode={mode}",
        "actor.use_kl_loss=true",
        "actor.entropy_coeff=0.01",
    ]
    whole, split = make_trainer(settings), make_trainer([*settings, *SPLITS[split_by]])
    batch, _ = whole.make_experience(whole.sampler.next_batch(), {})
    split.sampler.next_batch()
    for trainer in (whole, split):
        mini = minibatch_stats(trainer, {k: v.clone() for k, v in batch.items()}, "actor")[0]
        trainer.first = {k: float(v) for k, v in mini.items() if k != "actor/grad_norm"}
    assert set(whole.first) >= {
        "actor/pg_loss",
        "actor/kl_loss",
        "actor/entropy_loss",
        "actor/pg_clipfrac",
        "actor/ppo_kl",
    }
    # the same sums in other orders: a 50-token log-softmax, then 32 tokens a mini-batch (_tolerances)
    assert whole.first == pytest.approx(split.first, rel=reordered(50 + 32), abs=reordered(50 + 32) * 10)
    first_mini = {k: v[:8] for k, v in batch.items()}
    micro = split.config.actor.ppo_micro_batch_size_per_gpu
    assert len(split.accel.actor.micro_batches(first_mini, micro)) > 2, "a vacuous check: one micro-batch"


def test_reward_function_errors():
    with pytest.raises(
        ValueError, match=r"reward function test_trainer:.*<lambda> returned shape \(3,\); expected \(16,\)"
    ):
        make_trainer(reward_fn=lambda p, r, rec: torch.zeros(3)).train_step()
    for wrong in (None, ["good"] * 16):
        with pytest.raises(ValueError, match=f"returned a {type(wrong).__name__}; expected 16 number\\(s\\)"):
            make_trainer(reward_fn=lambda p, r, rec, wrong=wrong: wrong).train_step()
    for wrong, message in (
        ({"score": 1.0}, r"<lambda>'s 'score' returned shape \(\); expected \(16,\)"),  # verl's form: one list a key
        ({"acc": [1.0] * 16}, r"returned a dict without 'score' \(it has \['acc'\]\)"),
        ({"score": [0.0] * 16, "acc": [1.0] * 3}, r"<lambda>'s 'acc' returned shape \(3,\); expected \(16,\)"),
    ):
        with pytest.raises(ValueError, match=message):
            make_trainer(reward_fn=lambda p, r, rec, wrong=wrong: wrong).train_step()
    with pytest.raises(ValueError, match="non-finite score"):
        make_trainer(reward_fn=lambda p, r, rec: torch.full((len(r),), float("nan"))).train_step()
    assert check_scores([1, 2], 2, "x").dtype == torch.float32


def test_the_batch_is_checked_once_per_step_before_any_update(monkeypatch):
    """A critic that outputs NaN is caught when the step's batch is evaluated (one host sync), with
    the key named and no model updated, and so are NaN old log-probs and a NaN entropy from the
    old-log-prob pass; inside the update loop the value checks are off."""
    trainer = make_trainer(["trainer.critic_warmup=0"])
    with torch.no_grad():
        trainer.critic.score.bias.fill_(float("nan"))
    before = [p.detach().clone() for p in trainer.learners["actor"].params]
    with pytest.raises(ValueError, match="values contains NaN or inf"):
        trainer.train_step()  # GAE's own input check
    assert all(torch.equal(a, b) for a, b in zip(before, trainer.learners["actor"].params))

    def nan_log_probs(self, model, batch, temperature=1.0, micro_batch_size=None, calculate_entropy=False):
        nan = torch.full_like(batch["rollout_log_probs"], float("nan"))
        return (nan, torch.zeros_like(nan)) if calculate_entropy else nan

    monkeypatch.setattr(ForwardPasses, "compute_log_probs", nan_log_probs)
    with pytest.raises(ValueError, match="old_log_probs contains NaN or inf at a valid token"):
        make_trainer(["trainer.critic_warmup=0"]).train_step()  # nothing else reads them before the update
    monkeypatch.undo()

    def nan_entropy(self, *args, _plain=ForwardPasses.compute_log_probs):
        out = _plain(self, *args)
        return (out[0], torch.full_like(out[1], float("nan"))) if len(args) == 5 and args[4] else out

    monkeypatch.setattr(ForwardPasses, "compute_log_probs", nan_entropy)
    with pytest.raises(ValueError, match="entropy contains NaN or inf at a valid token"):
        make_trainer(["trainer.critic_warmup=0"]).train_step()  # actor/entropy, from the old-log-prob pass
    monkeypatch.undo()

    trainer = make_trainer(["actor.ppo_micro_batch_size_per_gpu=2", "critic.ppo_micro_batch_size_per_gpu=2"])
    batch, _ = trainer.make_experience(trainer.sampler.next_batch(), {})
    syncs = []
    spying = [True]

    def spied_tolist(self, _tolist=torch.Tensor.tolist):
        syncs.extend([1] if spying[0] else [])
        return _tolist(self)

    def unspied_rows(*args, _rows=update.minibatch_rows):
        # the mini-batches' row numbers: drawn on the CPU (torch's sampler lists them), never read
        # from the device
        spying[0] = False
        try:
            return _rows(*args)
        finally:
            spying[0] = True

    monkeypatch.setattr(torch.Tensor, "tolist", spied_tolist)
    monkeypatch.setattr(update, "minibatch_rows", unspied_rows)
    trainer.update(batch, {})
    assert syncs == [], f"{len(syncs)} value-check host syncs in the update loop (8 micro-batches)"


@pytest.mark.parametrize("fused", [False, True])
def test_the_update_computes_the_entropy_only_with_a_coefficient(monkeypatch, fused):
    """actor.entropy_coeff=0 (the default): no update forms an entropy (actor/entropy comes from
    the old-log-prob pass, as in verl 0.9); with a coefficient, every one computes it, logs
    actor/entropy_loss and differentiates it (seen in the blocks' backward pass, fused); with
    actor.calculate_entropy=true computes and logs it without a gradient."""
    import refppo.accel.logprobs as L

    asked, differentiated = [], []
    plain_grads = L._chunked_grads
    monkeypatch.setattr(L, "_chunked_grads", lambda *a: differentiated.append(a[3] is not None) or plain_grads(*a))
    for setting, computed, bonus in (
        ("actor.entropy_coeff=0", False, False),
        ("actor.entropy_coeff=0.01", True, True),
        ("actor.calculate_entropy=true", True, False),
    ):
        asked.clear(), differentiated.clear()
        trainer = make_trainer([setting, f"model.use_fused_kernels={fused}"])
        log_probs = trainer.accel.actor.log_probs

        def spy(model, batch, temperature, calculate_entropy, _plain=log_probs):
            if torch.is_grad_enabled():  # the update's passes, not the old-log-prob pass
                asked.append(calculate_entropy)
            return _plain(model, batch, temperature, calculate_entropy)

        trainer.accel = dataclasses.replace(
            trainer.accel, actor=dataclasses.replace(trainer.accel.actor, log_probs=spy)
        )
        metrics = trainer.train_step()
        assert metrics["actor/entropy"] > 0 and ("actor/entropy_loss" in metrics) == computed
        assert asked and all(a == computed for a in asked), (setting, asked)
        assert all(d == bonus for d in differentiated) and bool(differentiated) == fused, (setting, differentiated)


def test_the_progress_bar_shows_the_kl_to_the_reference_when_one_is_computed():
    plain = make_trainer().train_step()
    assert list(bar_fields(plain)) == ["score", "ppo_kl", "step_s"]
    both = make_trainer(["algorithm.use_kl_in_reward=true", "actor.use_kl_loss=true"]).train_step()
    fields = bar_fields(both)
    assert list(fields) == ["score", "ref_kl", "kl_loss", "ppo_kl", "step_s"]
    assert fields["ref_kl"] == f"{both['actor/reward_kl_penalty']:.4g}"


@pytest.mark.parametrize("role", ["actor", "critic"])
def test_an_update_that_breaks_the_model_stops_the_run_naming_step_and_setting(role):
    trainer = make_trainer([f"{role}.optim.lr=1e10"])  # finite weights, but the next forward passes overflow
    trainer.train_step()
    with pytest.raises(FloatingPointError, match=f"step 2: .*contains NaN or inf.*{role}.optim.lr"):
        trainer.train_step()


def test_micro_batch_settings_changed_between_steps_reach_the_next_update():
    """benchmarks/ab_step.py switches one trainer between variants by giving it another config and
    its speed paths (``trainer.config``, ``trainer.accel``): each update reads how to split the
    batch from them, as it is then."""
    trainer = make_trainer()
    sizes = []
    actor_loss = trainer._actor_loss
    trainer._actor_loss = lambda mb: sizes.append(mb["response_mask"].shape[0]) or actor_loss(mb)
    trainer.train_step()
    whole = set(sizes)
    config = validate(apply_overrides(copy.deepcopy(trainer.config), ["actor.ppo_micro_batch_size_per_gpu=2"]))
    trainer.config = config
    trainer.accel = accel.select(config, trainer.device)
    sizes.clear()
    trainer.train_step()
    assert whole != {2} and set(sizes) == {2}


def test_data_shuffle_false_takes_the_prompts_in_order():
    trainer = make_trainer(["data.shuffle=false"])
    records = trainer.sampler.records
    assert trainer.sampler.next_batch() == records[:16]
