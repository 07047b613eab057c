"""A run (ch 5): training steps to ``trainer.total_training_steps`` (or fewer, when
``trainer.total_epochs`` ends it first), with the evaluation, the metrics log and the checkpoints on
their schedules."""

from __future__ import annotations

from tqdm.auto import tqdm

from refppo.training.data import total_steps
from refppo.training.metrics import bar_fields
from refppo.training.trainer import PPOTrainer
from refppo.training.validation import held_out_metrics


def fit(trainer: PPOTrainer, run=None, progress_bar: bool = True) -> list[dict[str, float]]:
    """Train to ``trainer.total_training_steps``, or to the end of ``trainer.total_epochs`` passes
    over the prompts when that comes first (:func:`refppo.training.data.total_steps`; the learning-rate
    schedules still span ``total_training_steps``, as verl's), validating every ``test_freq`` steps and at the
    last (and at step 0, the SFT level, with ``val_before_train``, whatever ``test_freq`` says, as
    verl's ``RayPPOTrainer.fit`` does; :func:`refppo.training.validation.held_out_metrics`),
    logging one metrics line per step and checkpointing every ``save_freq`` steps and at the end.

    Args:
        trainer: a PPOTrainer, possibly restored from a checkpoint.
        run: a ``refppo.runs.folder.RunFolder`` (with several processes, each process's: only the first
            writes); None keeps everything in memory.
        progress_bar: show tqdm with score, KL and step time (on the first process).

    Returns:
        The metrics of the steps run (each with its "step").
    """
    t = trainer.config.trainer
    history = []

    def record(step: int, metrics: dict[str, float]) -> None:
        history.append({"step": step, **metrics})
        if run is not None:
            run.log(step, metrics)

    def validate(step: int) -> dict[str, float]:
        metrics, generations = held_out_metrics(trainer)
        if run is not None and generations:
            run.log_generations(step, generations)
        return metrics

    if trainer.step == 0 and t.val_before_train:  # verl's fit: whatever test_freq says
        record(0, validate(0))
    shown = progress_bar and trainer.world.main
    steps = total_steps(trainer.config, len(trainer.sampler.records))
    bar = tqdm(total=steps, initial=trainer.step, disable=not shown, desc="ppo")
    while trainer.step < steps:
        metrics = trainer.train_step()
        step = trainer.step
        last = step == steps
        if t.test_freq > 0 and (step % t.test_freq == 0 or last):
            metrics.update(validate(step))
        record(step, metrics)
        if run is not None and ((t.save_freq > 0 and step % t.save_freq == 0) or last):
            run.save_checkpoint(step, trainer.save_checkpoint)
        bar.set_postfix(bar_fields(metrics))
        bar.update(1)
    bar.close()
    return history
