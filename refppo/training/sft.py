"""Supervised fine-tuning (ch 5): the masked next-token loss on responses only, and the training
loop SFT and the reward model share.

The batch has the rollout layout (:func:`refppo.rollout.prompts.build_batch`), so the loss is the
negative mean log-prob of the response tokens (EOS included) that PPO later computes the same way.
"""

from __future__ import annotations

import torch
from tqdm.auto import tqdm

from refppo.distributed import SINGLE, Unsharded, World, all_sum, sum_stats, take_share
from refppo.guards.checks import broken_by_update
from refppo.losses import agg_loss
from refppo.rollout.forward import LogProbsFn, response_log_probs
from refppo.rollout.generation import generate
from refppo.rollout.prompts import build_batch, decode_texts, tokenize_records
from refppo.training.data import EpochSampler
from refppo.training.reward_fns import check_scores, describe


def sft_loss(model, batch: dict[str, torch.Tensor], log_probs_fn: LogProbsFn = response_log_probs) -> torch.Tensor:
    """Mean negative log-likelihood of the valid response tokens (prompt tokens are not trained).

    Args:
        model: a causal LM.
        batch: rollout-layout batch (``input_ids``, ``attention_mask``, ``position_ids``,
            ``responses``, ``response_mask``).
        log_probs_fn: computes the batch's log-probs as :func:`refppo.rollout.forward.response_log_probs`
            does (``refppo.accel.select(...).actor.log_probs`` for a faster one).

    Returns:
        Scalar loss (token-mean over the batch).
    """
    log_probs, _ = log_probs_fn(model, batch, 1.0, False)
    return -agg_loss(log_probs, batch["response_mask"].to(log_probs.device), "token-mean")


def train_sft(
    model,
    tokenizer,
    examples: list[tuple[str, str]],
    steps: int,
    batch_size: int,
    lr: float,
    seed: int = 0,
    log=None,
    progress_bar: bool = False,
    log_probs_fn: LogProbsFn = response_log_probs,
    world: World = SINGLE,
    chat_template_kwargs: dict | None = None,
) -> list[dict[str, float]]:
    """Train ``model`` on (prompt, response) pairs with AdamW and a cosine schedule.

    Args:
        model: a causal LM (trained in place).
        tokenizer: a prepared tokenizer.
        examples: (prompt, response) texts; each response gets EOS appended.
        steps: optimiser steps.
        batch_size: examples per step, drawn without replacement within an epoch.
        lr: peak learning rate.
        seed: data order.
        log: optional ``log(step, metrics)`` called every step.
        progress_bar: show a tqdm bar with the loss.
        log_probs_fn: as in :func:`sft_loss`.
        world: the processes (each trains on its share of every batch: :func:`train_steps`).
        chat_template_kwargs: keyword arguments to the chat template of chat prompts
            (``data.apply_chat_template_kwargs``).

    Returns:
        Per-step metrics ``{"sft/loss", "sft/lr"}``.
    """
    if not examples:
        raise ValueError("no SFT examples")
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    schedule = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=steps)

    def step_loss(batch):
        prompts, responses = zip(*batch)
        rollout = build_batch(tokenizer, prompts, responses, chat_template_kwargs=chat_template_kwargs)
        loss = sft_loss(model, rollout, log_probs_fn)
        return loss, {"sft/loss": loss.detach()}, rollout["response_mask"].sum()

    sampler = EpochSampler(examples, batch_size, seed)
    shown = {"loss": ("sft/loss", ".3f")}
    return train_steps(model, optimizer, sampler, steps, step_loss, schedule, log, progress_bar, "sft", shown, world)


