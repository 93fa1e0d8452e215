"""``AcceptedGroups``: which buffered groups hold an accepted slot, settled as the drain routes or keeps them.

A routed group frees its slot at once, a kept one counts where it trains; a slot is drained exactly once; groups
are keyed by identity and held until settled; a group without a slot here is ignored.
"""

from __future__ import annotations

from collections.abc import Iterable

from weightbus.consumers.admission.gate import Slot

__all__ = ["AcceptedGroups"]


class AcceptedGroups:
    """The accepted slots of a host's buffered groups; see the module docstring."""

    __slots__ = ("_held",)

    def __init__(self) -> None:
        self._held: dict[int, tuple[object, Slot]] = {}

    def __len__(self) -> int:
        return len(self._held)

    def __contains__(self, group: object) -> bool:
        return id(group) in self._held

    def accept(self, slot: Slot, group: object) -> None:
        """``slot.accept()``: ``group`` finished and enters the buffer, holding ``slot`` until a drain settles it.

        Raises:
            AdmissionError: the slot was already accepted or released.
        """
        slot.accept()
        self._held[id(group)] = (group, slot)

    def unused(self, group: object) -> None:
        """A drain routed ``group`` as not to be trained: its slot is free now."""
        held = self._held.pop(id(group), None)
        if held is not None:
            held[1].drained(kept=False)

    def kept(self, groups: Iterable[object], at: int | None) -> None:
        """A judgement at ``at`` kept ``groups``: their slots count in the horizon of ``at`` (they train there)."""
        for group in groups:
            held = self._held.pop(id(group), None)
            if held is not None:
                held[1].drained(kept=True, at=at)
