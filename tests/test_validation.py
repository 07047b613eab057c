"""Validation's metrics (refppo.training.validation) against plain references written from verl 0.9's
``process_validation_metrics``, ``_val_metrics_update`` and ``_maybe_log_val_generations``."""

import itertools
import json
import random
from collections import defaultdict

import numpy as np
import pytest
from test_cli import QUICK_PPO, TINY

from refppo.runs.cli import main
from refppo.runs.folder import Resume, RunFolder
from refppo.settings.config import Config, apply_overrides
from refppo.settings.overrides import command_settings
from refppo.settings.validate import validate
from refppo.training.validation import chosen_generations, pass_at_k, subset_sizes, validation_metrics


def verl_sizes(n):
    """verl's gen_ns, as a loop: 2, 4, ... while below n, then n (none for one response)."""
    if n <= 1:
        return []
    sizes, k = [], 2
    while k < n:
        sizes.append(k)
        k *= 2
    return sizes + [n]


def verl_majority(values, answers):
    """verl's calc_maj_val: the answers counted in order of first appearance, the first one with the
    top count wins, and its first value is returned."""
    votes = {}
    for value, answer in zip(values, answers):
        votes.setdefault(answer, []).append(value)
    best = None
    for answer, vals in votes.items():
        if best is None or len(vals) > len(votes[best]):
            best = answer
    return votes[best][0]


def verl_bootstrap(data, size, reduce_fn):
    """verl's bootstrap_metric for one function: the global generator seeded with 42, 1000 subsets
    drawn with replacement, the function applied to each, then (mean, population std)."""
    np.random.seed(42)
    idx = np.random.choice(len(data), size=(1000, size), replace=True)
    results = [float(reduce_fn([data[i] for i in row])) for row in idx]
    return sum(results) / len(results), float(np.sqrt(np.mean((np.array(results) - np.mean(results)) ** 2)))


def verl_reference(sources, uids, variables, answers):
    """verl's metrics, one prompt and one variable at a time, in float64 Python."""
    grouped = defaultdict(lambda: defaultdict(list))
    for i, (s, u) in enumerate(zip(sources, uids)):
        grouped[s][u].append(i)
    out = {}
    for source, prompts in grouped.items():
        core = "acc" if "acc" in variables else "reward"
        for name, values in variables.items():
            per_metric = defaultdict(list)
            for rows in prompts.values():
                v = [values[i] for i in rows]
                n = len(v)
                m = {f"mean@{n}": sum(v) / n}
                if n > 1:
                    m[f"std@{n}"] = (sum((x - sum(v) / n) ** 2 for x in v) / n) ** 0.5
                for k in verl_sizes(n):
                    m[f"best@{k}/mean"], m[f"best@{k}/std"] = verl_bootstrap(v, k, max)
                    m[f"worst@{k}/mean"], m[f"worst@{k}/std"] = verl_bootstrap(v, k, min)
                    if answers is not None:
                        pairs = list(zip(v, [answers[i] for i in rows]))
                        fn = lambda sample: verl_majority([p[0] for p in sample], [p[1] for p in sample])  # noqa: E731
                        m[f"maj@{k}/mean"], m[f"maj@{k}/std"] = verl_bootstrap(pairs, k, fn)
                for key, value in m.items():
                    per_metric[key].append(value)
            n_max = max(int(key.split("@")[-1].split("/")[0]) for key in per_metric)
            for key, vals in per_metric.items():
                core_metric = name == core and key.split("@")[0] in ("mean", "maj", "best") and f"@{n_max}" in key
                out[f"{'val-core' if core_metric else 'val-aux'}/{source}/{name}/{key}"] = sum(vals) / len(vals)
    return out


def random_validation(seed, binary=False, with_acc=False):
    rng = random.Random(seed)
    sources, uids, answers = [], [], []
    for p in range(rng.randint(1, 6)):
        source = rng.choice(["gsm8k", "math"])
        n = rng.choice([1, 3, 4, 5, 8])  # verl repeats every prompt n times; a source may mix n here
        for _ in range(n):
            sources.append(source)
            uids.append(f"uid{p}")
            answers.append(rng.choice("AB C"))
    m = len(sources)
    reward = [float(rng.random() < 0.5) if binary else rng.gauss(0, 1) for _ in range(m)]
    variables = {"reward": reward, "gold": [rng.uniform(-1, 1) for _ in range(m)]}
    if with_acc:
        variables["acc"] = [float(rng.random() < 0.3) for _ in range(m)]
    return sources, uids, variables, answers


