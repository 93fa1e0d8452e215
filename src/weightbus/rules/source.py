"""``VersionSource``: where a reader of the current version gets it, and the one way to read it.

A version source is a tracker (an object with a ``.current`` property, ``VersionSource``), a plain ``int``
or None, or a zero-argument callable returning one. The drain, the admission gate, the rollout and the
integrations read it through ``version_reader`` / ``read_version``, so neither needs the tracker's type.

Invariants:

* a read yields a non-bool ``int`` >= 0 or None: another type raises ``TypeError``, a negative int
  ``ValueError``;
* a tracker's ``.current`` is read exactly once per read, and its presence is looked up without reading it
  (a tracker that is not ready raises from the property);
* ``version_or_none`` turns a source that cannot say (any ``WeightbusError``) into None, never a guess.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol, TypeAlias, runtime_checkable

from weightbus.errors import WeightbusError

__all__ = ["CurrentSource", "VersionSource", "checked_version", "read_version", "version_or_none", "version_reader"]


@runtime_checkable
class VersionSource(Protocol):
    """An object that holds the current version (a ``VersionTracker``).

    Note: on Python 3.11 ``isinstance`` reads the property; ``version_reader`` does not.
    """

    @property
    def current(self) -> int | None:
        """The current version (None: never published); raises ``TrackerNotReadyError`` when it cannot say."""
        ...


#: What a version reader accepts: a ``VersionSource``, an ``int`` or None, or a callable returning one.
CurrentSource: TypeAlias = VersionSource | int | None | Callable[[], int | None]


def checked_version(value: object) -> int | None:
    """``value`` if it is a version (a non-bool ``int`` >= 0) or None.

    Raises:
        TypeError: not an int or None (a bool is not a version).
        ValueError: a negative int.
    """
    if value is None:
        return None
    if type(value) is not int:
        raise TypeError(f"a current version must be an int or None, got {type(value).__name__}")
    if value < 0:
        raise ValueError(f"a current version must be >= 0, got {value}")
    return value


def _has_current(source: object) -> bool:
    # Looked up on the type (or the instance dict): reading a tracker's property here could raise.
    return hasattr(type(source), "current") or "current" in getattr(source, "__dict__", ())


def version_reader(source: CurrentSource) -> Callable[[], int | None]:
    """A zero-argument reader of ``source``'s version, each call one read (see the module's invariants).

    Raises:
        TypeError, ValueError: ``source`` is a bad constant, or none of the accepted kinds.
    """
    if source is None or isinstance(source, int):
        value = checked_version(source)
        return lambda: value
    if _has_current(source):
        return lambda: checked_version(source.current)  # type: ignore[union-attr]
    if callable(source):
        return lambda: checked_version(source())
    raise TypeError(f"a version source is an int, None, a callable or an object with .current, got {source!r}")


def read_version(source: CurrentSource) -> int | None:
    """Read ``source``'s version once.

    Raises:
        TypeError, ValueError: as ``version_reader`` and ``checked_version``.
        TrackerNotReadyError: (from a tracker) it cannot say yet.
    """
    return version_reader(source)()


def version_or_none(source: CurrentSource) -> int | None:
    """Read ``source``'s version once; None when it cannot say (a ``WeightbusError``: a tracker not ready)."""
    try:
        return read_version(source)
    except WeightbusError:
        return None
