"""Input checks shared by the math modules.

Shape checks cost nothing. Value checks (mask is 0/1, tensors are finite, enough valid tokens)
read device data, so each public function gathers all of its value checks into one host sync,
and a loop that has checked its inputs once can turn them off inside (:func:`value_checks`).
"""

from __future__ import annotations

import contextlib
import contextvars

import torch

_VALUE_CHECKS = contextvars.ContextVar("refppo_value_checks", default=True)


@contextlib.contextmanager
def value_checks(enabled: bool):
    """Turn :func:`check_values` on or off inside a block (the trainer's update loop checks its
    batch once per step, then runs its micro-batches without a host sync for checks)."""
    token = _VALUE_CHECKS.set(enabled)
    try:
        yield
    finally:
        _VALUE_CHECKS.reset(token)


def check_same_shape(**tensors: torch.Tensor) -> None:
    """Raise ValueError unless all named tensors have one shape.

    Args:
        **tensors: name -> tensor of any shape; all must match the first.
    """
    items = list(tensors.items())
    name0, t0 = items[0]
    for name, t in items[1:]:
        if t.shape != t0.shape:
            raise ValueError(f"shape mismatch: {name} has shape {tuple(t.shape)} but {name0} has {tuple(t0.shape)}")


def check_ndim(name: str, t: torch.Tensor, ndim: int) -> None:
    """Raise ValueError unless ``t`` has ``ndim`` dimensions."""
    if t.dim() != ndim:
        raise ValueError(f"{name} must have {ndim} dimensions, got shape {tuple(t.shape)}")


def check_unit_interval(name: str, x: float) -> None:
    """Raise ValueError unless the scalar ``x`` lies in [0, 1]."""
    v = float(x)
    if not 0.0 <= v <= 1.0:
        raise ValueError(f"{name} must be in [0, 1], got {v}")


def check_choice(kind: str, name: str, valid) -> None:
    """Raise ValueError naming the valid options unless ``name`` is one of ``valid``."""
    if name not in valid:
        raise ValueError(f"unknown {kind} {name!r}; valid: {', '.join(sorted(valid))}")


class NonFiniteError(ValueError):
    """A tensor that must be finite holds NaN or inf."""


def check_values(
    masks: dict[str, torch.Tensor] | None = None,
    finite: dict[str, torch.Tensor] | None = None,
    min_valid: tuple[str, torch.Tensor, int] | None = None,
    where: torch.Tensor | None = None,
    nonnegative: dict[str, torch.Tensor] | None = None,
) -> None:
    """Run all value checks of one call with a single host sync (none inside ``value_checks(False)``).

    Args:
        masks: name -> mask tensor that must hold only 0 and 1.
        finite: name -> tensor that must be finite (NaN and inf are refused).
        min_valid: (name, mask, k): the mask must have at least k ones in total.
        where: if given, a 0/1 mask: ``finite`` and ``nonnegative`` are only required where
            it is 1 (padding may hold anything, since masked reductions never read it).
        nonnegative: name -> tensor that must be >= 0 (e.g. importance weights).
    """
    if not _VALUE_CHECKS.get():
        return
    labels: list[str] = []
    flags: list[torch.Tensor] = []
    for name, m in (masks or {}).items():
        labels.append(f"{name} must contain only 0 and 1")
        flags.append(((m != 0) & (m != 1)).any())
    suffix = "" if where is None else " at a valid token"

    def flag_at_valid(label: str, bad: torch.Tensor) -> None:
        labels.append(label + suffix)
        flags.append((bad if where is None else bad & where.bool()).any())

    first_finite = len(flags)
    for name, t in (finite or {}).items():
        if t.is_floating_point():
            flag_at_valid(f"{name} contains NaN or inf", ~torch.isfinite(t))
    finite_flags = range(first_finite, len(flags))
    for name, t in (nonnegative or {}).items():
        flag_at_valid(f"{name} has a negative entry", t < 0)
    if min_valid is not None:
        name, m, k = min_valid
        labels.append(f"{name} has fewer than {k} valid (mask 1) token(s)")
        flags.append(m.sum() < k)
    if not flags:
        return
    bad = torch.stack([f.to(flags[0].device) for f in flags]).tolist()  # the one sync
    errors = [label for label, b in zip(labels, bad) if b]
    if errors:
        raise (NonFiniteError if any(bad[i] for i in finite_flags) else ValueError)("; ".join(errors))


@contextlib.contextmanager
def broken_by_update(where: str, settings: str, first: bool):
    """Around a step's first forward passes: NaN or inf there, after an update, means the update
    broke the model (a learning rate far too large); raise FloatingPointError naming ``where``
    (the step) and the likely ``settings``. At the ``first`` step the loaded model is at fault:
    the error stays as it is."""
    try:
        yield
    except NonFiniteError as error:
        if first:
            raise
        raise FloatingPointError(
            f"{where}: {error}. The last update broke the model: {settings} (or a weight decay) is likely far "
            "too large; the run stops here, its last checkpoint holds good weights"
        ) from error
