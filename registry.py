"""Registry: named things of one kind (schemes, algorithms, checkpoint formats, architectures).

Each kind has one Registry; a module adds to it at import time (`register`), so adding a
scheme, an algorithm or a format is adding one file. A registry may name the modules that
register its built-in entries: they are imported on the first lookup, so whoever asks first
(the CLI, the pipeline, the runtime's loader) sees them all, whatever it imported before.
"""

from __future__ import annotations

import importlib
from collections.abc import Iterator
from typing import Generic, TypeVar

from .errors import UserError

T = TypeVar("T")


class Registry(Generic[T]):
    """name -> entry, names compared case-insensitively; unknown names are one UserError
    (a ValueError) that lists the registered ones."""

    def __init__(self, kind: str, builtins: tuple[str, ...] = ()) -> None:
        self.kind = kind
        self._builtins = builtins
        self._loaded = not builtins
        self._entries: dict[str, T] = {}

    @staticmethod
    def key(name: str) -> str:
        return str(name).strip().lower()

    def register(self, name: str, entry: T, replace: bool = False) -> T:
        """Add ENTRY under NAME; ValueError if the name is taken (unless replace)."""
        key = self.key(name)
        if not key:
            raise ValueError(f"a {self.kind} needs a name")
        if key in self._entries and not replace:
            raise ValueError(f"{self.kind} {key!r} is already registered")
        self._entries[key] = entry
        return entry

    def unregister(self, name: str) -> None:
        self._entries.pop(self.key(name), None)

    def get(self, name: str) -> T:
        self._load()
        try:
            return self._entries[self.key(name)]
        except KeyError:
            raise UserError(f"unknown {self.kind} {name!r}; allowed: {', '.join(self.names())}") from None

    def names(self) -> list[str]:
        """Registered names, in registration order."""
        self._load()
        return list(self._entries)

    def values(self) -> list[T]:
        self._load()
        return list(self._entries.values())

    def __contains__(self, name: object) -> bool:
        self._load()
        return isinstance(name, str) and self.key(name) in self._entries

    def __iter__(self) -> Iterator[str]:
        return iter(self.names())

    def _load(self) -> None:
        if not self._loaded:
            self._loaded = True  # first: a built-in module that looks itself up must not recurse
            for module in self._builtins:
                importlib.import_module(module)