def train_steps(
    model,
    optimizer,
    sampler,
    steps: int,
    step_loss,
    schedule=None,
    log=None,
    progress_bar=False,
    desc="train",
    shown=None,
    world: World = SINGLE,
) -> list[dict[str, float]]:
    """``steps`` optimiser steps (SFT, the reward model): each draws ``sampler.next_batch()``,
    computes ``step_loss(batch) -> (mean loss, {name: mean}, count)`` (count: what the means are
    over, tokens or pairs), clips the gradient norm at 1 and steps the optimiser, then
    ``schedule``. With several processes each takes its share of the batch and weighs its means
    by its share of the count, so the summed gradient and the logged means are the whole batch's.

    Args:
        model: the model trained (train mode during the loop, eval after).
        optimizer, schedule: the optimiser and an optional LR scheduler.
        sampler: a ``refppo.training.data.EpochSampler``.
        steps: how many steps.
        step_loss: batch -> (scalar mean loss, {name: scalar mean}, scalar count).
        log: optional ``log(step, metrics)`` called every step.
        progress_bar, desc, shown: a tqdm bar named ``desc`` showing ``{label: (metric, format)}``
            (on the first process).
        world: the processes (every batch size a multiple of their number).

    Returns:
        Per-step metrics as floats, with the learning rate of the step as ``<desc>/lr``.
    """
    history = []
    model.train()
    bar = tqdm(range(1, steps + 1), desc=desc, disable=not (progress_bar and world.main))
    for step in bar:
        lr = optimizer.param_groups[0]["lr"]
        with broken_by_update(f"{desc} step {step}", f"{desc}.lr", step == 1):
            loss, metrics, count = step_loss(take_share(sampler.next_batch(), world))
        share = count / all_sum(count, world)  # 1 with one process
        metrics = sum_stats({k: v * share for k, v in metrics.items()}, world) | {f"{desc}/lr": lr}
        optimizer.zero_grad(set_to_none=True)
        (loss * share).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        metrics = {k: float(v) for k, v in metrics.items()}
        if schedule is not None:
            schedule.step()
        history.append(metrics)
        if log is not None:
            log(step, metrics)
        bar.set_postfix({label: f"{metrics[key]:{fmt}}" for label, (key, fmt) in (shown or {}).items()})
    model.eval()
    return history


@torch.no_grad()
def held_out_loss(
    model,
    tokenizer,
    examples: list[tuple],
    batch_size: int = 64,
    log_probs_fn: LogProbsFn = response_log_probs,
    chat_template_kwargs: dict | None = None,
) -> float:
    """SFT's loss on demonstrations it did not train on: the mean negative log-likelihood of all
    their response tokens (EOS included), ``val/loss``.

    Args:
        model: a causal LM (sharded or not: every process computes the whole mean).
        tokenizer: its tokenizer.
        examples: (prompt, response) pairs, the prompt a text or a chat.
        batch_size: examples per forward pass.
        log_probs_fn: as in :func:`sft_loss`.
        chat_template_kwargs: keyword arguments to the chat template of chat prompts
            (``data.apply_chat_template_kwargs``).
    """
    if not examples:
        raise ValueError("no held-out examples")
    nll = 0.0
    tokens = 0
    for start in range(0, len(examples), batch_size):
        prompts = [prompt for prompt, _ in examples[start : start + batch_size]]
        responses = [response for _, response in examples[start : start + batch_size]]
        batch = build_batch(tokenizer, prompts, responses, chat_template_kwargs=chat_template_kwargs)
        log_probs, _ = log_probs_fn(model, batch, 1.0, False)
        mask = batch["response_mask"].to(log_probs.device)
        nll -= float((log_probs * mask).sum())
        tokens += int(mask.sum())
    return nll / tokens


@torch.no_grad()
def held_out_score(model, tokenizer, records: list[dict], reward_fn, data, world: World = SINGLE) -> float:
    """Mean score of one greedy response to each held-out record: a model's ``val/score``, which a
    PPO run from it logs again at step 0.

    Args:
        model: a causal LM (sharded or not).
        tokenizer: its tokenizer.
        records: the held-out records (``task_data``'s second list).
        reward_fn: ``fn(prompts, responses, records) -> (B,)`` scores.
        data: the ``data`` settings (prompt encoding, ``max_response_length``).
        world: the processes; each scores every record.
    """
    ids, mask = tokenize_records(tokenizer, records, data)
    return greedy_score(model, tokenizer, ids, mask, records, reward_fn, data.max_response_length, world)


@torch.no_grad()
def greedy_score(
    model, tokenizer, ids, mask, records: list[dict], reward_fn, max_response_length: int, world: World = SINGLE
) -> float:
    """Mean score of one greedy response to each prompt.

    Args:
        model: a causal LM (sharded or not).
        tokenizer: its tokenizer.
        ids, mask: (N, P) left-padded prompt ids and their 0/1 mask.
        records: the N records the reward function reads (e.g. their ground truths).
        reward_fn: ``fn(prompts, responses, records) -> (N,)`` scores.
        max_response_length: the longest response generated.
        world: the processes; each scores every prompt.
    """
    eos = tokenizer.eos_token_id
    pad = tokenizer.pad_token_id
    with Unsharded(model, world):
        batch = generate(model, ids, mask, eos, pad, max_response_length, do_sample=False)
    scores = reward_fn(*decode_texts(tokenizer, batch), records)
    return float(check_scores(scores, len(records), f"reward function {describe(reward_fn)}").mean())
