"""Registries by name for the pieces a researcher swaps: advantage estimators, policy losses and
KL estimators.

A registered function states the inputs it needs by its parameter names. The caller offers every
input it has, by name, and each function receives exactly those it declares: adding an estimator
or a loss is one decorated function, and what it needs (a critic's ``values``, a group ``index``,
``rollout_is_weights``) is read from its signature, never written down a second time.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from types import MappingProxyType
from typing import Any

from refppo.guards.checks import check_choice


@functools.cache
def _parameters(fn: Callable) -> MappingProxyType:
    # Read once per function: call() runs for every micro-batch, and a signature costs ~40 us.
    return inspect.signature(fn).parameters


class Registry:
    """Functions of one kind (e.g. "advantage estimator") by name."""

    def __init__(self, kind: str):
        self.kind = kind
        self._fns: dict[str, Callable] = {}

    def register(self, *names: str) -> Callable[[Callable], Callable]:
        """Decorator: register a function under one or more names (aliases)."""

        def decorator(fn: Callable) -> Callable:
            for name in names:
                if self._fns.get(name, fn) is not fn:
                    raise ValueError(f"{self.kind} {name!r} is already registered")
            for param in _parameters(fn).values():
                if param.kind in (param.VAR_POSITIONAL, param.VAR_KEYWORD):
                    raise ValueError(f"{self.kind} {fn.__name__}: name every input it takes (no *args or **kwargs)")
            self._fns.update(dict.fromkeys(names, fn))
            return fn

        return decorator

    def names(self) -> tuple[str, ...]:
        """Every registered name, in registration order."""
        return tuple(self._fns)

    def get(self, name: str) -> Callable:
        """The function registered as ``name``; ValueError listing the names otherwise."""
        check_choice(self.kind, name, self._fns)
        return self._fns[name]

    def takes(self, name: str, input_name: str) -> bool:
        """Whether the function registered as ``name`` declares the input ``input_name``."""
        return input_name in _parameters(self.get(name))

    def call(self, name: str, **offered: Any) -> Any:
        """Call the function registered as ``name`` with the offered inputs it declares
        (:func:`call_declared`)."""
        return call_declared(self.get(name), f"{self.kind} {name!r}", offered)


def call_declared(fn: Callable, what: str, offered: dict[str, Any]) -> Any:
    """Call ``fn`` with the inputs of ``offered`` its parameters name.

    Args:
        fn: a function whose parameters are all named (no ``*args`` or ``**kwargs``).
        what: ``fn`` as an error names it, e.g. "advantage estimator 'gae'".
        offered: every input the caller has, by name.

    Raises:
        ValueError: naming the inputs ``fn`` requires that were not offered.
    """
    params = _parameters(fn)
    missing = [p for p, v in params.items() if v.default is inspect.Parameter.empty and p not in offered]
    if missing:
        raise ValueError(f"{what} needs {', '.join(missing)}, which the caller does not have")
    return fn(**{p: offered[p] for p in params if p in offered})