@pytest.mark.parametrize("seed", range(8))
@pytest.mark.parametrize("with_answers", [False, True])
def test_validation_metrics_equal_verls(seed, with_answers):
    sources, uids, variables, answers = random_validation(seed, binary=seed % 2 == 0, with_acc=seed % 3 == 0)
    answers = answers if with_answers else None
    ours = validation_metrics(sources, uids, variables, answers)
    reference = verl_reference(sources, uids, variables, answers)
    assert {k: v for k, v in ours.items() if "/pass@" not in k} == pytest.approx(reference, rel=1e-12, abs=1e-12)


def test_pass_at_k_counts_the_subsets_that_hold_a_pass():
    """Unbiased pass@k: the share of the k-subsets of n responses with at least one pass."""
    for n in range(1, 8):
        for c in range(n + 1):
            passed = [1] * c + [0] * (n - c)
            for k in range(1, n + 1):
                subsets = list(itertools.combinations(passed, k))
                assert pass_at_k(n, c, k) == pytest.approx(sum(any(s) for s in subsets) / len(subsets), abs=1e-15)


def test_pass_at_k_is_logged_for_zero_one_variables_only():
    sources, uids = ["t"] * 8, [0] * 4 + [1] * 4
    reward = [1.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0]
    gold = [0.5, 1.0, 0.0, 0.0, 1.0, 0.0, 0.0, 0.0]  # mostly 0 or 1
    out = validation_metrics(sources, uids, {"reward": reward, "gold": gold})
    assert out["val-aux/t/reward/pass@1"] == out["val-core/t/reward/mean@4"] == 1 / 8
    assert out["val-aux/t/reward/pass@2"] == pytest.approx((1 - 3 / 6) / 2)  # prompt 0: 1 - C(3,2)/C(4,2)
    # verl's _val_metrics_update (verl/trainer/ppo/ray_trainer.py) makes val-core only of mean, maj
    # and best: pass@k, refppo's own, is auxiliary at every k
    assert out["val-aux/t/reward/pass@4"] == 0.5
    assert not [k for k in out if k.startswith("val-core") and "/pass@" in k]
    assert not [k for k in out if "gold/pass" in k], "0.5 is no pass or fail"


def test_subset_sizes_are_verls():
    assert [subset_sizes(n) for n in range(1, 40)] == [verl_sizes(n) for n in range(1, 40)]


def test_chosen_generations_are_verls():
    rng = random.Random(0)
    inputs = [rng.choice("abcdef") for _ in range(20)]
    outputs, scores = [f"o{i}" for i in range(20)], [float(i) for i in range(20)]
    samples = sorted(zip(inputs, outputs, scores), key=lambda x: x[0])
    rs = np.random.RandomState(42)
    rs.shuffle(samples)
    expected = [{"input": i, "output": o, "score": s} for i, o, s in samples[:5]]
    assert chosen_generations(inputs, outputs, scores, 5) == expected


def test_val_kwargs_are_read_whatever_do_sample_says_and_temperature_0_is_greedy():
    """verl 0.9's ``AgentLoopWorkerTQ.generate_sequences`` and ``_run_prompt``
    (``verl/trainer/ppo/v1/agent_loop_tq.py``) pass ``val_kwargs``' temperature, top_p and top_k to
    the engine and repeat each prompt ``val_kwargs.n`` times, never reading ``do_sample``; the
    engine decodes greedily at temperature 0."""
    config, notes = command_settings("ppo", ["rollout.val_kwargs.n=4"])
    assert (config.rollout.val_kwargs.temperature, config.rollout.val_kwargs.n) == (0, 4)
    assert any("decodes greedily" in note and "4 responses" in note for note in notes), notes
    config, notes = command_settings(
        "ppo", ["rollout.val_kwargs.do_sample=false", "rollout.val_kwargs.temperature=0.7"]
    )
    assert config.rollout.val_kwargs.temperature == 0.7 and not any("are the same" in note for note in notes)
    assert any(n.startswith("rollout.val_kwargs.do_sample=false is not read") for n in notes), notes


