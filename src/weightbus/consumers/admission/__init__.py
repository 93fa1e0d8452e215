"""Admission on the rollout side: a group starts generating only while it can still be trained within the bound.

It imports neither the tracker nor the drain: the version comes from a source passed in, and the drain settles
slots through ``AcceptedGroups``.
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
