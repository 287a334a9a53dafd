"""The trainer's optimizer: ``torch.optim.Adam``, without importing ``torch._dynamo``.

Why: torch wraps ``Optimizer.add_param_group`` (called by the constructor),
``load_state_dict``, ``state_dict`` and ``zero_grad`` in ``torch._disable_dynamo`` and
``step`` in ``_use_grad_for_differentiable``, and both import ``torch._dynamo`` (with
sympy, torch.fx, torch.distributed.fsdp, ...) on first call: 1.5-2 s of CPU, on the path
from a trainer's launch to its first redispatch (building the optimizer, loading its state on
restore, retraining a snapshot's replay steps). The trainer never compiles, and nothing can
be compiling while ``torch._dynamo`` is not even imported, so those wrappers do nothing but
the import: "disable dynamo" disables nothing, a graph break breaks no graph. ``EagerAdam``
calls the wrapped functions themselves (``__wrapped__``, set by ``functools.wraps``) while
``torch._dynamo`` is absent, keeping ``step``'s one effect besides the import (grad mode set
to the optimizer's ``differentiable`` default); once anything imports ``torch._dynamo``, or
on a torch whose wrappers lack ``__wrapped__``, it calls torch's methods unchanged. The math
is Adam's own: the weights are bit-identical (``tests/runtime/algorithms/test_optimizer.py``),
and the state dict is Adam's.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterable
from typing import Any

import torch

DYNAMO = "torch._dynamo"


def _eager(method: Callable[..., Any]) -> Callable[..., Any] | None:
    """The function torch's wrapper calls, while no compilation can be running; else None."""
    if DYNAMO in sys.modules:
        return None
    return getattr(method, "__wrapped__", None)


class EagerAdam(torch.optim.Adam):
    """``torch.optim.Adam`` that does not import ``torch._dynamo`` (see the module doc)."""

    def _call(self, name: str, *args: Any) -> Any:
        """Adam's method ``name``: its wrapped function while that is safe, else torch's."""
        eager = _eager(getattr(torch.optim.Adam, name))
        if eager is None:
            return getattr(super(), name)(*args)
        return eager(self, *args)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        self._call("add_param_group", param_group)

    def zero_grad(self, set_to_none: bool = True) -> None:
        self._call("zero_grad", set_to_none)

    def state_dict(self) -> dict[str, Any]:
        return self._call("state_dict")

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._call("load_state_dict", state_dict)

    def step(self, closure: Callable[[], float] | None = None) -> Any:
        if _eager(torch.optim.Adam.step) is None:
            return super().step(closure)
        # the one effect of torch's step wrapper besides the import: its grad mode
        with torch.set_grad_enabled(self.defaults["differentiable"]):
            return self._call("step", closure)


def build_optimizer(parameters: Iterable[torch.nn.Parameter], lr: float) -> EagerAdam:
    """The trainer's Adam over ``parameters`` at learning rate ``lr``."""
    return EagerAdam(parameters, lr=lr)
