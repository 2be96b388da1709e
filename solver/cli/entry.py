"""Let a ``python -m`` entry module share its name with the API function it runs.

``solver.plan`` is both the function ``solver.plan(graph, cluster, training)`` and the module
behind ``python -m solver.plan``. Python binds a submodule to its package's attribute when the
submodule is imported, so a plain ``import solver.plan`` would replace the function with the
module. :func:`make_callable` makes such a module call the function instead, so both spellings
keep working whatever is imported first."""

from __future__ import annotations

import sys
import types
from collections.abc import Callable
from typing import Any


def make_callable(module_name: str, function: Callable[..., Any]) -> None:
    """Calling module ``module_name`` calls ``function`` (same arguments, same result)."""

    class CallableModule(types.ModuleType):
        __call__ = staticmethod(function)

    sys.modules[module_name].__class__ = CallableModule
