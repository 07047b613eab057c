"""DAPO in refppo: dynamic sampling (refppo.training.dynamic_sampling, verl's algorithm.filter_groups) and
the soft overlong punishment (refppo.algorithms.overlong.overlong_penalty, verl's DAPO reward manager)."""

import random

import numpy as np
import pytest
import torch
from _trainers import RECORDS, make_trainer

from refppo.algorithms.overlong import overlong_penalty
from refppo.distributed import World, check_world
from refppo.rollout.prompts import decode_texts, sequence_batch
from refppo.settings.config import Config, apply_overrides
from refppo.settings.validate import validate
from refppo.settings.verl_names import translate
from refppo.training.dynamic_sampling import DynamicSampling, join_batches, varied_groups

GRPO = ["algorithm.adv_estimator=grpo", "rollout.n=4"]
DAPO = [*GRPO, "algorithm.filter_groups.enable=true", "algorithm.filter_groups.metric=acc"]


def verl_overlong(length, max_len, buffer_len, factor):
    """verl's DAPO reward manager, one response at a time: min(-exceed / len * factor, 0)."""
    exceed = length - (max_len - buffer_len)
    return min(-exceed / buffer_len * factor, 0.0)


@pytest.mark.parametrize("seed", range(5))
def test_overlong_penalty_equals_verls(seed):
    rng = random.Random(seed)
    max_len = rng.randint(1, 64)
    buffer_len, factor = rng.randint(1, max_len), rng.uniform(0, 3)
    lengths = torch.tensor([rng.randint(0, max_len) for _ in range(50)])
    expected = torch.tensor([verl_overlong(int(n), max_len, buffer_len, factor) for n in lengths], dtype=torch.float64)
    got = overlong_penalty(lengths, max_len, buffer_len, factor)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got.double(), expected, atol=1e-6, rtol=1e-6)


def test_overlong_penalty_slopes_over_the_buffer_only():
    lengths = torch.arange(0, 11)
    got = overlong_penalty(lengths, 10, 4, 2.0)
    assert (got[:7] == 0).all(), "no penalty up to max - buffer = 6 tokens"
    assert got[10] == -2.0 and got[8] == -1.0, "linear to -penalty_factor at the limit"
    with pytest.raises(ValueError, match="buffer_len"):
        overlong_penalty(lengths, 10, 0, 1.0)


def test_varied_groups_are_verls_numpy_std():
    rng = np.random.default_rng(0)
    for _ in range(30):
        index = torch.tensor(sorted(rng.integers(0, 6, size=20)))
        values = torch.tensor(rng.choice([0.0, 1.0, 0.1, 0.3], size=20), dtype=torch.float32)
        expected = []
        for g in index.tolist():
            group = [float(v) for v, i in zip(values, index.tolist()) if i == g]
            expected.append(len(group) == 1 or float(np.std(group)) > 0.0)
        assert varied_groups(values, index).tolist() == expected


def test_join_batches_keeps_every_rows_tokens():
    pad = 0

    def part(prompts, responses):
        width = max(map(len, prompts))
        length = max(map(len, responses))
        p = torch.tensor([[pad] * (width - len(x)) + x for x in prompts])
        pm = torch.tensor([[0] * (width - len(x)) + [1] * len(x) for x in prompts])
        r = torch.tensor([x + [pad] * (length - len(x)) for x in responses])
        rm = torch.tensor([[1] * len(x) + [0] * (length - len(x)) for x in responses])
        batch = sequence_batch(p, pm, r, rm)
        return batch | {"rollout_log_probs": -rm.float(), "index": torch.arange(len(prompts))}

    a = part([[5, 6], [7]], [[8, 9, 10], [11]])
    b = part([[12, 13, 14]], [[15]])
    whole = join_batches([a, b], pad)
    assert whole["prompts"].tolist() == [[0, 5, 6], [0, 0, 7], [12, 13, 14]]
    assert whole["responses"].tolist() == [[8, 9, 10], [11, 0, 0], [15, 0, 0]]
    assert whole["rollout_log_probs"].tolist() == [[-1, -1, -1], [-1, 0, 0], [-1, 0, 0]]
    expected = sequence_batch(
        whole["prompts"], (whole["prompts"] != 0).long(), whole["responses"], whole["response_mask"]
    )
    for key in ("input_ids", "attention_mask", "position_ids"):
        assert torch.equal(whole[key], expected[key]), key
    assert whole["index"].tolist() == [0, 1, 0]


