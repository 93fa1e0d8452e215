"""``AcceptedGroups``: which buffered groups hold an accepted slot, settled as the drain routes or keeps them.

A host's buffer holds groups that were admitted; a drain keeps some and routes the others (stale, unknown,
aborted, filtered) as not to be trained. The slot of each must follow its group: freed the moment the group is
routed, counted in the window of the version it trains at when a judgement keeps it. ``DrainWindow`` calls
``unused`` and ``kept`` (its ``slots``), so every host (``weightbus rollout``, miles' buffer) settles slots by the
same mechanism, and a drain that filters a whole window frees those slots *while* it waits for fresh groups
instead of after (where the gate, still counting them, would admit nothing and the drain would wait for ever).

Invariants:

* a slot is drained exactly once (``Slot.drained`` refuses a second time); a group seen again after it was
  settled (handed back, judged again) settles nothing;
* a group that holds no slot here (aborted early, never admitted, accepted by another gate's host) is ignored;
* groups are keyed by identity and held until settled, so an identity is never reused while it counts.
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
        """A judgement at ``at`` kept ``groups``: their slots count in the window of ``at`` (they train there)."""
        for group in groups:
            held = self._held.pop(id(group), None)
            if held is not None:
                held[1].drained(kept=True, at=at)
