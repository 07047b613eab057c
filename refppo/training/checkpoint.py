"""A checkpoint's model states: the trained models and their optimisers, written and read with
``torch.distributed.checkpoint`` so that a checkpoint saved by N processes loads into any number.
The run folder (:mod:`refppo.runs.folder`) decides where checkpoints go; the trainer decides what
they hold (:meth:`refppo.training.trainer.PPOTrainer.save_checkpoint`)."""

from __future__ import annotations

import warnings
from pathlib import Path

from refppo.distributed import SINGLE, World

STATE_FILE = "trainer_state.pt"  # a checkpoint's trainer state (PPOTrainer.save_checkpoint)
MODELS = "models"  # a checkpoint's models and optimisers


def save_models(folder: Path, trained: dict, world: World = SINGLE) -> None:
    """Write the trained models' and optimisers' states to ``folder/models`` with
    ``torch.distributed.checkpoint``: with several processes each writes its shard, and the
    checkpoint reads back into any number of processes (:func:`load_models`).

    Args:
        folder: the checkpoint's folder.
        trained: name -> (model, optimizer).
        world: the processes (every one of them calls this).
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    states = {}
    for name, (model, optimizer) in trained.items():
        states[name], states[f"{name}_opt"] = get_state_dict(model, optimizer)
    with warnings.catch_warnings():  # one process: "assuming the intent is to save in a single process"
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.save(states, checkpoint_id=Path(folder) / MODELS, no_dist=not world.distributed)


def load_models(folder: Path, trained: dict, world: World = SINGLE) -> None:
    """Read :func:`save_models`'s states into ``trained`` (name -> (model, optimizer), or
    (model, None) for the weights alone, e.g. ``{"actor": (model, None)}`` to look at a checkpoint's
    actor), resharded to this run's processes."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_state_dict,
        set_model_state_dict,
        set_state_dict,
    )

    states = {}
    for name, (model, optimizer) in trained.items():
        if optimizer is None:
            states[name] = get_model_state_dict(model)
        else:
            states[name], states[f"{name}_opt"] = get_state_dict(model, optimizer)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load(states, checkpoint_id=Path(folder) / MODELS, no_dist=not world.distributed)
    for name, (model, optimizer) in trained.items():
        if optimizer is None:
            set_model_state_dict(model, states[name])
        else:
            set_state_dict(model, optimizer, model_state_dict=states[name], optim_state_dict=states[f"{name}_opt"])
