"""Do the tests bite? Plant one-line bugs in refppo/training/trainer.py (and the registry adapters it calls,
the plain formulas it runs, and the accelerated paths that stand in for them), one at a time, and
count how many the tests catch.

    python tests/plant_trainer_bugs.py [test files...]   # default: the test files listed at the end

Each bug is planted in a copy of the package in a temporary folder (put first on PYTHONPATH), so
the working tree is never touched, even if the run is killed. Not collected by pytest (its name
does not start with test_). What each run caught is in CHANGELOG.md.
"""

import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BUGS = [
    (
        "reference log-probs from the actor",
        "compute_log_probs(self.reference, batch",
        "compute_log_probs(self.actor, batch",
    ),
    (
        "IS weights inverted",
        'old,\n                batch["rollout_log_probs"],\n                mask,\n                threshold=',
        'batch["rollout_log_probs"],\n                old,\n                mask,\n                threshold=',
    ),
    ("IS weights not truncated", "threshold=rc.rollout_is_threshold,", 'threshold=float("inf"),'),
    ("IS weights always per token", "level=rc.rollout_is,", 'level="token",'),
    ("IS weights never normalised", "batch_normalize=rc.rollout_is_batch_normalize,", "batch_normalize=False,"),
    (
        "KL in the reward: arguments swapped",
        'old_log_probs=batch["old_log_probs"],\n            ref_log_prob=batch["ref_log_prob"],',
        'old_log_probs=batch["ref_log_prob"],\n            ref_log_prob=batch["old_log_probs"],',
    ),
    ("controller updated with n_steps=1", "n_steps=mask.shape[0])", "n_steps=1)"),
    (
        "warm-up ignored without a critic (verl delays the actor)",
        "if self.step >= critic_only_steps(critic_warmup(self.config)):",
        "if not self.use_critic or self.step >= critic_only_steps(critic_warmup(self.config)):",
    ),
    (
        "lr logged before the schedule's step",
        "        learner.schedule.step()\n        lr = torch.tensor(learner.schedule.get_last_lr()[0])",
        "        lr = torch.tensor(learner.schedule.get_last_lr()[0])\n        learner.schedule.step()",
    ),
    ("a NaN entropy not checked", 'finite["entropy"] = entropy', "pass"),
    (
        "KL computed but not put in the reward",
        'batch["token_level_rewards"] = rewards\n',
        'batch["token_level_rewards"] = batch["token_level_scores"]\n',
    ),
    (
        "the batch's values not checked",
        'read = ("old_log_probs", "ref_log_prob",',
        'read = ("unchecked", "ref_log_prob",',
    ),
    (
        "training/update.py",
        "micro-batch losses not weighted",
        "loss = loss + term.coefficient * weight * term.value",
        "loss = loss + term.coefficient * term.value",
    ),
    (
        "training/update.py",
        "loss normalised over this process's rows (a per-rank mean)",
        'weight = agg_loss_weight(mb["response_mask"], mini["response_mask"], term.mode)',
        'weight = agg_loss_weight(mb["response_mask"], mine["response_mask"], term.mode)',
    ),
    (
        "distributed/__init__.py",
        "statistics averaged over processes, not summed",
        "for k in names]), world)",
        "for k in names]), world) / world.size",
    ),
    (
        "samples seeded by the process's row, not the batch's",
        "first_row=first_row + share.start * n)",
        "first_row=first_row)",
    ),
    (
        "distributed/__init__.py",
        "generation gathers the weights at every pass (a collective per decoding step)",
        "module.set_reshard_after_forward(False, recurse=False)\n            module.unshard()",
        "module.unshard()",
    ),
    (
        "training/update.py",
        "logged losses weighted by token share",
        "stats[name] = stats.get(name, 0.0) + weight * term.value.detach()",
        "stats[name] = stats.get(name, 0.0) + share * term.value.detach()",
    ),
    (
        "temperature ignored in the update",
        "log_probs(self.actor, mb, temperature, with_entropy",
        "log_probs(self.actor, mb, 1.0, with_entropy",
    ),
    (
        "policy loss on the rollout's log-probs",
        'old_log_prob=mb["old_log_probs"]',
        'old_log_prob=mb["rollout_log_probs"]',
    ),
    ("policy loss on the returns", 'advantages=mb["advantages"]', 'advantages=mb["returns"]'),
    (
        "entropy bonus with the wrong sign",
        "coefficient=-a.entropy_coeff",
        "coefficient=a.entropy_coeff",
    ),
    (
        "KL loss on the old log-probs (no gradient)",
        'kl_penalty(log_prob, mb["ref_log_prob"], a.kl_loss_type)',
        'kl_penalty(mb["old_log_probs"], mb["ref_log_prob"], a.kl_loss_type)',
    ),
    (
        "value loss: returns and old values swapped",
        'vpreds, mb["returns"], mb["values"], mask',
        'vpreds, mb["values"], mb["returns"], mask',
    ),
    (
        "seq-mean-token-sum-norm over the batch width",
        "return self.config.data.max_response_length if configured is None else configured",
        "return configured",
    ),
    (
        "critic uses the actor's epochs",
        'epochs=setting("ppo_epochs"),',
        "epochs=c.actor.ppo_epochs,",
    ),
    (
        "settings/conditions.py",
        "the critic's loss mode not the actor's when unset",
        "return getattr(config.actor, name) if value is None else value",
        'return ("token-mean" if name == "loss_agg_mode" else getattr(config.actor, name)) if value is None else value',
    ),
    (
        "training/metrics.py",
        "explained variance over the values",
        "(masked_var(returns, response_mask) + 1e-5)",
        "(masked_var(values, response_mask) + 1e-5)",
    ),
    (
        "losses.py",
        "clip loss: bounds swapped",
        "-advantages * torch.clamp(ratio, 1 - low, 1 + high)",
        "-advantages * torch.clamp(ratio, 1 - high, 1 + low)",
    ),
    (
        "losses.py",
        "penalty loss: KL type ignored",
        "kl = kl_penalty(old_log_prob.detach(), log_prob, penalty_kl_type)",
        'kl = kl_penalty(old_log_prob.detach(), log_prob, "kl")',
    ),
    (
        "advantages.py",
        "needs_critic gives GRPO a critic too",
        'return adv_estimator == "gae"',
        'return adv_estimator in ("gae", "grpo")',
    ),
]
BUGS += [  # the plain formulas
    (
        "advantages.py",
        "GAE: a masked token not skipped",
        "next_value = v[:, t] * m[:, t] + (1 - m[:, t]) * next_value",
        "next_value = v[:, t]",
    ),
    (
        "functional.py",
        "log-probs: the temperature left out",
        "torch.log_softmax(logits.float() / temperature, dim=-1)",
        "torch.log_softmax(logits.float(), dim=-1)",
    ),
    (
        "rollout/generation.py",
        "a finished row's log-prob recorded",
        "log_probs.append(logp.masked_fill(done, 0.0))",
        "log_probs.append(logp)",
    ),
    ("rollout/forward.py", "values one position late", "logits[:, -width - 1 : -1, 0]", "logits[:, -width:, 0]"),
]
BUGS += [  # the input contracts and DAPO's shaping
    (
        "guards/inputs.py",
        "negative importance weights let through",
        "nonnegative=weights,  # a negative weight",
        "nonnegative={},  # a negative weight",
    ),
    (
        "algorithms/overlong.py",
        "overlong penalty not spread over the buffer",
        "-exceed / buffer_len * penalty_factor",
        "-exceed * penalty_factor",
    ),
]
BUGS += [  # the estimators and losses from verl 0.9's registry
    ("advantages.py", "REINFORCE++: a masked token's return kept", "returns[:, t] = g * m[:, t]", "returns[:, t] = g"),
    (
        "advantages.py",
        "REINFORCE++: a masked token not skipped",
        "running = g * m[:, t] + (1 - m[:, t]) * running",
        "running = g",
    ),
    (
        "algorithms/verl_advantages.py",
        "REINFORCE++-baseline: no baseline",
        "centred = scores - group_mean(n, total)",
        "centred = scores",
    ),
    (
        "algorithms/verl_advantages.py",
        "GPG: alpha left out",
        "alpha = scores.shape[0] / torch.count_nonzero(scores).clamp(min=1)",
        "alpha = 1.0",
    ),
    (
        "algorithms/verl_losses.py",
        "GSPO: the sequence's summed log-ratio, not its mean",
        "seq_log_ratio = masked_sum(log_ratio, response_mask, axis=-1) / lengths",
        "seq_log_ratio = masked_sum(log_ratio, response_mask, axis=-1)",
    ),
    (
        "algorithms/verl_losses.py",
        "GSPO: the gradient through the sequence ratio",
        "log_prob - log_prob.detach() + seq_log_ratio.detach().unsqueeze(-1)",
        "log_prob - log_prob.detach() + seq_log_ratio.unsqueeze(-1)",
    ),
    (
        "algorithms/verl_losses.py",
        "CISPO: the gradient through the weight",
        "-clipped.detach() * advantages * log_prob",
        "-clipped * advantages * log_prob",
    ),
    (
        "algorithms/verl_losses.py",
        "GPG loss: ascending the loss",
        "pg_losses = -log_prob * advantages",
        "pg_losses = log_prob * advantages",
    ),
]
BUGS += [
    (
        "algorithms/verl_losses.py",
        "SAPO: the temperatures swapped",
        "masked_fill(advantages > 0, tau_pos)",
        "masked_fill(advantages < 0, tau_pos)",
    ),
    ("algorithms/verl_losses.py", "SAPO: the gate not scaled by 4 / tau", "* (4.0 / tau)", "* 4.0"),
    (
        "algorithms/verl_losses.py",
        "GMPO: the optimistic side of the clip",
        "sign * torch.minimum(sign * log_ratio, sign * clamped)",
        "sign * torch.maximum(sign * log_ratio, sign * clamped)",
    ),
]
BUGS += [  # token-budget micro-batches (use_dynamic_bsz)
    (
        "rollout/forward.py",
        "token-budget rows put back in the wrong order",
        "if idx is None else idx",
        "if idx is None else slice(start, start + len(idx))",
    ),
    (
        "accel/token_budget.py",
        "trimming cuts the last response token",
        "keep = response_keep",
        "keep = max(response_keep - 1, 1)",
    ),
    (
        "accel/token_budget.py",
        "a micro-batch over the token budget",
        "(len(groups[-1]) + 1) * sum(grown) > max_tokens",
        "len(groups[-1]) * sum(grown) > max_tokens",
    ),
]
BUGS += [  # log-probs in blocks, compiled or from the hidden states
    (
        "accel/logprobs.py",
        "chunked log-softmax: temperature left out of the gradient",
        "                temperature,\n                dtype,\n            ),",
        "                1.0,\n                dtype,\n            ),",
    ),
    (
        "accel/logprobs.py",
        "fused: the head's gradient halved",
        "grad_w.addmm_(g.T, h)",
        "grad_w.addmm_(g.T, h, alpha=0.5)",
    ),
    (
        "accel/logprobs.py",
        "fused: the reference keeps its adapter",
        "with adapters_off(model.actor):\n            return final_hidden_states",
        "if True:\n            return final_hidden_states",
    ),
    (
        "accel/logprobs.py",
        "fused: hidden states one position late",
        "hidden[:, -mask.shape[1] - 1 : -1]",
        "hidden[:, -mask.shape[1] :]",
    ),
    (
        "accel/logprobs.py",
        "fused: the autocast dtype ignored",
        "torch.get_autocast_dtype(device) if autocast else ",
        "",
    ),
    (
        "accel/__init__.py",
        "the options ignored: the actor's passes always plain",
        "actor=passes(config.actor),",
        "actor=ForwardPasses(),",
    ),
]
BUGS += [  # the other accelerated paths
    (
        "accel/gae.py",
        "packed GAE: the next value is the current one",
        "delta = packed_r + gamma * next_v - packed_v",
        "delta = packed_r + gamma * packed_v - packed_v",
    ),
    (
        "accel/decoding.py",
        "grouped decode attention: query heads in the wrong groups",
        "query.reshape(batch, heads // groups, groups, dim)",
        "query.reshape(batch, groups, heads // groups, dim).transpose(1, 2)",
    ),
    (
        "accel/checkpointing.py",
        "checkpointed recomputation with cuDNN's attention",
        "(contextlib.nullcontext(), trainable_attention())",
        "(contextlib.nullcontext(), contextlib.nullcontext())",
    ),
]
BUGS = [bug if len(bug) == 4 else ("training/trainer.py", *bug) for bug in BUGS]


