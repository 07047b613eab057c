"""``refppo doctor RUN``: appendix A's gallery of broken runs as a check. Each known failure
signature is looked for in a run's logged metrics (verl's names) and reported in one line with
the section that explains it.

A signature is judged on the second half of the run's steps (after the critic's warm-up), so
that a start-up transient is not a finding. The thresholds sit between appendix A's healthy
runs and its broken ones, seeds 0-2 of each, second-half means, with a wide margin both ways:

- clip fraction: healthy at most 0.006, a learning rate ten times too high 0.074;
- explained variance: healthy at least 0.049, a critic learning rate 100 times too small at
  most -0.48;
- value clip fraction: healthy at most 0.0011, ``critic.cliprange_value=0.01`` at least 0.36;
- responses at the length limit: healthy 0, the learning rate ten times too high 0.37;
- sampler against trainer: healthy below 1e-7 per token, a sampler at the wrong temperature far
  above 1e-3.

The entropy and KL signatures are not in that gallery; their thresholds (a fifth of the first
step's entropy; twice the KL target) are marked as such where they are defined.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from refppo.settings.conditions import critic_only_steps, critic_warmup
from refppo.settings.config import Config, config_from_dict

CLIP_FRACTION = 0.05  # actor/pg_clipfrac
NEGATIVE_EV = -0.2  # critic/vf_explained_var
VALUE_CLIP_FRACTION = 0.1  # critic/vf_clipfrac
PROBS_DIFF = 1e-3  # training/rollout_probs_diff_mean
AT_THE_LIMIT = 0.25  # response_length/clip_ratio
# not calibrated on a broken run of the book: a judgement, kept loose
ENTROPY_KEPT = 0.2  # actor/entropy: the second half's mean over the first step's
KL_OVER_TARGET = 2.0  # actor/reward_kl_penalty over algorithm.kl_ctrl.target_kl


@dataclass(frozen=True)
class Finding:
    """One failure signature found in a run: its ``name``, what was measured (``message``) and
    where the book explains it (``section``)."""

    name: str
    message: str
    section: str

    def __str__(self) -> str:
        return f"{self.name}: {self.message} (see {self.section})"


def _late(rows: list[dict], key: str, after: int = 0) -> list[float]:
    """The logged values of ``key`` in the second half of the steps (and after step ``after``)."""
    last = max((r["step"] for r in rows), default=0)
    return [r[key] for r in rows if r["step"] > max(last / 2, after) and r.get(key) is not None]


def _mean(values: list[float]) -> float | None:
    return sum(values) / len(values) if values else None


@dataclass(frozen=True)
class Threshold:
    """A signature that is one metric's second-half mean past a limit: above it (``above``) or
    below it, judged after the critic's warm-up if ``after_warmup``."""

    key: str
    above: bool
    limit: float
    name: str
    advice: str
    section: str
    after_warmup: bool = False

    def __call__(self, rows: list[dict], config: Config) -> Finding | None:
        warmup = critic_only_steps(critic_warmup(config)) if self.after_warmup else 0
        value = _mean(_late(rows, self.key, warmup))
        if value is None or (value <= self.limit if self.above else value >= self.limit):
            return None
        return Finding(self.name, f"{self.key} {value:.3g} in the second half: {self.advice}", self.section)


CLIPPED = Threshold(
    "actor/pg_clipfrac",
    True,
    CLIP_FRACTION,
    "the clip fraction saturates",
    "each update moves the policy too far (healthy: below 0.02); lower actor.optim.lr, or actor.ppo_epochs",
    "appendix A.3, a learning rate ten times too high",
)
LAGGING = Threshold(
    "critic/vf_explained_var",
    False,
    NEGATIVE_EV,
    "the critic lags",
    "the values explain the returns worse than their mean would; raise critic.optim.lr, or give the critic a warm-up",
    "appendix A.3, a critic that learns too slowly",
    after_warmup=True,
)
VALUE_CLIPPED = Threshold(
    "critic/vf_clipfrac",
    True,
    VALUE_CLIP_FRACTION,
    "the value clip binds",
    "the clip holds the critic back; widen critic.cliprange_value",
    "appendix A.3, a value clip that is too tight",
    after_warmup=True,
)
AT_LIMIT = Threshold(
    "response_length/clip_ratio",
    True,
    AT_THE_LIMIT,
    "responses stuck at the length limit",
    "responses stop ending (an unstable update, or a reward for length)",
    "chapter 5, responses that never end",
)


