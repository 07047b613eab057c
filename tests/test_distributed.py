"""Data-parallel runs (torchrun, FSDP2 on gloo): two processes equal one, step by step.

Each test launches ``torchrun --nproc_per_node 2 -m refppo ...`` in a subprocess on a tiny model,
and compares it with the one-process run of the same settings: the same samples, every logged
metric and the exported weights equal to float32 rounding (:data:`RTOL`, :data:`ATOL`).
"""

import json
import math
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from _tolerances import reordered
from safetensors.torch import load_file

from refppo.distributed import SINGLE, World, check_world
from refppo.settings.config import Config, apply_overrides
from refppo.settings.validate import validate

# Two processes sum their gradients and statistics in another order than one process does
# (tests/_tolerances.py, rule 1), and a run takes several Adam steps, which can turn that rounding,
# where a gradient nearly cancels (a rare token's embedding row), into a whole step of difference
# in that coordinate (rule 2). No bound from rounding alone holds after the first update, so these
# are a measured spread with a margin: one process with micro-batches of 2 rows instead of 1, which
# changes nothing but the order of the sums, differs from itself by 2e-3 of the embeddings'
# update (WEIGHT_RTOL is 5 times that), the other tensors by 1e-4 or less; metrics to RTOL
# relative or ATOL absolute (a whitened mean is 0 up to rounding). They held on AVX-512, AVX2 and
# ATen's portable kernels (CHANGELOG.md).
RTOL, ATOL, WEIGHT_RTOL = 1e-4, 1e-6, 1e-2
TIMEOUT_S = 240

# rollout_corr's gap metrics compare the sampler's log-prob of each token with the trainer's: one
# number computed twice, in other orders (rule 1: log-probs under 10 from a 32-wide hidden state and
# the 50-token vocabulary), so they measure rounding alone, and each process count rounds its own
# way. A token's gap is at most TOKEN_GAP; over a response of at most 12 tokens every gap metric is
# at most chi2_seq's e^(2 x 12 x TOKEN_GAP) - 1 (plus a mean's rounding), in each run: two runs' are
# within twice that of each other.
TOKEN_GAP = reordered(32 + 50) * 10
GAP_ATOL = 2 * (math.exp(2 * 12 * TOKEN_GAP) - 1 + reordered(64))
GAPS = tuple(
    f"rollout_corr/{name}"
    for name in (
        "kl",
        "k3_kl",
        "log_ppl_diff",
        "log_ppl_abs_diff",
        "log_ppl_diff_max",
        "log_ppl_diff_min",
        "chi2_token",
        "chi2_seq",
    )
)

REWARDS = '''
import os, signal, torch

CALLS = []


def score(prompts, responses, records):
    """A score that differs between most responses (so every advantage estimator has work), and
    does not favour long ones (so that responses keep ending at different steps)."""
    CALLS.append(1)
    if os.environ.get("RANK") == os.environ.get("DIE_RANK") and len(CALLS) == int(os.environ.get("DIE_CALL", 0)):
        os.kill(os.getpid(), signal.SIGKILL)  # a rank that dies mid-step, as an OOM kill would
    if os.environ.get("RANK") == os.environ.get("RAISE_RANK") and len(CALLS) == int(os.environ.get("RAISE_CALL", 0)):
        raise RuntimeError("the reward server went away")
    return torch.tensor([float(sum(map(ord, r)) % 7) / 4 for r in responses])
'''

