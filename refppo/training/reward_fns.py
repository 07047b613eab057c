"""Reward functions a user names: ``reward_model.reward_fn=package.module:function``, or a
function in a Python file as verl names one (``reward.custom_reward_function.path`` and ``.name``);
importing one, and checking that it returns one finite number per response."""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import os
import sys
from collections.abc import Callable
from pathlib import Path

import torch

# fn(prompts, responses, records) -> (B,) scores: texts decoded without special tokens
RewardFn = Callable[[list[str], list[str], list[dict]], torch.Tensor]


def load_reward_fn(spec: str):
    """Import ``package.module:function``, looking in the working directory too (as ``python -m``
    does)."""
    module, sep, name = spec.partition(":")
    form = "must look like package.module:function, a function taking (prompts, responses, records)"
    if not (sep and module and name) or module.startswith("."):  # a relative name has no package to start from
        raise ValueError(f"reward_model.reward_fn={spec!r} {form}")
    if os.getcwd() not in sys.path and "" not in sys.path:  # the refppo script, unlike python -m, lacks it
        sys.path.insert(0, os.getcwd())
    try:
        imported = importlib.import_module(module)
    except ModuleNotFoundError as error:
        if error.name is None or not (module == error.name or module.startswith(error.name + ".")):
            raise  # the module was found; something it imports was not
        raise ValueError(f"reward_model.reward_fn={spec!r}: no module named {error.name!r}") from error
    fn = getattr(imported, name, None)
    if not callable(fn):
        raise ValueError(f"reward_model.reward_fn={spec!r}: {module} has no function {name!r}")
    try:
        inspect.signature(fn).bind([], [], [])
    except TypeError as error:
        call = "fn(prompts, responses, records)"
        raise ValueError(f"reward_model.reward_fn={spec!r} cannot be called as {call}: {error}") from None
    except ValueError:  # a builtin without a signature: called as it is
        pass
    return fn


def load_verl_reward_fn(path: str, name: str, extra_info: dict | None = None) -> RewardFn:
    """The function ``name`` of the Python file ``path``, as verl 0.9 loads a custom reward function
    (``get_custom_reward_fn`` in ``verl/trainer/ppo/reward.py``), called for each response as verl's
    naive reward manager calls it (``verl/experimental/reward_loop/reward_manager/naive.py``):
    ``name(data_source=..., solution_str=..., ground_truth=..., extra_info=...)``, from the record's
    ``data_source``, the response's text, ``reward_model.ground_truth`` and a copy of
    ``extra_info`` with what the manager adds to it: ``num_turns`` (2, verl's single-turn agent
    loop: the user's turn and the assistant's) and ``rollout_reward_scores`` (``{}``: no tool
    scored the rollout). Dict results (``{"score": ..., "acc": ..., ...}``, verl's reward_extra_info)
    come back as one dict of lists, the score under ``"score"`` (:func:`split_reward_result`).

    Args:
        path: a .py file.
        name: the function in it.
        extra_info: added to each record's ``extra_info`` (verl's GDPO reward manager adds
            ``experiment_name``).

    Returns:
        ``fn(prompts, responses, records) -> (B,) scores``, or a dict of (B,) lists.
    """
    key = "reward_model.custom_reward_function"
    file = Path(path)
    if file.suffix != ".py" or not file.is_file():
        raise ValueError(f"{key}.path={path!r}: no Python file there")
    spec = importlib.util.spec_from_file_location(f"refppo_reward_{file.stem}", file)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    fn = getattr(module, name, None)
    if not callable(fn):
        raise ValueError(f"{key}.name={name!r}: {file} has no function {name!r}")
    try:
        inspect.signature(fn).bind(data_source="", solution_str="", ground_truth="", extra_info={})
    except TypeError as error:
        call = "fn(data_source=..., solution_str=..., ground_truth=..., extra_info=...)"
        raise ValueError(f"{key}.name={name!r} cannot be called as {call}: {error}") from None

    def reward(prompts: list[str], responses: list[str], records: list[dict]) -> list | dict[str, list]:
        results = []
        for text, record in zip(responses, records, strict=True):
            truth = record.get("reward_model")
            result = fn(
                data_source=record.get("data_source"),
                solution_str=text,
                ground_truth=truth.get("ground_truth") if isinstance(truth, dict) else None,
                # and what verl's naive manager adds (NaiveRewardManager.run_single), fresh each call
                extra_info=dict(record.get("extra_info") or {}) | (extra_info or {}) | _single_turn_info(),
            )
            results.append(result)
        if not any(isinstance(result, dict) for result in results):
            return results
        keys = results[0].keys() if isinstance(results[0], dict) else None
        if keys is None or "score" not in keys or any(not isinstance(r, dict) or r.keys() != keys for r in results):
            raise ValueError(
                f"{key}.name={name!r}: its dict results must each hold 'score' and the same keys (got "
                f"{sorted(keys or [])} and a result {results[-1]!r})"
            )
        return {k: [result[k] for result in results] for k in keys}

    reward.__module__ = str(file)
    reward.__qualname__ = name
    return reward


