"""Run folders never lose work (refppo.runs.folder): resume from the newest checkpoint that loads,
torn logs, changed settings, a full disk, and SIGKILLs during training."""

import errno
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from refppo.runs.cli import main
from refppo.runs.folder import RunFolder, check_resume
from refppo.settings.config import Config, apply_overrides
from refppo.training.checkpoint import MODELS, STATE_FILE, load_models, save_models


def _write_checkpoint(folder, step):
    """A checkpoint as PPOTrainer.save_checkpoint writes one: the trainer state and the models'
    torch.distributed.checkpoint (here one small tensor)."""
    torch.save({"step": step}, folder / STATE_FILE)
    model = torch.nn.Linear(2, 1)
    save_models(folder, {"model": (model, torch.optim.SGD(model.parameters(), lr=0.1))})


def test_saved_models_load_with_their_optimisers_or_alone(tmp_path):
    torch.manual_seed(0)
    model, fresh, alone = (torch.nn.Linear(3, 2) for _ in range(3))
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.ones(1, 3)).sum().backward()
    optimizer.step()
    save_models(tmp_path, {"actor": (model, optimizer)})
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=0.1)
    load_models(tmp_path, {"actor": (fresh, fresh_opt)})
    load_models(tmp_path, {"actor": (alone, None)})  # the weights only, as chapter 8 reads a checkpoint
    for loaded in (fresh, alone):
        assert all(torch.equal(a, b) for a, b in zip(loaded.parameters(), model.parameters()))
    moments = [fresh_opt.state[p]["exp_avg_sq"] for p in fresh.parameters()]
    assert all(torch.equal(a, optimizer.state[p]["exp_avg_sq"]) for a, p in zip(moments, model.parameters()))


def _saved_run(path, steps=(2, 4, 6)):
    """A run folder with a metrics line per step (0 to the last) and a checkpoint at ``steps``, its
    run ended (the folder's lock let go)."""
    run = RunFolder(path, Config())
    for step in range(max(steps) + 1):
        run.log(step, {"score": float(step)})
        if step in steps:
            run.save_checkpoint(step, lambda folder, step=step: _write_checkpoint(folder, step))
    run.close()
    return run


def _rewrite_config(path, edit):
    """Change a run folder's config.json as an older refppo would have written it: ``edit(saved)``
    changes the loaded dict in place."""
    file = Path(path) / "config.json"
    saved = json.loads(file.read_text())
    edit(saved)
    file.write_text(json.dumps(saved))


def _snapshot(path):
    return {p.relative_to(path): p.read_bytes() for p in sorted(Path(path).rglob("*")) if p.is_file()}


