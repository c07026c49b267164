"""Named plug-ins imported on first use: one mechanism for every registry in the project
(publishers, secondary tiers, cache policies).

An entry is ``name -> (module path, class name)``; nothing is imported until the class is
asked for, so an out-of-tree plug-in costs nothing until it is used. Every failure is one
:class:`~kvevents.errors.ConfigError` naming the entry and what is known.
"""

from __future__ import annotations

import importlib

from .errors import ConfigError

__all__ = ["LazyRegistry"]


class LazyRegistry:
    """``what`` names the kind of entry in messages ("publisher", "cache policy", ...);
    ``base``, if given, is the class every entry must subclass; ``known_label`` heads the list
    of names in messages; ``hint`` is appended to the unknown-name message."""

    __slots__ = ("what", "base", "known_label", "hint", "entries")

    def __init__(self, what: str, entries: dict[str, tuple[str, str]] | None = None, *, base: type | None = None,
                 known_label: str = "known", hint: str = "") -> None:
        self.what = what
        self.base = base
        self.known_label = known_label
        self.hint = hint
        self.entries: dict[str, tuple[str, str]] = {}
        for name, (module_path, class_name) in (entries or {}).items():
            self.register(name, module_path, class_name)

    def register(self, name: str, module_path: str, class_name: str) -> None:
        """Add ``name``; the module is imported when the class is first asked for. Duplicates are rejected."""
        if not isinstance(name, str) or not name:
            raise ConfigError(f"{self.what} name must be a non-empty string, got {name!r}")
        if name in self.entries:
            module, cls = self.entries[name]
            raise ConfigError(f"{self.what} {name!r} is already registered ({module}.{cls})")
        self.entries[name] = (module_path, class_name)

    def names(self) -> list[str]:
        return sorted(self.entries)

    def known(self) -> str:
        """``"<known_label>: a, b"``, for messages."""
        return f"{self.known_label}: {', '.join(self.names()) or '(none)'}"

    def get(self, name: str) -> type:
        """The class registered as ``name`` (imported now if it was not yet)."""
        entry = self.entries.get(name) if isinstance(name, str) else None
        if entry is None:
            raise ConfigError(f"unknown {self.what} {name!r}; {self.known()}{self.hint}")
        return self.load(name, *entry)

    def load(self, name: str, module_path: str, class_name: str) -> type:
        """``module_path.class_name``, checked, for the entry ``name`` (registered or not)."""
        try:
            module = importlib.import_module(module_path)
        except Exception as exc:
            raise ConfigError(f"{self.what} {name!r} cannot be loaded: cannot import module {module_path!r} "
                              f"({exc!r}); {self.known()}") from exc
        cls = getattr(module, class_name, None)
        if cls is None:
            raise ConfigError(f"{self.what} {name!r} cannot be loaded: module {module_path!r} has no class "
                              f"{class_name!r}; {self.known()}")
        if self.base is not None and not (isinstance(cls, type) and issubclass(cls, self.base)):
            raise ConfigError(f"{self.what} {name!r}: {module_path}.{class_name} is not a {self.base.__name__}")
        return cls
