"""One name -> class registry type, for every extension point that is picked by name in a config
(action-module kinds, simulators, backbone families): LeRobot's ``register_subclass`` habit.

A registry is filled by its ``register(name)`` class decorator where each class is defined, and
read by name. An unknown name is an error that names the field, the value and the registered
names, so a config error says what is allowed.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any, Generic, TypeVar

__all__ = ["Registry", "UnknownName"]

T = TypeVar("T")
_C = TypeVar("_C")
_MISSING: Any = object()


class UnknownName(ValueError):
    """A name that is not registered (a ValueError, so pydantic validators report it as a field error)."""


class Registry(Generic[T]):
    """Registered classes by name. ``base`` is the class every entry must subclass; ``field`` and
    ``noun`` word the errors (``kind='x' is not a registered action module; allowed kinds: [...]``);
    ``name_attribute``, when given, is set on each registered class to its name."""

    def __init__(self, base: type[T], *, field: str, noun: str, plural: str, name_attribute: str | None = None):
        self.base = base
        self.field = field
        self.noun = noun
        self.plural = plural
        self.name_attribute = name_attribute
        self._entries: dict[str, type[T]] = {}

    def register(self, name: str) -> Callable[[_C], _C]:
        """Class decorator: register ``cls`` under ``name``. Re-registering the same class (a module
        reload, a spawned worker re-importing) is fine; two classes under one name are a bug."""

        def decorator(cls: _C) -> _C:
            if not (isinstance(cls, type) and issubclass(cls, self.base)):
                raise TypeError(f"@register({name!r}) must decorate a {self.base.__name__} subclass, got {cls!r}")
            existing = self._entries.get(name)
            if existing is not None and (existing.__module__, existing.__qualname__) != (
                cls.__module__,
                cls.__qualname__,
            ):
                raise ValueError(f"{self.noun} {name!r} is already registered to {existing.__qualname__}")
            if self.name_attribute is not None:
                setattr(cls, self.name_attribute, name)
            self._entries[name] = cls
            return cls

        return decorator

    def available(self) -> list[str]:
        """Registered names, sorted."""
        return sorted(self._entries)

    def unknown(self, name: str) -> UnknownName:
        """The error for an unregistered ``name``: the field, the value and the allowed names."""
        return UnknownName(
            f"{self.field}={name!r} is not a registered {self.noun}; allowed {self.plural}: {self.available()}"
        )

    def get(self, name: str, default: Any = _MISSING) -> type[T]:
        """The class registered under ``name``; without a ``default``, an unknown name raises ``unknown``."""
        found = self._entries.get(name)
        if found is None:
            if default is _MISSING:
                raise self.unknown(name)
            return default
        return found

    # Mapping-style access, so callers (and tests' monkeypatch.setitem) can treat it as a dict.
    def __getitem__(self, name: str) -> type[T]:
        return self.get(name)

    def __setitem__(self, name: str, cls: type[T]) -> None:
        self._entries[name] = cls

    def __delitem__(self, name: str) -> None:
        del self._entries[name]

    def __contains__(self, name: object) -> bool:
        return name in self._entries

    def __iter__(self) -> Iterator[str]:
        return iter(self._entries)

    def __len__(self) -> int:
        return len(self._entries)

    def items(self) -> list[tuple[str, type[T]]]:
        return list(self._entries.items())

    def __repr__(self) -> str:
        return f"Registry({self.noun}: {self.available()})"