def _steps(path):
    return [json.loads(line)["step"] for line in (Path(path) / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("damage", ["truncated", "empty", "missing", "models missing", "models metadata torn"])
def test_resume_falls_back_to_the_newest_checkpoint_that_loads(tmp_path, damage):
    run = _saved_run(tmp_path / "r")
    newest = run.checkpoint_dir(6) / STATE_FILE
    models = run.checkpoint_dir(6) / MODELS
    if damage == "models missing":
        shutil.rmtree(models)
    elif damage == "models metadata torn":
        (models / ".metadata").write_bytes((models / ".metadata").read_bytes()[:10])
    elif damage == "truncated":
        newest.write_bytes(newest.read_bytes()[:20])
    elif damage == "empty":
        newest.write_bytes(b"")
    else:
        newest.unlink()
    (tmp_path / "r" / "latest").write_text("garbage")  # never trusted
    resume = check_resume(tmp_path / "r", Config())
    assert resume.step == 4 and resume.state == {"step": 4}
    assert "step_000006 does not load" in resume.notes[0]
    resumed = RunFolder(tmp_path / "r", Config(), resume)
    assert _steps(tmp_path / "r") == [0, 1, 2, 3, 4]  # the lines past the checkpoint are dropped
    damaged = _snapshot(run.checkpoint_dir(6))
    resumed.save_checkpoint(6, lambda folder: _write_checkpoint(folder, 6))
    # The checkpoint this run did not write is kept beside the new one, untouched.
    assert _snapshot(run.checkpoint_dir(6).with_name("step_000006.replaced")) == damaged
    assert torch.load(run.checkpoint_dir(6) / STATE_FILE) == {"step": 6}


def test_a_torn_last_log_line_is_dropped_and_other_damage_refused(tmp_path):
    _saved_run(tmp_path / "r")
    log = tmp_path / "r" / "metrics.jsonl"
    log.write_text(log.read_text() + '{"step": 7, "sco')
    resume = check_resume(tmp_path / "r", Config())
    assert resume.step == 6 and "torn last line" in resume.notes[0]
    RunFolder(tmp_path / "r", Config(), resume)
    assert _steps(tmp_path / "r") == list(range(7))
    lines = log.read_text().splitlines()
    log.write_text("\n".join([lines[0], "{not json", *lines[1:]]) + "\n")
    before = _snapshot(tmp_path / "r")
    with pytest.raises(ValueError, match="metrics.jsonl:2 is not a JSON line"):
        check_resume(tmp_path / "r", Config())
    assert _snapshot(tmp_path / "r") == before


@pytest.mark.parametrize(
    "damage, message",
    [
        ("fewer steps", "its checkpoint is at step 6, beyond trainer.total_training_steps=5"),
        ("log missing", "its metrics.jsonl is missing, so the log of steps 1-6 would be lost"),
        ("line without step", r"metrics.jsonl:2 is not a metrics record \(a JSON object with an integer step\)"),
        ("line not an object", r"metrics.jsonl:3 is not a metrics record"),
        ("config a list", "its config.json holds a list, not settings"),
    ],
)
def test_a_resume_that_would_lose_or_misread_work_is_refused_before_any_write(tmp_path, damage, message):
    _saved_run(tmp_path / "r")
    log, lines = tmp_path / "r" / "metrics.jsonl", (tmp_path / "r" / "metrics.jsonl").read_text().splitlines()
    config = Config()
    if damage == "fewer steps":
        config = apply_overrides(Config(), ["trainer.total_training_steps=5"])
    elif damage == "log missing":
        log.unlink()
    elif damage == "line without step":
        log.write_text("\n".join([lines[0], '{"score": 1.0}', *lines[1:]]) + "\n")
    elif damage == "line not an object":
        log.write_text("\n".join([*lines[:2], "[1, 2]", *lines[2:]]) + "\n")
    else:
        (tmp_path / "r" / "config.json").write_text("[]")
    before = _snapshot(tmp_path / "r")
    with pytest.raises(ValueError, match=message):
        check_resume(tmp_path / "r", config)
    assert _snapshot(tmp_path / "r") == before


def test_a_resume_with_changed_settings_is_refused_before_any_write(tmp_path):
    _saved_run(tmp_path / "r")
    before = _snapshot(tmp_path / "r")
    changed = apply_overrides(
        Config(), ["actor.optim.lr=1e-3", "model.path=/elsewhere", "trainer.total_training_steps=9"]
    )
    with pytest.raises(
        ValueError, match=r"changed: actor.optim.lr: 5e-05 -> 0.001; model.path: None -> '/elsewhere'\. Start a new"
    ):
        check_resume(tmp_path / "r", changed)
    assert _snapshot(tmp_path / "r") == before  # config.json and the log untouched
    longer = apply_overrides(Config(), ["trainer.total_training_steps=9", "actor.ppo_micro_batch_size_per_gpu=4"])
    RunFolder(tmp_path / "r", longer, check_resume(tmp_path / "r", longer))
    assert json.loads((tmp_path / "r" / "config.json").read_text())["trainer"]["total_training_steps"] == 9


def test_a_resume_may_turn_checkpointing_on_in_a_run_saved_before_the_setting_existed(tmp_path):
    """Activation checkpointing changes memory and time, not the numbers: a resume may turn it on,
    also in a run folder whose config.json predates the two settings."""
    _saved_run(tmp_path / "r")

    def predate(saved):
        del saved["model"]["enable_gradient_checkpointing"], saved["critic"]["model"]["enable_gradient_checkpointing"]

    _rewrite_config(tmp_path / "r", predate)
    on = apply_overrides(
        Config(), ["model.enable_gradient_checkpointing=true", "critic.model.enable_gradient_checkpointing=true"]
    )
    assert check_resume(tmp_path / "r", on).step == 6


def test_a_run_saved_before_a_setting_existed_resumes_at_its_default_and_says_so(tmp_path):
    """A setting newer than the run's config.json (here rollout.logprobs_mode): the run had its
    default, so a resume at the default goes ahead with a note, and one that sets another value
    is refused as a change."""
    _saved_run(tmp_path / "r")
    _rewrite_config(tmp_path / "r", lambda saved: saved["rollout"].pop("logprobs_mode"))
    resumed = check_resume(tmp_path / "r", Config())
    assert resumed.step == 6
    assert any("rollout.logprobs_mode is newer than the run's config.json" in note for note in resumed.notes)
    raw = apply_overrides(Config(), ["rollout.logprobs_mode=raw_logprobs"])
    with pytest.raises(ValueError, match=r"changed: rollout.logprobs_mode: 'processed_logprobs' -> 'raw_logprobs'"):
        check_resume(tmp_path / "r", raw)


@pytest.mark.parametrize(
    "schedule",
    [["actor.optim.lr_scheduler_type=cosine"], ["actor.optim.lr_warmup_steps_ratio=0.1"]],
)
def test_a_longer_resume_is_refused_where_the_schedule_spans_the_run(tmp_path, schedule):
    """trainer.total_training_steps may change on a resume (a constant schedule continues the same
    run), but a cosine decay or a warm-up by ratio is laid out over the run's length: the steps
    already run followed the old length's, so a longer resume would match no run of either length."""
    saved = apply_overrides(Config(), schedule)
    run = RunFolder(tmp_path / "r", saved)
    run.log(0, {"score": 0.0})
    run.save_checkpoint(2, lambda folder: _write_checkpoint(folder, 2))
    before = _snapshot(tmp_path / "r")
    longer = apply_overrides(Config(), [*schedule, "trainer.total_training_steps=3000"])
    with pytest.raises(ValueError, match=r"trainer.total_training_steps: 1500 -> 3000 \(the schedule of actor.optim"):
        check_resume(tmp_path / "r", longer)
    assert _snapshot(tmp_path / "r") == before
    assert check_resume(tmp_path / "r", saved).step == 2  # the same length resumes


def test_a_second_process_in_a_run_folder_is_refused_before_it_writes(tmp_path):
    """A resume started while the run still trains would rewrite its log under it and move its new
    checkpoints aside: the folder's lock refuses the second writer before it writes anything, and
    once the first has ended (its lock let go) the resume goes ahead."""
    _saved_run(tmp_path / "r")
    first = RunFolder(tmp_path / "r", Config(), check_resume(tmp_path / "r", Config()))  # training again
    before = _snapshot(tmp_path / "r")
    with pytest.raises(FileExistsError, match="is in use by another refppo process"):
        RunFolder(tmp_path / "r", Config(), check_resume(tmp_path / "r", Config()))
    assert _snapshot(tmp_path / "r") == before
    first.close()
    RunFolder(tmp_path / "r", Config(), check_resume(tmp_path / "r", Config())).close()
    assert _steps(tmp_path / "r") == list(range(7))


def test_the_command_line_refuses_a_folder_in_use_before_it_loads_anything(tmp_path, capsys, monkeypatch):
    """The same lock, looked at with the other checks of the folder, so the refusal is one line
    before any model is loaded (here no model.path is given: the folder's check comes first)."""
    from refppo.runs import cli
    from refppo.runs.folder import hold_lock

    _saved_run(tmp_path / "r")
    held = hold_lock(tmp_path / "r")
    try:
        monkeypatch.setattr(
            "sys.argv", ["refppo", "ppo", f"trainer.output_dir={tmp_path / 'r'}", "trainer.resume=true"]
        )
        assert cli.entry() == 2
    finally:
        os.close(held)
    assert "refppo: error: run folder" in capsys.readouterr().err


def test_a_folder_name_the_file_system_refuses_is_named_in_the_refusal(tmp_path):
    """A name longer than the file system takes fails in pathlib's own check; the refusal names
    trainer.output_dir, so the command line says it in one line."""
    from refppo.runs.folder import check_writable

    with pytest.raises(OSError, match=r"^\[Errno \d+\] trainer.output_dir='.*\.\.\.: File name too long"):
        check_writable(tmp_path / ("x" * 300))
    assert list(tmp_path.iterdir()) == []


def test_a_folder_left_by_a_run_that_stopped_before_its_first_step_can_be_used_again(tmp_path):
    """A run that fails before step 0 (a reward function that raises) leaves only its config.json:
    nothing to keep or resume, so a new run may start there, and a resume starts afresh. A folder
    holding only some other config.json is still someone's, and refused."""
    from refppo.runs.folder import check_free

    RunFolder(tmp_path / "r", Config()).close()
    assert sorted(p.name for p in (tmp_path / "r").iterdir()) == ["config.json"]
    check_free(tmp_path / "r")
    assert check_resume(tmp_path / "r", Config()) is None
    RunFolder(tmp_path / "r", apply_overrides(Config(), ["actor.optim.lr=1e-3"])).close()
    assert json.loads((tmp_path / "r" / "config.json").read_text())["actor"]["optim"]["lr"] == 1e-3
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "config.json").write_text('{"learning_rate": 0.1}')
    with pytest.raises(FileExistsError, match="already holds a run"):
        check_free(tmp_path / "mine")


def test_a_resume_may_drop_a_setting_its_run_never_read(tmp_path):
    """A run saved before refppo refused ignored settings may hold one (here the KL controller's
    coefficient without KL in the reward); the resume, which must drop it, goes ahead. The same
    setting where it is read must stay the same."""
    _saved_run(tmp_path / "r")
    _rewrite_config(tmp_path / "r", lambda saved: saved["algorithm"]["kl_ctrl"].update(kl_coef=0.05))
    assert check_resume(tmp_path / "r", Config()).step == 6
    _rewrite_config(tmp_path / "r", lambda saved: saved["algorithm"].update(use_kl_in_reward=True))
    with pytest.raises(ValueError, match=r"changed: algorithm.use_kl_in_reward: True -> False\. Start"):
        check_resume(tmp_path / "r", Config())
    read = apply_overrides(Config(), ["algorithm.use_kl_in_reward=true"])
    with pytest.raises(ValueError, match=r"changed: algorithm.kl_ctrl.kl_coef: 0.05 -> 0.001\. Start a new"):
        check_resume(tmp_path / "r", read)


def test_a_run_saved_with_the_critics_old_explicit_default_resumes(tmp_path):
    """Until critic.loss_agg_mode defaulted to the actor's, a run saved "token-mean" there; with
    the actor at token-mean that is the same run, with another actor mode it is not."""
    _saved_run(tmp_path / "r")
    _rewrite_config(tmp_path / "r", lambda saved: saved["critic"].update(loss_agg_mode="token-mean"))
    assert check_resume(tmp_path / "r", Config()).step == 6
    other = apply_overrides(Config(), ["actor.loss_agg_mode=seq-mean-token-mean"])
    with pytest.raises(
        ValueError,
        match="changed: actor.loss_agg_mode: 'token-mean' -> 'seq-mean-token-mean'; "
        "critic.loss_agg_mode: 'token-mean' -> 'seq-mean-token-mean'",
    ):
        check_resume(tmp_path / "r", other)


def test_a_resume_without_a_checkpoint_is_refused_and_erases_nothing(tmp_path):
    run = RunFolder(tmp_path / "r", Config())
    run.log(0, {"val/score": 0.5})  # killed before its first checkpoint
    before = _snapshot(tmp_path / "r")
    with pytest.raises(ValueError, match="holds no checkpoint that loads .*none saved yet.*Nothing was changed"):
        check_resume(tmp_path / "r", Config())
    assert _snapshot(tmp_path / "r") == before
    assert check_resume(tmp_path / "empty", Config()) is None  # nothing there: a fresh start
    (tmp_path / "a_file").write_text("mine")
    with pytest.raises(NotADirectoryError, match="a_file is a file, not a folder"):
        main(["sft", f"trainer.output_dir={tmp_path / 'a_file'}"])
    with pytest.raises(NotADirectoryError, match="a_file is a file, not a folder"):
        main(["sft", f"trainer.output_dir={tmp_path / 'a_file' / 'run'}"])
    assert (tmp_path / "a_file").read_text() == "mine"
    with pytest.raises(ValueError, match=r"refppo sft does not read trainer.resume \(it saves no checkpoints\)"):
        main(["sft", "trainer.resume=true", f"trainer.output_dir={tmp_path / 'r'}"])
    assert _snapshot(tmp_path / "r") == before


def test_a_run_folder_that_cannot_be_written_is_refused_before_any_work(tmp_path, monkeypatch):
    import refppo.runs.folder

    run = _saved_run(tmp_path / "r")
    (tmp_path / "r" / "latest").unlink()
    (tmp_path / "r" / "latest").mkdir()
    before = _snapshot(tmp_path / "r")
    with pytest.raises(IsADirectoryError, match="its latest is a folder"):
        main(["ppo", "trainer.resume=true", f"trainer.output_dir={run.path}", f"model.path={tmp_path}"])
    assert _snapshot(tmp_path / "r") == before
    locked = tmp_path / "locked"
    locked.mkdir()
    real = os.access
    monkeypatch.setattr(refppo.runs.folder.os, "access", lambda p, mode: Path(p) != locked and real(p, mode))
    with pytest.raises(PermissionError, match=f"cannot write in {locked}"):
        main(["sft", f"trainer.output_dir={locked / 'new' / 'run'}"])
    assert list(locked.iterdir()) == []


def test_a_full_disk_keeps_the_last_good_checkpoint(tmp_path):
    run = _saved_run(tmp_path / "r", steps=(2,))

    def disk_full(folder):
        (folder / STATE_FILE).write_bytes(b"half")
        raise OSError(errno.ENOSPC, "No space left on device")

    with pytest.raises(
        OSError, match=r"no space left on the disk: writing checkpoint step_000003 failed .*\(step 2\) is intact"
    ):
        run.save_checkpoint(3, disk_full)
    assert sorted(os.listdir(tmp_path / "r" / "checkpoints")) == ["step_000002"]
    assert check_resume(tmp_path / "r", Config()).step == 2


def test_the_default_saves_periodically():
    assert 1 <= Config().trainer.save_freq <= 100


TINY = [
    "model.hidden_size=32",
    "model.num_hidden_layers=1",
    "model.num_attention_heads=2",
    "model.num_key_value_heads=1",
]
KILL_MID_SAVE = """
import os, signal, sys, torch
real = torch.save
def save(obj, f, *args, **kwargs):  # at step {step}: half a checkpoint file, then SIGKILL
    real(obj, f, *args, **kwargs)
    if isinstance(obj, dict) and obj.get("step") == {step}:
        os.truncate(f, os.path.getsize(f) // 2)
        os.kill(os.getpid(), signal.SIGKILL)
torch.save = save
from refppo.runs.cli import main
sys.exit(main(sys.argv[1:]))
"""


def test_sigkills_during_training_then_resume_give_the_uninterrupted_metrics(tmp_path):
    """SIGKILL mid-checkpoint-write (step 3) and at a random point after step 4; each resume
    continues from an intact checkpoint, and the final log equals an uninterrupted run's line
    for line (timings aside), with every checkpoint in place."""
    assert main(["sft", f"trainer.output_dir={tmp_path / 'sft'}", "sft.steps=3", "sft.batch_size=8", *TINY]) == 0
    args = [
        "ppo",
        f"model.path={tmp_path / 'sft' / 'model'}",
        "trainer.total_training_steps=7",
        "trainer.save_freq=1",
        "trainer.test_freq=3",
        "data.train_batch_size=8",
        "actor.ppo_mini_batch_size=4",
        "data.val_size=8",
        "data.max_response_length=4",
        "trainer.critic_warmup=0",
        "trainer.progress_bar=false",
    ]
    env = os.environ | {"OMP_NUM_THREADS": "1", "PYTHONPATH": str(Path(__file__).parents[1])}

    def start(out, *extra, script=("-m", "refppo")):
        return subprocess.Popen(
            [sys.executable, *script, *args, f"trainer.output_dir={out}", *extra],
            env=env,
            stderr=subprocess.PIPE,
            text=True,
        )

    whole = start(tmp_path / "whole")
    assert whole.wait() == 0, whole.stderr.read()

    out = tmp_path / "killed"
    (tmp_path / "kill.py").write_text(KILL_MID_SAVE.format(step=3))
    first = start(out, script=(str(tmp_path / "kill.py"),))
    assert first.wait() == -signal.SIGKILL
    assert (out / "latest").read_text() == "2" and (out / "checkpoints" / "step_000003.tmp").exists()

    second = start(out, "trainer.resume=true")
    while not (out / "metrics.jsonl").exists() or max(_steps(out), default=0) < 5:
        assert second.poll() is None, second.stderr.read()
        time.sleep(0.05)
    second.send_signal(signal.SIGKILL)
    second.wait()
    assert "resuming" in (err := second.stderr.read()) and "from step 2" in err, err

    third = start(out, "trainer.resume=true")
    assert third.wait() == 0, third.stderr.read()
    clean = lambda path: [  # noqa: E731
        {k: v for k, v in json.loads(line).items() if not k.startswith(("timing_s/", "timing_per_token_ms/", "perf/"))}
        for line in (path / "metrics.jsonl").read_text().splitlines()
    ]
    assert [m["step"] for m in clean(out)] == list(range(8))
    assert clean(out) == clean(tmp_path / "whole")
    for step in range(1, 8):
        assert torch.load(out / "checkpoints" / f"step_{step:06d}" / STATE_FILE, weights_only=False)["step"] == step


def test_the_summary_reports_the_gold_score_beside_the_trained_one(tmp_path):
    from refppo.runs.folder import summary

    run = RunFolder(tmp_path / "r", Config())
    for step, (score, gold) in enumerate([(0.1, 0.2), (0.5, 0.4), (0.9, 0.3)]):
        run.log(step, {"val/score": score, "val/gold": gold})
    printed = summary(tmp_path / "r")
    assert "val/score: first 0.1 (step 0), last 0.9 (step 2), best 0.9 (step 2)" in printed
    assert "val/gold: first 0.2 (step 0), last 0.3 (step 2), best 0.4 (step 1)" in printed