def _drift(rows: list[dict], config: Config) -> Finding | None:
    value = _mean([r["training/rollout_probs_diff_mean"] for r in rows if "training/rollout_probs_diff_mean" in r])
    if value is None or value <= PROBS_DIFF:
        return None
    why = (
        "in bypass mode the first epoch's ratio is then not 1"
        if config.algorithm.rollout_correction.bypass_mode
        else "the sampler's probabilities are not the trainer's (a temperature, a kernel, a lag)"
    )
    return Finding(
        "the sampler and the trainer disagree",
        f"training/rollout_probs_diff_mean {value:.3g} per token (a healthy run: below 1e-5); {why}",
        "appendix A.3, a sampler at the wrong temperature",
    )


def _entropy_collapse(rows: list[dict], config: Config) -> Finding | None:
    first = next((r["actor/entropy"] for r in rows if r.get("actor/entropy") is not None), None)
    value = _mean(_late(rows, "actor/entropy"))
    if first and value is not None and value < ENTROPY_KEPT * first:
        return Finding(
            "the entropy collapses",
            f"actor/entropy {value:.3g} in the second half against {first:.3g} at the start: the policy has "
            "stopped exploring",
            "appendix A.1, the metrics to watch",
        )
    return None


def _kl_runaway(rows: list[dict], config: Config) -> Finding | None:
    kl = config.algorithm.kl_ctrl
    if not config.algorithm.use_kl_in_reward or kl.type == "fixed":
        return None
    value = _mean(_late(rows, "actor/reward_kl_penalty"))
    if value is not None and value > KL_OVER_TARGET * kl.target_kl:
        return Finding(
            "the KL runs away from its target",
            f"actor/reward_kl_penalty {value:.3g} in the second half against a target of {kl.target_kl}: the "
            "controller cannot hold it; raise algorithm.kl_ctrl.kl_coef",
            "chapter 6, the KL controllers",
        )
    return None


SIGNATURES = (CLIPPED, LAGGING, VALUE_CLIPPED, _drift, _entropy_collapse, AT_LIMIT, _kl_runaway)


def diagnose(rows: list[dict], config: Config) -> list[Finding]:
    """The failure signatures of a run (:data:`SIGNATURES`, each ``(rows, config) -> Finding | None``).

    Args:
        rows: its metrics, one dict per logged line with its ``step`` (``refppo.runs.folder.load_metrics``,
            or a trainer's history).
        config: its settings.

    Returns:
        The findings, in the order of appendix A's gallery; empty for a healthy run.
    """
    return [finding for signature in SIGNATURES if (finding := signature(rows, config)) is not None]


def diagnose_run(path: str | Path) -> list[Finding]:
    """:func:`diagnose` of a run folder: its ``config.json`` and ``metrics.jsonl``.

    Raises:
        ValueError: a folder that is not a refppo run, an SFT or reward-model run (the signatures
            are PPO's), or damaged files (named by file and line).
    """
    from refppo.runs.folder import load_metrics

    path = Path(path)
    if not (path / "config.json").is_file() or not (path / "metrics.jsonl").is_file():
        raise ValueError(f"{path} is not a refppo run folder (it needs config.json and metrics.jsonl)")
    try:
        config = config_from_dict(json.loads((path / "config.json").read_text()))
    except (ValueError, TypeError, KeyError) as error:
        raise ValueError(f"{path / 'config.json'} is not a refppo config: {error}") from None
    rows = load_metrics(path)
    stages = {"sft/loss": "an SFT run", "rm/loss": "a reward-model run"}
    for key, stage in stages.items():
        if any(key in row for row in rows):
            raise ValueError(f"{path} is {stage}: refppo doctor reads the failure signatures of refppo ppo runs")
    return diagnose(rows, config)


def run_doctor(argv: list[str]) -> int:
    """``refppo doctor RUN [RUN ...]``: each run's findings, one line each.

    Returns:
        The exit status: 0 when no run shows a known failure signature, 1 when one does, 2 for no
        run given.
    """
    if not argv or argv[0] in ("-h", "--help"):
        print("usage: refppo doctor RUN [RUN ...]   (a run folder of refppo ppo)")
        return 0 if argv else 2
    flagged = False
    for path in argv:
        findings = diagnose_run(path)
        flagged |= bool(findings)
        print(
            f"run {path}: "
            + (f"{len(findings)} known failure signature(s)" if findings else "no known failure signature")
        )
        for finding in findings:
            print(f"  - {finding}")
    return 1 if flagged else 0
