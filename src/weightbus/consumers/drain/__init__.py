"""The drain: generated groups buffered, judged with ``weightbus.rules.staleness`` when taken, routed.

Every host goes through one engine, ``DrainWindow``; nothing here follows the bus (the version source is passed in).
"""

from weightbus.consumers.drain.buffer import CurrentSource, Drain, FullyAsyncBuffer, buffer_capacity, resolve_current
from weightbus.consumers.drain.decisions import Action, Decision, DrainStats, Judgement
from weightbus.consumers.drain.metrics import STALENESS_BUCKETS, DrainMetrics, StalenessMetrics
from weightbus.consumers.drain.reports import DrainReporter, to_drain_report
from weightbus.consumers.drain.stage import OnStale, StalenessStage, judge_groups
from weightbus.consumers.drain.tally import DrainTally
from weightbus.consumers.drain.window import VERSION_STATES, DrainWindow

__all__ = [
    "STALENESS_BUCKETS",
    "VERSION_STATES",
    "Action",
    "CurrentSource",
    "Decision",
    "Drain",
    "DrainMetrics",
    "DrainReporter",
    "DrainStats",
    "DrainTally",
    "DrainWindow",
    "FullyAsyncBuffer",
    "Judgement",
    "OnStale",
    "StalenessMetrics",
    "StalenessStage",
    "buffer_capacity",
    "judge_groups",
    "resolve_current",
    "to_drain_report",
]