def main(tests: list[str]) -> None:
    originals = {file: (ROOT / "refppo" / file).read_text() for file, *_ in BUGS}
    for file, name, old, _ in BUGS:
        if originals[file].count(old) != 1:
            raise SystemExit(f"bug {name!r}: its line is not in refppo/{file} exactly once; update BUGS")
    caught = 0
    with tempfile.TemporaryDirectory() as tmp:
        for part in ("refppo", "tests", "benchmarks"):  # a test runs benchmarks/fsdp_memory.py
            shutil.copytree(ROOT / part, Path(tmp) / part)
        shutil.copy(ROOT / "pyproject.toml", tmp)
        shutil.copy(ROOT / "conftest.py", tmp)  # one torch thread per pytest worker
        env = {**os.environ, "PYTHONPATH": tmp}
        where = subprocess.run(
            [sys.executable, "-c", "import refppo; print(refppo.__file__)"],
            cwd=tmp,
            env=env,
            capture_output=True,
            text=True,
        )
        if not where.stdout.startswith(tmp):
            raise SystemExit(f"the copy is not the refppo imported: {where.stdout or where.stderr}")
        if subprocess.run(
            [sys.executable, "-m", "pytest", "-q", "-x", *tests], cwd=tmp, env=env, capture_output=True
        ).returncode:
            raise SystemExit("the tests fail without a planted bug; fix them first")
        for file, name, old, new in BUGS:
            (Path(tmp) / "refppo" / file).write_text(originals[file].replace(old, new))
            start = time.perf_counter()
            run = subprocess.run(
                [sys.executable, "-m", "pytest", "-q", "-x", *tests], cwd=tmp, env=env, capture_output=True, text=True
            )
            caught += run.returncode != 0
            verdict = "caught" if run.returncode != 0 else "MISSED"
            print(f"{file:14s} {name:45s} {verdict} ({time.perf_counter() - start:.0f} s)", flush=True)
            (Path(tmp) / "refppo" / file).write_text(originals[file])
    print(f"caught {caught} of {len(BUGS)}")


if __name__ == "__main__":
    main(
        sys.argv[1:]
        or [
            "tests/test_trainer.py",
            "tests/test_trainer_wiring.py",
            "tests/test_registry.py",
            "tests/test_losses.py",
            "tests/test_verl_algorithms.py",
            "tests/test_forward.py",
            "tests/test_generation.py",
            "tests/test_functional.py",
            "tests/test_advantages.py",
            "tests/test_accel.py",
            "tests/test_accel_logprobs.py",
            "tests/test_accel_token_budget.py",
            "tests/test_accel_gae.py",
            "tests/test_accel_decoding.py",
            "tests/test_accel_checkpointing.py",
            "tests/test_distributed.py",
            "tests/test_dapo.py",
            "tests/test_public_api_errors.py",
        ]
    )