COMMON = [
    "data.max_response_length=6",
    # held-out answers (each process's end at their own step) from the starting weights only
    # (val_before_train): after an update the two runs' weights differ by Adam's drift (rule 2), and
    # a sampled pass over hundreds of held-out prompts can meet a draw that falls in the gap (one
    # response of 800 on ATen's portable kernels, 3 steps in)
    "trainer.test_freq=-1",
    "trainer.progress_bar=false",
    "trainer.critic_warmup=0",
    "reward_model.reward_fn=rewards:score",
    "actor.optim.lr=3e-3",
]
GAE = [
    "algorithm.adv_estimator=gae",
    "algorithm.use_kl_in_reward=true",
    "algorithm.kl_ctrl.kl_coef=0.1",
    "data.train_batch_size=8",
    "data.max_response_length=12",  # 4 rows a process: some stop early
    "actor.ppo_mini_batch_size=4",  # 2 mini-batches
    "actor.ppo_micro_batch_size_per_gpu=1",  # 2 micro-batches on each process
    "actor.ppo_epochs=2",
    "critic.optim.lr=3e-3",
]
GRPO = [
    "algorithm.adv_estimator=grpo",
    "rollout.n=4",
    "actor.use_kl_loss=true",
    "actor.kl_loss_type=low_var_kl",
    "actor.kl_loss_coef=0.1",
    "data.train_batch_size=4",
    "actor.ppo_mini_batch_size=2",  # 8 rows: 2 mini-batches
    "actor.ppo_micro_batch_size_per_gpu=2",
]


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    """A folder holding a tiny SFT model (``model/``: 40 steps of ``refppo sft``, enough to end
    most answers with EOS after a few tokens, each row at its own step) and the reward module."""
    root = tmp_path_factory.mktemp("distributed")
    launch(root, "sft", ["model.hidden_size=32", "sft.steps=40", f"trainer.output_dir={root / 'sft'}"], 1)
    (root / "sft" / "model").rename(root / "model")
    (root / "rewards.py").write_text(REWARDS)
    return root


def launch(workdir, command, overrides, processes, env=None, check=True, torchrun=False):
    """Run ``refppo <command>`` in ``workdir`` with 1 process (python -m) or several (torchrun;
    also one with ``torchrun``). A key given twice in ``overrides`` takes its last value, as in
    Python (the command line refuses it)."""
    overrides = [f"{k}={v}" for k, v in dict(o.split("=", 1) for o in overrides).items()]
    if processes == 1 and not torchrun:
        head = [sys.executable, "-m", "refppo"]
    else:
        port = ["--master_port", str(_free_port())]
        head = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            *port,
            "--nproc_per_node",
            str(processes),
            "-m",
            "refppo",
        ]
    environment = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    done = subprocess.run(
        [*head, command, *overrides], cwd=workdir, env=environment, capture_output=True, text=True, timeout=TIMEOUT_S
    )
    if check and done.returncode != 0:
        raise AssertionError(f"refppo {command} on {processes} processes failed:\n{done.stdout}\n{done.stderr}")
    return done


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def metrics(folder):
    return [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]


def assert_same_metrics(got, expected):
    """Every logged number equal to the tolerance, timings aside."""
    assert [m["step"] for m in got] == [m["step"] for m in expected]
    for a, b in zip(got, expected):
        keys = {k for k in b if not k.startswith(("timing", "perf/"))}
        assert keys == {k for k in a if not k.startswith(("timing", "perf/"))}
        for key in sorted(keys):
            atol = GAP_ATOL if key in GAPS else ATOL
            assert a[key] == pytest.approx(b[key], rel=RTOL, abs=atol), f"step {b['step']}: {key}"


def assert_same_weights(got, expected, start=None):
    """Each tensor's update from ``start`` (a model folder; zero weights if None) equal to
    WEIGHT_RTOL of its norm."""
    a, b = (load_file(folder / "model.safetensors") for folder in (got, expected))
    w0 = {k: torch.zeros_like(v) for k, v in b.items()} if start is None else load_file(start / "model.safetensors")
    assert a.keys() == b.keys() == w0.keys()
    moved = 0
    for key in a:
        step = (b[key] - w0[key]).norm()
        assert (a[key] - b[key]).norm() <= WEIGHT_RTOL * step, key
        moved += bool(step > 0)
    assert moved > len(a) / 2, "a vacuous check: the weights hardly moved"


