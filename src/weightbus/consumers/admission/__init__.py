"""Admission on the rollout side: a group starts generating only while it can still be trained within the bound.

``Admission`` is the gate (``off``, ``cap``, or ``bounded``, the default: ``rules.admission``), ``Slot`` a
group's place in it, ``AcceptedGroups`` the slots of buffered groups that a drain settles, ``SharedBudget``
one budget for several rollout processes of a policy, kept on the bus (``weightbus.<policy>.admission``), and
``AdmissionMetrics`` its metrics.
Like the tracker and the drain, this subpackage imports neither of them: the version comes from a source
passed in (a tracker, an int, a callable), and the drain settles slots through a protocol of its own.
"""

from weightbus.consumers.admission.accepted import AcceptedGroups
from weightbus.consumers.admission.gate import Admission, Outcome, Slot
from weightbus.consumers.admission.metrics import AdmissionMetrics
from weightbus.consumers.admission.shared import SharedBudget
from weightbus.rules.admission import ADMISSION_MODES, AdmissionMode

__all__ = [
    "ADMISSION_MODES",
    "AcceptedGroups",
    "Admission",
    "AdmissionMetrics",
    "AdmissionMode",
    "Outcome",
    "SharedBudget",
    "Slot",
]