def half_alike(prompts, responses, records):
    """Every response to a prompt a+b= with even a scores 1 (a group that is all alike); the others
    score their first character's code (groups that differ)."""
    return torch.tensor(
        [1.0 if int(p.split("+")[0]) % 2 == 0 else float(ord(r[0]) if r else 0) for p, r in zip(prompts, responses)]
    )


def test_dynamic_sampling_keeps_the_first_groups_that_differ():
    trainer = make_trainer(DAPO, reward_fn=half_alike)
    calls = []
    generate_and_score = trainer.generate_and_score

    def recording(records, timing, first_row=0):
        out = generate_and_score(records, timing, first_row)
        calls.append((records, out))
        return out

    trainer.generate_and_score = recording
    timing = {}
    batch, stats = trainer.make_experience(trainer.sampler.next_batch(), timing)
    # the groups a plain reading of DAPO keeps: in order, those whose scores are not all alike
    expected, kept_before_last = [], 0
    for records, (_, scores, _) in calls:
        kept_before_last = len(expected)
        for g, record in enumerate(records):  # each prompt's 4 responses are rows 4g..4g+3
            group = scores[4 * g : 4 * g + 4].double().numpy()
            if float(np.std(group)) > 0:
                expected.append(record["prompt"])
    assert len(calls) >= 2 and stats["train/num_gen_batches"] == len(calls)
    assert stats["training/filter_groups/evicted_samples"] == 16 * len(calls) - len(expected)
    assert kept_before_last < 16 <= len(expected), "generation stops once the batch is full"
    prompts, responses = decode_texts(trainer.tokenizer, batch)
    assert prompts[::4] == expected[:16], "the first 16 kept groups, in order"
    assert batch["index"].tolist() == [i for i in range(16) for _ in range(4)]
    scores = batch["token_level_scores"].sum(-1)
    torch.testing.assert_close(scores, half_alike(prompts, responses, None).to(scores.dtype), atol=0, rtol=0)
    assert all(scores[i : i + 4].unique().numel() > 1 for i in range(0, 64, 4)), "every group differs"
    assert all(batch["advantages"][i : i + 4].abs().sum() > 0 for i in range(0, 64, 4))
    assert timing["timing_s/gen"] > 0


@pytest.mark.parametrize(
    "metric, kept",
    [("acc", [False, True]), ("seq_reward", [True, True]), ("seq_final_reward", [True, True]), ("score", None)],
)
def test_groups_are_filtered_on_the_metric_as_verls_replay_buffer_does(metric, kept):
    """verl's ``ReplayBuffer`` (``verl/trainer/ppo/v1/replay_buffer.py``) reads the metric from
    ``reward_extra_info`` and raises when it is missing; its DAPO reward manager puts a plain score
    there as ``acc``, before the overlong penalty. Two groups of two: the first right twice, one
    response penalised for length (scores 1.0 and 0.75), the second right once."""
    acc = torch.tensor([1.0, 1.0, 1.0, 0.0])
    scores = acc + torch.tensor([0.0, -0.25, 0.0, 0.0])
    batch = sequence_batch(
        torch.ones(4, 2, dtype=torch.long),
        torch.ones(4, 2, dtype=torch.long),
        torch.ones(4, 3, dtype=torch.long),
        torch.ones(4, 3, dtype=torch.long),
    )
    batch["index"] = torch.tensor([0, 0, 1, 1])
    groups = DynamicSampling(2, 2, 0, pad_token_id=0, metric=metric)
    if kept is None:  # a plain score gives acc, not score
        with pytest.raises(RuntimeError, match="filter_groups.metric=score: the reward gives no 'score'"):
            groups.add(batch, scores, {"acc": acc})
        return
    groups.add(batch, scores, {"acc": acc})
    assert groups.kept == sum(kept)


