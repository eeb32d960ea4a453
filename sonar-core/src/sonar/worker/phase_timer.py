"""Host time spent in the parts of a step, for benchmarks: the parts are named methods, wrapped
while timing is on (nothing is paid while it is off)."""

from __future__ import annotations

import time
from typing import Any


class PhaseTimer:
    """Adds up the host seconds spent in ``obj.attr`` under ``label`` for each target while
    enabled. Targets are ``(object, method name, label)``; a class works as an object (its
    method is then timed for every instance)."""

    def __init__(self) -> None:
        self.totals: dict[str, float] = {}
        self._originals: list[tuple[Any, str, Any, bool]] = []

    @property
    def enabled(self) -> bool:
        return bool(self._originals)

    def enable(self, targets: list[tuple[Any, str, str]]) -> None:
        self.disable()
        for obj, attr, label in targets:
            original = getattr(obj, attr)
            own = attr in getattr(obj, "__dict__", {})

            def timed(*args: Any, _original: Any = original, _label: str = label, **kwargs: Any) -> Any:
                started = time.perf_counter()
                try:
                    return _original(*args, **kwargs)
                finally:
                    self.totals[_label] = self.totals.get(_label, 0.0) + time.perf_counter() - started

            raw = obj.__dict__[attr] if own and isinstance(obj, type) else original
            self._originals.append((obj, attr, raw, own))
            setattr(obj, attr, staticmethod(timed) if isinstance(obj, type) and isinstance(raw, (staticmethod, classmethod)) else timed)

    def disable(self) -> None:
        for obj, attr, original, own in reversed(self._originals):
            if own:
                setattr(obj, attr, original)
            else:
                delattr(obj, attr)
        self._originals = []

    def take(self) -> dict[str, float]:
        """The seconds per label since the last ``take`` (and start again from zero)."""
        totals, self.totals = self.totals, {}
        return totals
