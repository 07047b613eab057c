"""Input checks shared by the math modules.

Shape checks cost nothing. Value checks (mask is 0/1, tensors are finite, enough valid tokens)
read device data, so each public function gathers all of its value checks into one host sync,
and a loop that has checked its inputs once can turn them off inside (:func:`value_checks`).
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import numbers

import torch

_VALUE_CHECKS = contextvars.ContextVar("refppo_value_checks", default=True)
_CHECKED_DEPTH = contextvars.ContextVar("refppo_checked_depth", default=0)


@contextlib.contextmanager
def value_checks(enabled: bool):
    """Turn :func:`check_values` on or off inside a block (the trainer's update loop checks its
    batch once per step, then runs its micro-batches without a host sync for checks)."""
    token = _VALUE_CHECKS.set(enabled)
    try:
        yield
    finally:
        _VALUE_CHECKS.reset(token)


def checks_once(fn):
    """Decorator for a public function whose inputs are checked, by itself or by the code that made
    them: the checked functions it calls skip their value checks, so one call costs at most one
    host sync (a per-token or per-micro-batch function, none)."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        token = _CHECKED_DEPTH.set(_CHECKED_DEPTH.get() + 1)
        try:
            return fn(*args, **kwargs)
        finally:
            _CHECKED_DEPTH.reset(token)

    return wrapper


def check_tensors(**tensors: torch.Tensor) -> None:
    """Raise ValueError unless every named value is a tensor and all are on one device.

    Args:
        **tensors: name -> tensor of any shape.
    """
    items = list(tensors.items())
    for name, t in items:
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    name0, t0 = items[0]
    for name, t in items[1:]:
        if t.device != t0.device:
            raise ValueError(f"device mismatch: {name} is on {t.device} but {name0} is on {t0.device}")


def check_same_shape(**tensors: torch.Tensor) -> None:
    """Raise ValueError unless all named tensors have one shape (and one device).

    Args:
        **tensors: name -> tensor of any shape; all must match the first.
    """
    check_tensors(**tensors)
    items = list(tensors.items())
    name0, t0 = items[0]
    for name, t in items[1:]:
        if t.shape != t0.shape:
            raise ValueError(f"shape mismatch: {name} has shape {tuple(t.shape)} but {name0} has {tuple(t0.shape)}")


def check_ndim(name: str, t: torch.Tensor, ndim: int) -> None:
    """Raise ValueError unless ``t`` is a tensor with ``ndim`` dimensions."""
    check_tensors(**{name: t})
    if t.dim() != ndim:
        raise ValueError(f"{name} must have {ndim} dimensions, got shape {tuple(t.shape)}")


# Logits are divided by the temperature in float32. Below this the division can overflow (and
# under 1.2e-38 the temperature is not even a normal float32); it is greedy in all but name.
TEMPERATURES = "[1e-6, inf)"


def in_range(value: float, spec: str) -> bool:
    """Whether ``value`` lies in ``spec``: intervals such as "[0, 1)" or "(0, inf]" and single
    numbers, joined by " or ". NaN lies in none."""
    for part in spec.split(" or "):
        if part[0] not in "[(":
            if value == float(part):
                return True
            continue
        low, high = (float(x) for x in part[1:-1].split(","))
        above = value >= low if part[0] == "[" else value > low
        below = value <= high if part[-1] == "]" else value < high
        if above and below:
            return True
    return False


def check_number(name: str, x, valid: str) -> None:
    """Raise ValueError unless ``x`` is a real number (a Python or NumPy one, or a one-element
    tensor; not a bool, a string or None) in the interval ``valid``, e.g. "[0, 1]" or "(0, inf)"."""
    if isinstance(x, torch.Tensor) and x.numel() == 1 and not x.is_complex():
        x = x.item()
    if isinstance(x, bool) or not isinstance(x, numbers.Real):
        raise ValueError(f"{name} must be a number in {valid}, got {x!r}")
    if not in_range(float(x), valid):
        raise ValueError(f"{name} must be in {valid}, got {x}")


def check_flag(name: str, x) -> None:
    """Raise ValueError unless ``x`` is a bool (a string such as "false" would read as true)."""
    if not isinstance(x, bool):
        raise ValueError(f"{name} must be True or False, got {x!r}")


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
    violations: dict[str, torch.Tensor] | None = None,
) -> None:
    """Run all value checks of one call with a single host sync (none inside ``value_checks(False)``,
    nor inside a function that :func:`checks_once` its own inputs).

    Args:
        masks: name -> mask tensor that must hold only 0 and 1.
        finite: name -> tensor that must be finite (NaN and inf are refused).
        min_valid: (name, mask, k): the mask must have at least k ones in total.
        where: if given, a 0/1 mask: ``finite`` and ``nonnegative`` are only required where
            it is 1 (padding may hold anything, since masked reductions never read it).
        nonnegative: name -> tensor that must be >= 0 (e.g. importance weights).
        violations: message -> bool tensor that must be all False (e.g. token ids out of range).
    """
    if not _VALUE_CHECKS.get() or _CHECKED_DEPTH.get() > 1:
        return
    named = {**(masks or {}), **(finite or {}), **(nonnegative or {}), **(violations or {})}
    if min_valid is not None:
        named[min_valid[0]] = min_valid[1]
    for name, t in named.items():
        if t.is_meta:
            raise ValueError(f"{name} is on the meta device: it holds no values to compute with")
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
    for message, t in (violations or {}).items():
        labels.append(message)
        flags.append(t.any())
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
