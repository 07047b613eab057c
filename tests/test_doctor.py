"""refppo doctor: each failure signature found on a run that has it, and only there."""

import json

import pytest

from refppo.runs.cli import main
from refppo.runs.doctor import SIGNATURES, diagnose, diagnose_run
from refppo.settings.config import Config, apply_overrides, config_to_dict

STEPS = 48


def healthy_rows():
    """What appendix A's healthy run logs, in round numbers (second-half means)."""
    return [
        {
            "step": s,
            "actor/pg_clipfrac": 0.004,
            "actor/entropy": 0.3,
            "critic/vf_explained_var": 0.07,
            "critic/vf_clipfrac": 0.0,
            "training/rollout_probs_diff_mean": 5e-8,
            "response_length/clip_ratio": 0.0,
            "actor/reward_kl_penalty": 0.05,
        }
        for s in range(1, STEPS + 1)
    ]


def with_late(key, value, after=STEPS // 2):
    rows = healthy_rows()
    for r in rows:
        if r["step"] > after:
            r[key] = value
    return rows


ADAPTIVE = ["algorithm.use_kl_in_reward=true", "algorithm.kl_ctrl.type=adaptive", "algorithm.kl_ctrl.target_kl=0.1"]
CASES = {  # name -> (rows, settings)
    "the clip fraction saturates": (with_late("actor/pg_clipfrac", 0.09), []),
    "the critic lags": (with_late("critic/vf_explained_var", -0.9), []),
    "the value clip binds": (with_late("critic/vf_clipfrac", 0.4), []),
    "the sampler and the trainer disagree": (with_late("training/rollout_probs_diff_mean", 0.05, after=0), []),
    "the entropy collapses": (with_late("actor/entropy", 0.02), []),
    "responses stuck at the length limit": (with_late("response_length/clip_ratio", 0.6), []),
    "the KL runs away from its target": (with_late("actor/reward_kl_penalty", 0.5), ADAPTIVE),
}


def config(settings=()):
    return apply_overrides(Config(), list(settings))


def test_a_healthy_run_is_clean():
    assert diagnose(healthy_rows(), config(ADAPTIVE)) == []


def test_every_signature_has_a_case():
    assert len(CASES) == len(SIGNATURES)


@pytest.mark.parametrize("name", list(CASES))
def test_each_signature_is_found_alone_with_its_section(name):
    rows, settings = CASES[name]
    found = diagnose(rows, config(settings))
    assert [f.name for f in found] == [name]
    assert found[0].section and str(found[0]).startswith(name + ": ")


def test_a_start_up_transient_is_not_a_finding():
    rows = healthy_rows()
    for r in rows[: STEPS // 2]:  # the first half: a critic still learning, a clip fraction settling
        r["critic/vf_explained_var"], r["actor/pg_clipfrac"], r["critic/vf_clipfrac"] = -3.0, 0.2, 0.5
    assert diagnose(rows, config()) == []


def test_the_critic_warm_up_is_not_judged():
    rows = with_late("critic/vf_explained_var", -0.9, after=STEPS // 2)
    for r in rows:
        if r["step"] > 40:
            r["critic/vf_explained_var"] = 0.1
    assert diagnose(rows, config(["trainer.critic_warmup=41"])) == []
    assert [f.name for f in diagnose(rows, config(["trainer.critic_warmup=0"]))] == ["the critic lags"]


def test_the_kl_target_is_read_only_with_a_controller_that_has_one():
    rows, _ = CASES["the KL runs away from its target"]
    assert diagnose(rows, config(["algorithm.use_kl_in_reward=true", "algorithm.kl_ctrl.type=fixed"])) == []
    assert diagnose(rows, config()) == [], "no KL in the reward"


def test_drift_in_bypass_mode_names_the_first_epochs_ratio():
    rows, _ = CASES["the sampler and the trainer disagree"]
    (finding,) = diagnose(rows, config(["algorithm.rollout_correction.bypass_mode=true"]))
    assert "first epoch's ratio is then not 1" in finding.message


def write_run(folder, rows, settings=()):
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(config_to_dict(config(settings))))
    (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return folder


def test_the_command(tmp_path, capsys):
    good = write_run(tmp_path / "good", healthy_rows())
    bad = write_run(tmp_path / "bad", CASES["the value clip binds"][0])
    assert main(["doctor", str(good)]) == 0
    assert f"run {good}: no known failure signature" in capsys.readouterr().out
    assert main(["doctor", str(good), str(bad)]) == 1
    out = capsys.readouterr().out
    assert f"run {bad}: 1 known failure signature(s)\n  - the value clip binds: critic/vf_clipfrac 0.4" in out
    assert diagnose_run(bad)[0].name == "the value clip binds"
    assert main(["doctor"]) == 2
    with pytest.raises(ValueError, match="is not a refppo run folder"):
        main(["doctor", str(tmp_path)])
    sft = write_run(tmp_path / "sft", [{"step": 1, "sft/loss": 2.0, "sft/lr": 1e-3}, {"step": 1, "val/score": 0.5}])
    with pytest.raises(ValueError, match="sft is an SFT run: refppo doctor reads the failure signatures of refppo ppo"):
        main(["doctor", str(sft)])
    (bad / "metrics.jsonl").write_text('{"step": 1}\n[1, 2]\n')
    with pytest.raises(ValueError, match="metrics.jsonl:2"):
        main(["doctor", str(bad)])