def test_dynamic_sampling_stops_at_max_num_gen_batches():
    trainer = make_trainer([*DAPO, "algorithm.filter_groups.max_num_gen_batches=1"], reward_fn=half_alike)
    with pytest.raises(RuntimeError, match=r"1 generation batches \(max_num_gen_batches\) gave \d+ of the 16"):
        trainer.train_step()


def test_a_dynamic_sampling_run_trains():
    trainer = make_trainer(DAPO, reward_fn=half_alike)
    for _ in range(2):
        metrics = trainer.train_step()
    assert metrics["train/num_gen_batches"] >= 2 and "actor/pg_loss" in metrics


def test_without_filtering_one_generation_batch_is_used():
    trainer = make_trainer(GRPO, reward_fn=half_alike)
    batch, stats = trainer.make_experience(RECORDS[:16], {})
    assert "train/num_gen_batches" not in stats and batch["responses"].shape[0] == 64


@pytest.mark.parametrize("max_resp_len", [None, 5])
def test_overlong_shaping_in_the_trainer_scores(max_resp_len):
    """verl's DAPO manager slopes to the limit it is given (reward.reward_kwargs.max_resp_len);
    refppo's default is data.max_response_length (4 here)."""
    shaping = [
        "reward_model.reward_manager=dapo",
        "reward_model.overlong_buffer.enable=true",
        "reward_model.overlong_buffer.len=2",
        "reward_model.overlong_buffer.penalty_factor=0.5",
        "reward_model.overlong_buffer.log=true",
        *([f"reward_model.max_resp_len={max_resp_len}"] if max_resp_len else []),
    ]
    plain, shaped = make_trainer(GRPO, reward_fn=half_alike), make_trainer([*GRPO, *shaping], reward_fn=half_alike)
    rows = [r for r in RECORDS[:16] for _ in range(4)]
    batch = shaped.generate(RECORDS[:16], 4)
    base, _ = plain.score(batch, rows)
    scores, extras = shaped.score(batch, rows)
    lengths = batch["response_mask"].sum(-1).tolist()
    penalty = torch.tensor([verl_overlong(n, max_resp_len or 4, 2, 0.5) for n in lengths])
    assert (penalty < 0).any()
    torch.testing.assert_close(scores, base + penalty)
    torch.testing.assert_close(extras["overlong_reward"], penalty)
    assert extras["overlong"].tolist() == [float(p < 0) for p in penalty]


def test_validation_keeps_a_dict_results_own_score_beside_the_shaped_reward():
    """verl's ``_validate`` (``verl/trainer/ppo/ray_trainer.py``) logs ``reward``, the score trained
    on, and then every entry of the reward manager's extra info, a dict result's own ``score``
    among them: under DAPO's overlong shaping the two differ, and both are validation variables."""
    from refppo.training.validation import held_out_metrics

    def scored(prompts, responses, records):
        return {"score": [float(len(r) % 3) for r in responses], "acc": [float(r[:1] == "7") for r in responses]}

    shaping = [
        "reward_model.reward_manager=dapo",
        "reward_model.overlong_buffer.enable=true",
        "reward_model.overlong_buffer.len=2",
        "reward_model.overlong_buffer.penalty_factor=0.5",
    ]
    trainer = make_trainer(shaping, reward_fn=scored)
    metrics, _ = held_out_metrics(trainer)
    batch = trainer.generate(trainer.val_records, 1, do_sample=False, first_row=0, stream=2)
    shaped, _ = trainer.score(batch, trainer.val_records)
    texts = decode_texts(trainer.tokenizer, batch)[1]
    assert shaped.tolist() != [float(len(r) % 3) for r in texts], "a vacuous check: no response was shaped"
    source = "val-aux/arithmetic"
    assert metrics[f"{source}/score/mean@1"] == pytest.approx(sum(len(r) % 3 for r in texts) / len(texts))
    assert metrics[f"{source}/reward/mean@1"] == pytest.approx(shaped.mean().item(), abs=1e-6)
    assert metrics["val/score"] == pytest.approx(shaped.mean().item(), abs=1e-6), "val/score: the score trained on"
    assert metrics["val-core/arithmetic/acc/mean@1"] == metrics["val/acc"]


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["algorithm.filter_groups.enable=true"], "needs algorithm.filter_groups.metric"),
        (
            [*DAPO[2:3], "algorithm.filter_groups.metric=seq_final_reward", "algorithm.use_kl_in_reward=true"],
            "filter on seq_reward",
        ),
        (["algorithm.filter_groups.max_num_gen_batches=3"], "algorithm.filter_groups.enable=true"),
        (["reward_model.overlong_buffer.enable=true"], "reward_model.reward_manager=dapo"),
        (
            ["reward_model.reward_manager=dapo", "reward_model.overlong_buffer.enable=true"],
            r"overlong_buffer.len=0 must be in \(0, 8\]",
        ),
        (["reward_model.enable=true", "reward_model.model.path=x", "reward_model.reward_manager=dapo"], "enable=false"),
    ],
)
def test_dapo_settings_that_cannot_work_are_refused(overrides, message):
    with pytest.raises(ValueError, match=message):
        validate(apply_overrides(Config(), overrides))