def _single_turn_info() -> dict:
    """What verl 0.9's naive reward manager adds to a record's ``extra_info`` from its single-turn
    agent loop: two turns (the user's, the assistant's) and no tool's reward scores."""
    return {"num_turns": 2, "rollout_reward_scores": {}}


def check_scores(scores, rows: int, source: str) -> torch.Tensor:
    """A reward function's output as a (rows,) float32 tensor, or a ValueError naming ``source``."""
    try:
        scores = torch.as_tensor(scores, dtype=torch.float32)
    except (TypeError, ValueError, RuntimeError):
        raise ValueError(
            f"{source} returned a {type(scores).__name__}; expected {rows} number(s), one score per response "
            "(a list, tuple or tensor of floats)"
        ) from None
    if scores.shape != (rows,):
        raise ValueError(f"{source} returned shape {tuple(scores.shape)}; expected ({rows},), one score per response")
    if not bool(torch.isfinite(scores).all()):
        raise ValueError(f"{source} returned a non-finite score (NaN or inf)")
    return scores


def _numbers(values) -> bool:
    """Whether ``values`` are numbers as verl's ``np.asarray(..., dtype=np.float32)`` takes them
    (Python's, numpy's or torch's, bools too), not a parsed answer's text."""
    if isinstance(values, torch.Tensor):
        return True
    if not isinstance(values, (list, tuple)):
        return False
    for value in values:
        if isinstance(value, (str, bytes)):
            return False
        try:
            float(value)
        except (TypeError, ValueError):
            return False
    return True


def split_reward_result(result, rows: int, source: str) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """A reward function's scores, and its numbers by name as verl's reward managers keep them in
    ``reward_extra_info`` (``NaiveRewardManager``, ``DAPORewardManager`` in
    ``verl/experimental/reward_loop/reward_manager/``): a plain score is also ``acc``; a dict
    result keeps each numeric entry, ``score`` included. GDPO (``algorithm.gdpo_reward_keys``), the
    group filter (``algorithm.filter_groups.metric``) and validation (``acc``, when there is one,
    is its core variable) read them.

    Args:
        result: (rows,) scores, or a dict of (rows,) lists with the scores under ``"score"``; values
            that are not numbers (a parsed answer's text) are verl's for its logs and left out.
        rows: the responses scored.
        source: the function, as errors name it.

    Returns:
        ((rows,) float32 scores, {name: (rows,) float32}).
    """
    if not isinstance(result, dict):
        scores = check_scores(result, rows, source)
        return scores, {"acc": scores}
    if "score" not in result:
        raise ValueError(f"{source} returned a dict without 'score' (it has {sorted(result)})")
    scores = check_scores(result["score"], rows, f"{source}'s 'score'")
    components = {"score": scores}
    for name, values in result.items():
        if name != "score" and _numbers(values):
            components[name] = check_scores(values, rows, f"{source}'s {name!r}")
    return scores, components


def reward_answers(result, rows: int, source: str) -> list | None:
    """The answers a reward function's dict result parsed from the responses (its ``"pred"``
    entry, as verl's math scorers return it), which verl's validation votes on for maj@k
    (``process_validation_metrics``); None when it gives none.

    Args:
        result: what :func:`split_reward_result` reads.
        rows: the responses scored.
        source: the function, as errors name it.

    Returns:
        (rows,) list of answers (strings, or any values that compare equal when the answers agree).
    """
    if not isinstance(result, dict) or "pred" not in result:
        return None
    values = result["pred"]
    answers = values.tolist() if isinstance(values, torch.Tensor) else list(values)  # compared by value
    if len(answers) != rows:
        raise ValueError(f"{source}'s 'pred' has {len(answers)} answers; expected {rows}, one per response")
    return answers


def describe(fn) -> str:
    """A function's ``module:qualname``, as ``reward_model.reward_fn`` spells it."""
    return f"{getattr(fn, '__module__', '?')}:{getattr(fn, '__qualname__', repr(fn))}"