@pytest.mark.parametrize("key", ["rollout.temperature", "rollout.val_kwargs.temperature"])
def test_a_temperature_below_the_float32_floor_is_refused(key):
    base = Config()
    with pytest.raises(ValueError, match=rf"{key}=1e-300 is outside its valid range (0 or )?\[1e-6, inf\)"):
        validate(apply_overrides(base, [f"{key}=1e-300"]))
    validate(apply_overrides(base, [f"{key}=1e-6"]))


@pytest.mark.parametrize(
    "overrides, needs",
    [
        (["rollout.val_kwargs.top_k=4"], r"rollout.val_kwargs.temperature > 0 \(0 decodes greedily\)"),
        (
            ["trainer.test_freq=-1", "trainer.val_before_train=false", "rollout.val_kwargs.n=2"],
            r"trainer.test_freq > 0 or trainer.val_before_train=true",
        ),
        (
            ["trainer.test_freq=-1", "trainer.val_before_train=false", "trainer.log_val_generations=4"],
            r"trainer.test_freq > 0 or trainer.val_before_train=true",
        ),
    ],
)
def test_val_kwargs_unread_are_refused(overrides, needs):
    with pytest.raises(ValueError, match=needs):
        validate(apply_overrides(Config(), overrides))


@pytest.fixture(scope="module")
def sft_model(tmp_path_factory):
    out = tmp_path_factory.mktemp("runs") / "sft"
    assert main(["sft", f"trainer.output_dir={out}", "sft.steps=20", "sft.batch_size=16", *TINY]) == 0
    return out / "model"


def test_multi_sample_validation_in_a_run(sft_model, tmp_path):
    """With val_kwargs sampling 3 responses to each of 8 prompts, mean@3 is the mean of the 24
    logged samples, the arithmetic answers vote (maj@3) and pass@3 is logged; greedy val/score stays."""
    out = tmp_path / "ppo"
    sampling = ["rollout.val_kwargs.n=3", "rollout.val_kwargs.temperature=1"]
    args = [f"model.path={sft_model}", f"trainer.output_dir={out}", *QUICK_PPO, *sampling]
    assert main(["ppo", *args, "trainer.log_val_generations=100"]) == 0
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    generations = [json.loads(line) for line in (out / "val_generations.jsonl").read_text().splitlines()]
    for step in (0, 1, 2):
        mine = [g for g in generations if g["step"] == step]
        assert len(mine) == 24 and {g["input"] for g in mine} == {g["input"] for g in generations}
        row = next(r for r in rows if r["step"] == step and "val/score" in r)
        mean = sum(g["score"] for g in mine) / 24
        assert row["val-core/arithmetic/acc/mean@3"] == pytest.approx(mean, abs=1e-12)
        assert {"val-core/arithmetic/acc/maj@3/mean", "val-aux/arithmetic/acc/pass@3"} <= set(row)
        assert row["val-core/arithmetic/acc/best@3/mean"] >= row["val-core/arithmetic/acc/mean@3"]


def test_greedy_validation_is_verls_mean_at_one(sft_model, tmp_path):
    """verl's reward managers keep a plain score as ``acc`` too (``NaiveRewardManager``), and
    ``_val_metrics_update`` (``verl/trainer/ppo/v1/trainer_base.py``) makes ``acc`` the core
    variable when there is one: the arithmetic task's score is core as ``acc``, ``reward`` aux."""
    out = tmp_path / "ppo"
    assert main(["ppo", f"model.path={sft_model}", f"trainer.output_dir={out}", *QUICK_PPO]) == 0
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    for row in (r for r in rows if "val/score" in r):
        assert row["val-core/arithmetic/acc/mean@1"] == pytest.approx(row["val/score"], abs=1e-7)
        assert row["val-aux/arithmetic/reward/mean@1"] == row["val-core/arithmetic/acc/mean@1"]
        assert "val-core/arithmetic/reward/mean@1" not in row
    assert not (out / "val_generations.jsonl").exists(), "trainer.log_val_generations=0 writes none"