@pytest.mark.parametrize("estimator", ["gae", "grpo"])
@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-sum-norm"])
def test_two_processes_equal_one(workdir, estimator, mode):
    """PPO with GAE and KL in the reward, GRPO with KL in the loss: several mini- and micro-batches,
    two epochs; the same samples (the mean response length is logged), metrics and final weights.
    The critic's weights are checked through its metrics (values, value loss): only the actor is
    exported."""
    overrides = [*COMMON, *(GAE if estimator == "gae" else GRPO), f"actor.loss_agg_mode={mode}"]
    overrides += [f"model.path={workdir / 'model'}", "trainer.total_training_steps=3"]
    runs = {}
    for processes in (1, 2):
        out = workdir / f"{estimator}-{mode}-{processes}"
        launch(workdir, "ppo", [*overrides, f"trainer.output_dir={out}"], processes)
        runs[processes] = out
    one, two = metrics(runs[1]), metrics(runs[2])
    assert len(one) == 4  # validation at step 0, then 3 steps
    assert_same_metrics(two, one)
    assert max(m.get("critic/advantages/max", 0) for m in one) > 0.1, "a vacuous run: no advantage anywhere"
    assert_same_weights(runs[2] / "actor", runs[1] / "actor", workdir / "model")


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_torchrun_with_one_process_equals_the_plain_run(workdir, device):
    """``torchrun --nproc_per_node 1``: a process group (gloo, or NCCL on CUDA) and FSDP2 over one
    process. On a CPU the plain run's numbers. On CUDA FSDP2's bf16 parameters stand in for
    autocast's bf16 products, so a sampled token can differ wherever the two sets of logits
    straddle the sampler's draw, and from there the rollouts (and every training metric) part
    ways; the greedy validation of the same starting weights agrees but for near-ties, and the
    run stays finite."""
    overrides = [*COMMON, *GRPO, f"model.path={workdir / 'model'}", "trainer.total_training_steps=2"]
    overrides.append(f"trainer.device={device}")
    plain, launched = workdir / f"plain-{device}", workdir / f"torchrun-1-{device}"
    launch(workdir, "ppo", [*overrides, f"trainer.output_dir={plain}"], 1)
    launch(workdir, "ppo", [*overrides, f"trainer.output_dir={launched}"], 1, torchrun=True)
    if device == "cpu":
        assert_same_metrics(metrics(launched), metrics(plain))
        assert_same_weights(launched / "actor", plain / "actor", workdir / "model")
        return
    got, expected = metrics(launched), metrics(plain)
    assert [m["step"] for m in got] == [m["step"] for m in expected] == [0, 1, 2]
    # step 0: the greedy answers of the starting weights to data.val_size=200 prompts; a near-tie
    # flips one answer: its score (0 to 1.5) and its length (1 to 6 tokens)
    assert got[0]["val/score"] == pytest.approx(expected[0]["val/score"], abs=0.05)
    assert got[0]["val/response_length"] == pytest.approx(expected[0]["val/response_length"], abs=0.1)
    assert all(math.isfinite(v) for m in got for v in m.values() if isinstance(v, float))


@pytest.mark.parametrize(
    "command, overrides",
    [
        ("sft", ["model.hidden_size=32", "sft.steps=4", "sft.batch_size=8"]),
        ("rm", ["data.task=preference", "rm.steps=4", "rm.batch_size=8", "rm.lr=3e-3"]),
    ],
)
def test_sft_and_rm_on_two_processes_equal_one(workdir, command, overrides):
    overrides = [*overrides, "trainer.progress_bar=false"]
    if command == "rm":
        overrides.append(f"model.path={workdir / 'model'}")
    for processes in (1, 2):
        launch(workdir, command, [*overrides, f"trainer.output_dir={workdir / f'{command}-{processes}'}"], processes)
    assert_same_metrics(metrics(workdir / f"{command}-2"), metrics(workdir / f"{command}-1"))
    assert_same_weights(workdir / f"{command}-2" / "model", workdir / f"{command}-1" / "model")


def test_a_killed_rank_stops_the_run_and_two_processes_resume_on_one(workdir):
    """Rank 1 is killed in step 3 (its reward function's 5th call: two probes, then one a step): the
    run exits, its step-2 checkpoint loads, and one process resumes it to the same steps 3-4 as
    the uninterrupted run."""
    overrides = [
        *COMMON,
        *GAE,
        f"model.path={workdir / 'model'}",
        "trainer.total_training_steps=4",
        "trainer.save_freq=1",
        "trainer.test_freq=-1",  # one reward call a step
        "trainer.val_before_train=false",
    ]
    whole, broken = workdir / "whole", workdir / "broken"
    launch(workdir, "ppo", [*overrides, f"trainer.output_dir={whole}"], 2)
    started = time.monotonic()
    died = launch(
        workdir, "ppo", [*overrides, f"trainer.output_dir={broken}"], 2, {"DIE_RANK": "1", "DIE_CALL": "5"}, check=False
    )
    assert died.returncode != 0
    assert time.monotonic() - started < TIMEOUT_S / 2, "the surviving rank must not wait out a collective"
    assert "rank      : 1" in died.stderr and "SIGKILL" in died.stderr, died.stderr[-2000:]
    assert [m["step"] for m in metrics(broken)] == [1, 2]
    launch(workdir, "ppo", [*overrides, f"trainer.output_dir={broken}", "trainer.resume=true"], 1)
    assert_same_metrics(metrics(broken), metrics(whole))
    assert_same_weights(broken / "actor", whole / "actor", workdir / "model")


