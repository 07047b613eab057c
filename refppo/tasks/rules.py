"""The rule rewards verl chooses by a record's ``data_source`` (verl 0.9's
``default_compute_score``), for prompt files in verl's format (``data.task=file``), whose
``reward_model.ground_truth`` holds the answer."""

from __future__ import annotations

import re

GSM8K_TAIL = 300  # verl reads only a response's last 300 characters, where the answer is


def gsm8k_answer(response: str) -> str | None:
    """The final answer of a GSM8K response in the strict format verl 0.9 scores: the last
    ``#### <number>`` among its last 300 characters, commas removed; None without one."""
    found = re.findall(r"#### (-?[0-9.,]+)", response[-GSM8K_TAIL:])
    return found[-1].replace(",", "") if found else None


def gsm8k_score(response: str, ground_truth: str) -> float:
    """1.0 when :func:`gsm8k_answer` is the ground truth (as text), else 0.0 (verl's defaults:
    ``format_score=0``, ``score=1``)."""
    return 1.0 if gsm8k_answer(response) == ground_truth else 0.0


RULES = {"openai/gsm8k": gsm8k_score}


def rule_problem(record: dict) -> str | None:
    """Why refppo has no rule to score ``record`` by, or None."""
    source = record.get("data_source")
    if source not in RULES:
        return f"its data_source {source!r} has no rule in refppo (rules: {', '.join(RULES)})"
    truth = record.get("reward_model")
    if not isinstance(truth, dict) or not isinstance(truth.get("ground_truth"), str):
        return "it has no reward_model.ground_truth text"
    return None


def require_rules(records: list[dict]) -> None:
    """Raise ValueError, naming the first of ``records`` no rule can score and what else would
    score them, unless every one has a rule (:func:`rule_problem`)."""
    for record in records:
        if (problem := rule_problem(record)) is not None:
            raise ValueError(
                "data.task=file needs reward_model.reward_fn=package.module:function, reward_model.enable=true, "
                f"or records refppo has a rule for (a record: {problem})"
            )


def rule_reward(prompts: list[str], responses: list[str], records: list[dict]) -> list[float]:
    """Each response scored by its record's ``data_source`` rule against
    ``reward_model.ground_truth`` (a reward function: ``fn(prompts, responses, records)``).

    Args:
        prompts: B prompt texts (unused, as verl's rules do).
        responses: B decoded responses.
        records: the B records, each passing :func:`rule_problem`.

    Returns:
        B scores.
    """
    return [RULES[r["data_source"]](text, r["reward_model"]["ground_truth"]) for text, r in zip(responses, records)]


def ground_truth(record: dict) -> str | None:
    """A record's ``reward_model.ground_truth`` text (verl's schema), or None."""
    truth = record.get("reward_model")
    return truth.get("ground_truth") if isinstance(truth, dict) and isinstance(truth.get("ground_truth"), str) else None


def answer_accuracy(prompts: list[str], responses: list[str], records: list[dict]) -> list[float]:
    """Each response scored against its record's ground truth: by the record's ``data_source``
    rule where refppo has one (:func:`rule_reward`), else 1.0 when the response, stripped, is the
    ground truth, stripped (SFT's held-out accuracy on a user's records).

    Args:
        prompts: B prompt texts (unused).
        responses: B decoded responses.
        records: the B records, each with a ground truth (:func:`ground_truth`).

    Returns:
        B scores.
    """
    return [
        RULES[r["data_source"]](text, ground_truth(r))
        if rule_problem(r) is None
        else float(text.strip() == ground_truth(r).strip())
        for text, r in zip(responses, records)
    ]