def test_verls_dapo_keys_are_refppos():
    line = [
        "algorithm.filter_groups.enable=True",
        "algorithm.filter_groups.metric=acc",
        "algorithm.filter_groups.max_num_gen_batches=10",
        "algorithm.filter_groups.max_inflight_gen_batches=2",
        "reward.reward_manager.name=dapo",
        "+reward.reward_kwargs.overlong_buffer_cfg.enable=True",
        "+reward.reward_kwargs.overlong_buffer_cfg.len=4",
        "+reward.reward_kwargs.overlong_buffer_cfg.penalty_factor=1.0",
        "+reward.reward_kwargs.overlong_buffer_cfg.log=False",
        "+reward.reward_kwargs.max_resp_len=8",
    ]
    overrides, notes = translate(line)
    config = validate(apply_overrides(Config(), overrides))
    assert config.algorithm.filter_groups.max_num_gen_batches == 10 and config.reward_model.reward_manager == "dapo"
    assert config.reward_model.overlong_buffer.len == 4 and config.reward_model.overlong_buffer.penalty_factor == 1.0
    assert config.reward_model.max_resp_len == 8
    assert len(notes) == 1 and "max_inflight_gen_batches=2 is a setting of verl's engine" in notes[0]


def test_dynamic_sampling_runs_on_one_process_only():
    config = validate(apply_overrides(Config(), DAPO))
    world = World(rank=0, size=2, distributed=True)
    with pytest.raises(ValueError, match="algorithm.filter_groups.enable is not available with FSDP2"):
        check_world(config, world)


def test_print_verl_gives_dapos_keys_as_verl_reads_them():
    """``--print-verl`` spells the reward manager's keyword arguments with Hydra's "+" (verl's
    config file lacks them) and gives max_resp_len, which verl's DAPO manager needs; the line reads
    back into the same settings."""
    from refppo.settings.verl_map import verl_command

    dapo = [*DAPO, "reward_model.reward_manager=dapo", "reward_model.overlong_buffer.enable=true"]
    config = validate(
        apply_overrides(Config(), [*dapo, "reward_model.overlong_buffer.len=2", "trainer.critic_warmup=0"])
    )
    text = verl_command(config)
    args = [ln.strip().rstrip(" \\") for ln in text.splitlines()[1:] if not ln.startswith("#")]
    assert "+reward.reward_kwargs.overlong_buffer_cfg.len=2" in args and "+reward.reward_kwargs.max_resp_len=8" in args
    assert "algorithm.filter_groups.metric=acc" in args and "reward.reward_manager.name=dapo" in args
    overrides, _ = translate([a for a in args if not a.startswith("trainer.total_epochs")])
    back = validate(apply_overrides(Config(), overrides))
    assert verl_command(back) == text