def test_a_resume_drops_the_samples_of_steps_after_its_checkpoint(tmp_path):
    folder = tmp_path / "run"
    folder.mkdir()
    lines = [json.dumps({"step": s, "input": "1+1=", "output": "2", "score": 1.0}) for s in (0, 1, 2, 3)]
    (folder / "val_generations.jsonl").write_text("\n".join(lines) + "\n")
    resume = Resume(step=2, state={}, metrics=[], notes=[], folder=folder / "checkpoints" / "step_000002")
    RunFolder(folder, Config(), resume=resume)
    kept = [json.loads(line)["step"] for line in (folder / "val_generations.jsonl").read_text().splitlines()]
    assert kept == [0, 1, 2]


def test_val_kwargs_sampling_at_temperature_0_is_greedy(sft_model, tmp_path):
    out = tmp_path / "ppo"
    sampling = ["rollout.val_kwargs.n=2"]  # verl's temperature, 0
    assert main(["ppo", f"model.path={sft_model}", f"trainer.output_dir={out}", *QUICK_PPO, *sampling]) == 0
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    validated = [r for r in rows if "val/score" in r]
    assert validated
    for row in validated:
        assert row["val-core/arithmetic/acc/mean@2"] == pytest.approx(row["val/score"], abs=1e-7)
        assert row["val-aux/arithmetic/acc/std@2"] == 0


def test_val_kwargs_sampling_settings_are_used(sft_model, tmp_path):
    """top_k=1 leaves one token to sample: the n samples are the greedy response, so mean@2 is
    val/score (a pass that ignored val_kwargs would sample at the rollout's top_k=-1)."""
    out = tmp_path / "ppo"
    sampling = ["rollout.val_kwargs.n=2", "rollout.val_kwargs.temperature=3"]
    args = [f"model.path={sft_model}", f"trainer.output_dir={out}", *QUICK_PPO, *sampling, "rollout.val_kwargs.top_k=1"]
    assert main(["ppo", *args, "trainer.log_val_generations=16"]) == 0
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    generations = [json.loads(line) for line in (out / "val_generations.jsonl").read_text().splitlines()]
    for row in (r for r in rows if "val/score" in r):
        assert row["val-core/arithmetic/acc/mean@2"] == pytest.approx(row["val/score"], abs=1e-7)
        assert row["val-aux/arithmetic/acc/std@2"] == 0
    outputs = defaultdict(set)
    for g in generations:
        outputs[g["step"], g["input"]].add(g["output"])
    assert all(len(o) == 1 for o in outputs.values()), "both samples of a prompt are its greedy response"


def test_maj_at_k_votes_on_the_answers_a_reward_function_parses():
    """verl's math scorers return ``pred``, the answer parsed from the response, and
    ``process_validation_metrics`` votes on it (maj@k) for every variable, ``acc`` among them;
    without the task's own answers, refppo's validation takes the reward function's. Against verl's
    metrics from the val_kwargs pass's responses, as the reward function saw them."""
    from _trainers import make_trainer

    from refppo.training.validation import held_out_metrics

    calls = []

    def parsed(prompts, responses, records):
        calls.append(list(responses))
        preds = [r[:1] for r in responses]  # the answer: the first character
        return {"score": [float(p == "7") for p in preds], "acc": [float(p == "7") for p in preds], "pred": preds}

    n = 4
    trainer = make_trainer(["rollout.val_kwargs.n=4", "rollout.val_kwargs.temperature=1.0"], reward_fn=parsed)
    metrics, _ = held_out_metrics(trainer)
    responses = calls[-1]  # the val_kwargs pass, n responses to each held-out prompt
    count = len(trainer.val_records)
    assert len(responses) == count * n
    preds = [r[:1] for r in responses]
    assert 1 < len(set(preds)) < count * n, "a vacuous check: every answer the same, or all different"
    acc = [float(p == "7") for p in preds]
    uids = [i for i in range(count) for _ in range(n)]
    variables = {"reward": acc, "score": acc, "acc": acc}
    reference = verl_reference(["arithmetic"] * (count * n), uids, variables, preds)
    voted = {k: v for k, v in metrics.items() if "/maj@" in k}
    assert voted and voted == pytest.approx({k: v for k, v in reference.items() if "/maj@" in k}, abs=1e-12)
    assert "val-core/arithmetic/acc/maj@4/mean" in voted
