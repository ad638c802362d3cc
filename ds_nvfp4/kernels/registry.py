"""The GEMM backends, registered by their own files: name, preference and availability rule in one place.

A backend file declares itself with :func:`register` on its :class:`~ds_nvfp4.kernels.base.GemmBackend` subclass::

    @register(preference=10, available=my_rule)   # my_rule(DeviceInfo) -> (ok, why)
    class MyBackend(GemmBackend):
        name = "my_backend"

and is imported by ``kernels/__init__.py``. Everything else derives from this registry: the names
``precision.kernel`` accepts (config/schema.py), the order ``kernel: null`` tries them in and the availability
table of ``ds-nvfp4 env`` (kernels/select.py). docs/architecture.md walks through adding one.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .base import GemmBackend
    from .device import DeviceInfo

#: ``(ok, why)``: whether a backend can run on a device, and the reason in words
Availability = tuple[bool, str]


@dataclass(frozen=True)
class BackendSpec:
    """One registered backend. ``preference``: lower is tried first when ``precision.kernel`` is null."""

    name: str
    preference: int
    available: Callable[[DeviceInfo], Availability]
    cls: type[GemmBackend]


_SPECS: dict[str, BackendSpec] = {}


def register(*, preference: int, available: Callable[[DeviceInfo], Availability]):
    """Class decorator: add a :class:`GemmBackend` subclass (its ``name``) to the registry."""

    def add(cls: type[GemmBackend]) -> type[GemmBackend]:
        name = cls.name
        if name in _SPECS and _SPECS[name].cls is not cls:
            raise ValueError(f"GEMM backend {name!r} is registered twice ({_SPECS[name].cls.__qualname__} and "
                             f"{cls.__qualname__})")
        _SPECS[name] = BackendSpec(name, preference, available, cls)
        return cls

    return add


def specs() -> list[BackendSpec]:
    """Every registered backend, most preferred first (importing this module imports ``ds_nvfp4.kernels`` first,
    whose ``__init__`` imports every backend file: the registry is full by the time anyone reads it)."""
    return sorted(_SPECS.values(), key=lambda s: (s.preference, s.name))


def names() -> tuple[str, ...]:
    """The names ``precision.kernel`` accepts, most preferred first."""
    return tuple(s.name for s in specs())

