"""The seed API's arguments checked as a job file's fields are: a wrong one is a SpecError naming
the call, the argument, the value given and what is expected, before anything is read, planned,
written or connected (a raw ZeroDivisionError or "'str' object is not callable" from deep inside,
or a value taken silently, was what Ravnest's users got)."""

from __future__ import annotations

import inspect
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ravnest.errors import SpecError


class Arguments:
    """Collects the problems with one call's arguments (`call`: "clusterize", "Node(...)");
    `check()` raises them all at once, as a job file's are."""

    def __init__(self, call: str) -> None:
        self.call = call
        self.problems: list[str] = []

    def bad(self, name: str, value: Any, expected: str, shown: str | None = None) -> None:
        """Say that argument `name` is wrong: its value (`shown`, else its repr, cut to 80
        characters) and what is expected."""
        shown = repr(value) if shown is None else shown
        shown = shown if len(shown) <= 80 else f"{shown[:77]}..."
        self.problems.append(f"{self.call}: {name}={shown}: expected {expected}")

    def whole(self, name: str, value: Any, least: int = 1, optional: bool = False) -> None:
        """A whole number, at least `least` (None allowed when `optional`)."""
        if value is None and optional:
            return
        if type(value) is not int or value < least:
            self.bad(name, value, f"a whole number, {least} or more"
                      + (", or None" if optional else ""))

    def flag(self, name: str, value: Any) -> None:
        """True or False (1 and 0 too, as Python takes them)."""
        if not isinstance(value, bool) and not (type(value) is int and value in (0, 1)):
            self.bad(name, value, "True or False")

    def text(self, name: str, value: Any, optional: bool = False) -> None:
        if value is None and optional:
            return
        if not isinstance(value, str) or not value:
            self.bad(name, value, "a non-empty string" + (", or None" if optional else ""))

    def path(self, name: str, value: Any) -> None:
        if not isinstance(value, str | Path) or not str(value):
            self.bad(name, value, "a path (str or pathlib.Path)")

    def mapping(self, name: str, value: Any) -> None:
        """Keyword arguments for a class (None: none)."""
        if value is not None and not (isinstance(value, dict)
                                      and all(isinstance(k, str) for k in value)):
            self.bad(name, value, "a dict of keyword arguments, or None")

    def model(self, name: str, value: Any, optional: bool = False) -> None:
        if value is None and optional:
            return
        if not isinstance(value, nn.Module):
            self.bad(name, value, "a torch.nn.Module")

    def inputs(self, name: str, value: Any, optional: bool = False) -> None:
        """Example inputs: a tuple (or list) of tensors, e.g. `(torch.rand(64, 1, 28, 28),)`."""
        if optional and isinstance(value, tuple | list) and not value:
            return
        if isinstance(value, torch.Tensor):
            self.bad(name, value, "a tuple of example inputs, e.g. (x,) for one tensor x",
                     shown=f"<a Tensor of shape {tuple(value.shape)}>")
        elif (not isinstance(value, tuple | list) or not value
              or not all(isinstance(x, torch.Tensor) for x in value)):
            self.bad(name, value, "a non-empty tuple of example input tensors, e.g. "
                                   "(torch.rand(64, 1, 28, 28),)")

    def optimizer_name(self, name: str, value: Any) -> None:
        """An optimizer's name in torch.optim ("Adam", "SGD", ...)."""
        if not isinstance(value, str) or not _optimizer(value):
            self.bad(name, value, "the name of an optimizer in torch.optim, e.g. 'Adam'")

    def optimizer_class(self, name: str, value: Any) -> None:
        """An optimizer class (torch.optim.Adam) or a function making one from parameters."""
        if value is None:
            return
        if isinstance(value, str):
            self.bad(name, value, f"an optimizer class such as torch.optim.{value}, not its "
                                   f"name" if _optimizer(value) else
                      "an optimizer class such as torch.optim.Adam")
        elif isinstance(value, torch.optim.Optimizer):
            self.bad(name, value, "the optimizer's class (torch.optim.Adam), not an optimizer "
                                   "made already: the Node makes it for its own stage's "
                                   "parameters, with optimizer_params")
        elif not callable(value):
            self.bad(name, value, "an optimizer class such as torch.optim.Adam")

    def scheduler(self, name: str, value: Any) -> None:
        """A learning-rate scheduler class (None allowed)."""
        self.function(name, value,
                      "a scheduler class such as torch.optim.lr_scheduler.StepLR, or None")

    def function(self, name: str, value: Any, expected: str) -> None:
        """A callable (None allowed)."""
        if value is not None and not callable(value):
            self.bad(name, value, expected)

    def loader(self, name: str, value: Any, optional: bool = True) -> None:
        """Batches to iterate (a DataLoader, a list, ...)."""
        if value is None and optional:
            return
        if isinstance(value, str | bytes) or not isinstance(value, Iterable):
            self.bad(name, value, "a torch.utils.data.DataLoader (or any iterable of batches)"
                      + (", or None" if optional else ""))

    def check(self) -> None:
        if self.problems:
            raise SpecError(self.problems)


def _optimizer(name: str) -> bool:
    found = getattr(torch.optim, name, None)
    return inspect.isclass(found) and issubclass(found, torch.optim.Optimizer)
