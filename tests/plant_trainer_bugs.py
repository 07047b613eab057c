"""Do the trainer tests bite? Plant one-line wiring bugs in refppo/trainer.py (and the registry
adapters it calls, the token-budget micro-batches and the log-probs from hidden states), one at
a time, and count how many the tests catch.

    python tests/plant_trainer_bugs.py [test files...]   # default: the five listed below

Each bug is planted in a copy of the package in a temporary folder (put first on PYTHONPATH), so
the working tree is never touched, even if the run is killed. Not collected by pytest (its name
does not start with test_). Recorded on a 2-core CPU, 2026-11-23 (15-42 s a bug): the trainer,
wiring and registry tests catch 20 of 20 (18 of 18 on 2026-11-22, before the batch check and
the seq-mean-token-sum-norm divisor were planted too). Before test_trainer_wiring.py, test_trainer.py alone
caught 3 of the 14 trainer.py bugs that were planted then. The three token-budget bugs (added
later on 2026-11-23) were run alone: the rollout, trainer and wiring tests catch 3 of 3 (11-13 s
a bug). With the five bugs in the chunked log-softmax and the log-probs from hidden states
(model.use_fused_kernels) added, the whole list was run again on 2026-11-23 with the default
tests (trainer, wiring, registry, rollout, functional): 29 of 29 caught (14-36 s a bug). A 30th
(the autocast dtype ignored), added after, is caught by the functional tests (run alone). The
whole list again on 2026-11-24, after the rollout-correction weights and the LR schedules
changed, default tests: 30 of 30 caught (9-56 s a bug). On 2026-11-25 six lines had moved
(the batch check, the entropy now computed in the update only with a coefficient, the chunked
gradient's temperature, the fused update, the critic's settings read through critic_setting); with
them updated and a 31st bug (the critic's loss mode not the actor's when unset), default tests: 31
of 31 caught (9-26 s a bug, 8 min in all, AMD EPYC Zen 4). A 32nd (a NaN entropy from the
old-log-prob pass left out of the batch check), which no test caught until test_trainer's batch
check test planted one, added later that day: 32 of 32 caught (8-28 s a bug).
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
    ("reference log-probs from the actor", "compute_log_probs, self.reference, batch", "compute_log_probs, self.actor, batch"),
    ("IS weights inverted", 'batch["old_log_probs"], batch["rollout_log_probs"], mask, c.actor', 'batch["rollout_log_probs"], batch["old_log_probs"], mask, c.actor'),
    ("IS weights not truncated", "mask, c.actor.rollout_is_threshold", 'mask, float("inf")'),
    ("KL in the reward: arguments swapped", 'batch["old_log_probs"], batch["ref_log_prob"], mask, beta', 'batch["ref_log_prob"], batch["old_log_probs"], mask, beta'),
    ("controller updated with n_steps=1", "n_steps=mask.shape[0])", "n_steps=1)"),
    ("a NaN entropy not checked", 'finite["entropy"] = entropy', "pass"),
    ("KL computed but not put in the reward", 'batch["token_level_rewards"], current_kl = apply_kl_penalty(', "_, current_kl = apply_kl_penalty("),
    ("the batch's values not checked", 'finite = {k: batch[k] for k in ("old_log_probs",', 'finite = {k: batch[k] for k in ("unchecked",'),
    ("micro-batch losses not weighted", "(loss * weight).backward()", "loss.backward()"),
    ("logged losses weighted by token share", "(weight if k in LOSS_STATS else share) * v", "share * v"),
    ("temperature ignored in the update", "self.actor, mb, temp, calculate_entropy=bonus", "self.actor, mb, 1.0, calculate_entropy=bonus"),
    ("policy loss on the rollout's log-probs", 'old_log_prob=mb["old_log_probs"]', 'old_log_prob=mb["rollout_log_probs"]'),
    ("policy loss on the returns", 'advantages=mb["advantages"]', 'advantages=mb["returns"]'),
    ("entropy bonus with the wrong sign", "loss = loss - a.entropy_coeff * entropy_loss", "loss = loss + a.entropy_coeff * entropy_loss"),
    ("KL loss on the old log-probs (no gradient)", 'kl_penalty(log_prob, mb["ref_log_prob"], a.kl_loss_type)', 'kl_penalty(mb["old_log_probs"], mb["ref_log_prob"], a.kl_loss_type)'),
    ("value loss: returns and old values swapped", 'vpreds, mb["returns"], mb["values"], mb["response_mask"]', 'vpreds, mb["values"], mb["returns"], mb["response_mask"]'),
    ("seq-mean-token-sum-norm over the batch width", "return self.config.data.max_response_length if configured is None else configured", "return configured"),
    ("critic uses the actor's epochs", 'c.critic.grad_clip, critic_setting(c, "ppo_epochs"),', "c.critic.grad_clip, c.actor.ppo_epochs,"),
    ("config.py", "the critic's loss mode not the actor's when unset", "return getattr(config.actor, name) if value is None else value",
     'return ("token-mean" if name == "loss_agg_mode" else getattr(config.actor, name)) if value is None else value'),
    ("explained variance over the values", '(masked_var(batch["returns"], mask) + 1e-5)', '(masked_var(batch["values"], mask) + 1e-5)'),
    ("losses.py", "clip adapter: bounds swapped", "clip_ratio, clip_ratio_low, clip_ratio_high, clip_ratio_c,", "clip_ratio, clip_ratio_high, clip_ratio_low, clip_ratio_c,"),
    ("losses.py", "penalty adapter: KL type for the coefficient", "penalty_kl_coef, penalty_kl_type, loss_agg_mode,\n", "0.1, penalty_kl_type, loss_agg_mode,\n"),
    ("advantages.py", "needs_critic reads the wrong input", 'return ADV_ESTIMATORS.takes(adv_estimator, "values")', 'return ADV_ESTIMATORS.takes(adv_estimator, "response_mask")'),
]
BUGS += [  # token-budget micro-batches (use_dynamic_bsz)
    ("rollout.py", "token-budget rows put back in the wrong order", "out[idx, : r.shape[1]] = r", "out[: len(idx), : r.shape[1]] = r"),
    ("rollout.py", "trimming cuts the last response token", "cut, keep = width_p - prompt_keep, response_keep",
     "cut, keep = width_p - prompt_keep, max(response_keep - 1, 1)"),
    ("rollout.py", "a micro-batch over the token budget", "(len(groups[-1]) + 1) * sum(grown) > max_tokens", "len(groups[-1]) * sum(grown) > max_tokens"),
]
BUGS += [  # log-probs from the hidden states (model.use_fused_kernels)
    ("functional.py", "chunked log-softmax: temperature left out of the gradient", "            temperature, dtype,\n        )  # fmt: skip", "            1.0, dtype,\n        )  # fmt: skip"),
    ("functional.py", "fused: the head's gradient halved", "grad_w.addmm_(g.T, h)", "grad_w.addmm_(g.T, h, alpha=0.5)"),
    ("models.py", "fused: the reference keeps its adapter", "with model.actor.disable_adapter():\n            return final_hidden_states", "if True:\n            return final_hidden_states"),
    ("rollout.py", "fused: hidden states one position late", "hidden[:, -width - 1 : -1]", "hidden[:, -width:]"),
    ("functional.py", "fused: the autocast dtype ignored", "torch.get_autocast_dtype(device) if autocast else ", ""),
    ("trainer.py", "fused: the update still computes whole logits", "calculate_entropy=bonus or a.calculate_entropy, fused=self.fused,", "calculate_entropy=bonus or a.calculate_entropy, fused=False,"),
]
BUGS = [bug if len(bug) == 4 else ("trainer.py", *bug) for bug in BUGS]


def main(tests: list[str]) -> None:
    originals = {file: (ROOT / "refppo" / file).read_text() for file, *_ in BUGS}
    for file, name, old, new in BUGS:
        if originals[file].count(old) != 1:
            raise SystemExit(f"bug {name!r}: its line is not in refppo/{file} exactly once; update BUGS")
    caught = 0
    with tempfile.TemporaryDirectory() as tmp:
        for part in ("refppo", "tests"):
            shutil.copytree(ROOT / part, Path(tmp) / part)
        shutil.copy(ROOT / "pyproject.toml", tmp)
        env = {**os.environ, "PYTHONPATH": tmp}
        where = subprocess.run([sys.executable, "-c", "import refppo; print(refppo.__file__)"], cwd=tmp, env=env, capture_output=True, text=True)
        if not where.stdout.startswith(tmp):
            raise SystemExit(f"the copy is not the refppo imported: {where.stdout or where.stderr}")
        if subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", *tests], cwd=tmp, env=env, capture_output=True).returncode:
            raise SystemExit("the tests fail without a planted bug; fix them first")
        for file, name, old, new in BUGS:
            (Path(tmp) / "refppo" / file).write_text(originals[file].replace(old, new))
            start = time.perf_counter()
            run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", *tests], cwd=tmp, env=env, capture_output=True, text=True)
            caught += run.returncode != 0
            verdict = "caught" if run.returncode != 0 else "MISSED"
            print(f"{file:14s} {name:45s} {verdict} ({time.perf_counter() - start:.0f} s)", flush=True)
            (Path(tmp) / "refppo" / file).write_text(originals[file])
    print(f"caught {caught} of {len(BUGS)}")


if __name__ == "__main__":
    main(sys.argv[1:] or ["tests/test_trainer.py", "tests/test_trainer_wiring.py", "tests/test_registry.py", "tests/test_rollout.py", "tests/test_functional.py"])