def test_a_rank_that_raises_is_named(workdir):
    overrides = [*COMMON, *GRPO, f"model.path={workdir / 'model'}", "trainer.total_training_steps=2"]
    failed = launch(
        workdir,
        "ppo",
        [*overrides, f"trainer.output_dir={workdir / 'raises'}"],
        2,
        {"RAISE_RANK": "1", "RAISE_CALL": "3"},
        check=False,
    )
    assert failed.returncode != 0
    line = "refppo: process 1 of 2 failed: RuntimeError: the reward server went away"
    assert line in failed.stderr.splitlines(), failed.stderr[-2000:]


@pytest.mark.parametrize(
    "overrides, problem",
    [
        (["data.train_batch_size=5", "actor.ppo_mini_batch_size=5"], "do not split evenly over 2 processes"),
        (["data.train_batch_size=4", "actor.ppo_mini_batch_size=1"], "does not split evenly over 2 processes"),
        (
            ["algorithm.adv_estimator=grpo", "rollout.n=3", "data.train_batch_size=4", "actor.ppo_mini_batch_size=1"],
            "the actor mini-batch of 3 rows",
        ),
        (["model.lora_rank=4"], "model.lora_rank is not available with FSDP2"),
        (["model.lora.rank=4"], "model.lora.rank is not available with FSDP2"),
        (["model.use_fused_kernels=true"], "model.use_fused_kernels is not available with FSDP2"),
        (["rollout.cuda_graphs=true"], "rollout.cuda_graphs is not available with FSDP2"),
        (["model.compile_layers=true"], "model.compile_layers is not available with FSDP2"),
        (["actor.use_dynamic_bsz=true"], "actor.use_dynamic_bsz is not available with FSDP2"),
    ],
)
def test_settings_that_cannot_split_are_refused(overrides, problem):
    config = validate(apply_overrides(Config(), overrides))
    check_world(config, SINGLE)  # one process takes anything
    with pytest.raises(ValueError, match=re.escape(problem)):
        check_world(config, World(0, 2, distributed=True))


def test_a_refused_launch_says_so_once_and_writes_nothing(workdir):
    out = workdir / "refused"
    overrides = [*COMMON, *GAE, f"model.path={workdir / 'model'}", f"trainer.output_dir={out}"]
    done = launch(
        workdir, "ppo", [*overrides, "data.train_batch_size=5", "actor.ppo_mini_batch_size=5"], 2, check=False
    )
    assert done.returncode != 0
    refusals = [line for line in done.stderr.splitlines() if line.startswith("refppo: error:")]
    assert len(refusals) == 1 and "do not split evenly over 2 processes" in refusals[0], done.stderr[-2000:]
    assert not out.exists(), "refused before anything is written"


def test_each_of_two_processes_holds_half_the_state(tmp_path):
    """benchmarks/fsdp_memory.py on a small model: the weights, gradients and Adam moments held by
    each of 2 processes (refppo.guards.memory.held_bytes of the shards) are half one process's, as
    refppo.guards.memory.state_bytes(processes=2) predicts."""
    out = tmp_path / "memory.json"
    script = Path(__file__).resolve().parent.parent / "benchmarks" / "fsdp_memory.py"
    small = ["--hidden", "64", "--layers", "2", "--vocab", "512", "--tokens", "16", "--out", str(out)]
    subprocess.run([sys.executable, str(script), *small], check=True, capture_output=True, timeout=TIMEOUT_S)
    runs = json.loads(out.read_text())["runs"]
    (one,), two = runs["1"], runs["2"]
    assert len(two) == 2
    for rank in two:
        assert rank["held"] == rank["predicted"]
        for key, value in one["held"].items():
            assert value / 2 <= rank["held"][key] <= value / 2 * 1.01, key  # a few padding rows at most
