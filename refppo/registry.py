"""Registries by name for the pieces a researcher swaps: advantage estimators, policy losses and
KL estimators.

A registry fixes the keywords its callers pass (``inputs``), as verl 0.9's do: every policy loss is
called as ``fn(old_log_prob=, log_prob=, advantages=, response_mask=, loss_agg_mode=, config=,
rollout_is_weights=)``, so a loss written for verl's registry runs here unchanged. A function also
says which settings it reads from its ``config`` (``reads``), so that a setting no chosen function
reads is refused rather than ignored.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable

from refppo.guards.checks import check_choice


class Registry:
    """Functions of one kind (e.g. "policy loss") by name.

    Args:
        kind: what the functions are, as errors name them.
        inputs: the keywords every caller passes; a registered function must accept each of them.
    """

    def __init__(self, kind: str, inputs: tuple[str, ...] = ()):
        self.kind = kind
        self.inputs = inputs
        self._fns: dict[str, Callable] = {}
        self._reads: dict[str, tuple[str, ...] | None] = {}
        self._aggregates: dict[str, str | None] = {}

    def register(
        self, *names: str, reads: tuple[str, ...] | None = None, aggregates: str | None = None
    ) -> Callable[[Callable], Callable]:
        """Decorator: register a function under one or more names (aliases).

        Args:
            names: the names it is chosen by in the config.
            reads: the settings it reads from its ``config``, by their names in the config's section
                (e.g. ``("clip_ratio", "clip_ratio_low")``); None (a function that does not say)
                lets every such setting through.
            aggregates: for a loss that aggregates with one mode whatever ``loss_agg_mode`` it is
                given (verl's GSPO and SAPO), that mode, or ``refppo.losses.ROW_MEAN`` for a mean over
                the rows (GMPO's); None: the mode it is given.
        """

        def decorator(fn: Callable) -> Callable:
            for name in names:
                if self._fns.get(name, fn) is not fn:
                    raise ValueError(f"{self.kind} {name!r} is already registered")
            params = inspect.signature(fn).parameters
            takes_any = any(p.kind is p.VAR_KEYWORD for p in params.values())
            missing = [name for name in self.inputs if name not in params and not takes_any]
            if missing:
                raise ValueError(
                    f"{self.kind} {fn.__name__} must accept {', '.join(self.inputs)} by keyword; it lacks "
                    f"{', '.join(missing)}"
                )
            for name in names:
                self._fns[name] = fn
                self._reads[name] = reads
                self._aggregates[name] = aggregates
            return fn

        return decorator

    def names(self) -> tuple[str, ...]:
        """Every registered name, in registration order."""
        return tuple(self._fns)

    def get(self, name: str) -> Callable:
        """The function registered as ``name``; ValueError listing the names otherwise."""
        check_choice(self.kind, name, self._fns)
        return self._fns[name]

    def reads(self, name: str, setting: str) -> bool:
        """Whether the function registered as ``name`` reads ``setting`` (True when it did not say)."""
        self.get(name)
        declared = self._reads[name]
        return declared is None or setting in declared

    def aggregation(self, name: str, loss_agg_mode: str) -> str:
        """The mode the loss registered as ``name`` aggregates with when given ``loss_agg_mode``."""
        self.get(name)
        return self._aggregates[name] or loss_agg_mode

    def readers(self, setting: str) -> tuple[str, ...]:
        """The names whose functions declare that they read ``setting``."""
        return tuple(name for name, declared in self._reads.items() if declared is not None and setting in declared)


class ConfigView(dict):
    """Settings read both as ``config.name`` and ``config["name"]`` / ``config.get(name, default)``,
    as verl reads its configs; what a registered function receives as ``config``."""

    def __getattr__(self, name: str):
        try:
            return self[name]
        except KeyError:
            raise AttributeError(f"the config has no setting {name!r}") from None
