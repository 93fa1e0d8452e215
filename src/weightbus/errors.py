"""The error tree of weightbus: every failure a caller can act on has a type and structured fields.

Library errors derive from ``WeightbusError`` and, where the meaning matches, from a builtin::

    WeightbusError
    ├── InvalidPolicyError (ValueError)       policy id is not a single NATS subject token
    ├── InvalidEventError (ValueError)        a payload failed the typed decode at the bus boundary
    ├── BusError
    │   ├── BusConnectError (ConnectionError) NATS could not be reached or used; ``cause`` says why
    │   │   └── StreamConfigError             the WEIGHTBUS stream exists but lacks what weightbus needs
    │   ├── BusConfigError (ValueError)       connection options that cannot work (a missing file, ...)
    │   ├── StreamNotFoundError               the WEIGHTBUS stream does not exist (never created, or deleted)
    │   ├── PermissionDeniedError             the server refused a publish or subscribe for this user
    │   ├── PublishError                      the bus refused or could not confirm a publish
    │   │   └── SequenceConflictError         a conditional publish lost: the subject moved on
    │   └── SlowConsumerError                 a subscriber fell behind its bounded queue
    ├── NatsServerNotFound (FileNotFoundError) no nats-server binary to run an embedded server with
    ├── NatsServerStartError (RuntimeError)   an embedded nats-server exited or did not become ready
    ├── FencedError                           another publisher owns the policy's counter
    ├── OwnerAliveError                       a manual publish would fence an owner that is alive
    ├── TrackerNotReadyError                  a tracker does not know the current state (starting, deaf)
    ├── EngineError                           an SGLang engine answered with an error or not at all
    │   └── EngineOutOfSyncError              an engine does not serve the version it was stamped with
    ├── VersionRegressionError                a tracker in ``raise`` mode saw a lower version
    ├── EventLoopError (ValueError)           ``WEIGHTBUS_EVENT_LOOP`` names a loop that cannot be used
    ├── TaskLoadError (ValueError)            a ``--task`` import path names no task factory
    ├── NoRolloutError (ConnectionError)      no rollout process serves the policy's batch subject
    └── DemoError (RuntimeError)              a demo process failed to start or died unasked

Each error is defined here and nowhere else; the modules that raise one also re-export it under its old
import path (``weightbus.embedded.server.NatsServerNotFound``, ``weightbus.process.demo.DemoError``, ...).

Translation from nats-py and msgspec errors happens in ``weightbus.bus`` only; from httpx errors in
``weightbus.engines`` only.
"""

from __future__ import annotations

__all__ = [
    "BusConfigError",
    "BusConnectError",
    "BusError",
    "DemoError",
    "EngineError",
    "EngineOutOfSyncError",
    "EventLoopError",
    "FencedError",
    "InvalidEventError",
    "InvalidPolicyError",
    "NatsServerNotFound",
    "NatsServerStartError",
    "NoRolloutError",
    "OwnerAliveError",
    "PermissionDeniedError",
    "PublishError",
    "SequenceConflictError",
    "SlowConsumerError",
    "StreamConfigError",
    "StreamNotFoundError",
    "TaskLoadError",
    "TrackerNotReadyError",
    "VersionRegressionError",
    "WeightbusError",
]


class WeightbusError(Exception):
    """Root of every error raised by weightbus."""


class InvalidPolicyError(WeightbusError, ValueError):
    """A policy id that cannot be a single NATS subject token (empty, dots, spaces, wildcards)."""

    def __init__(self, policy: str, why: str) -> None:
        self.policy = policy
        self.why = why
        super().__init__(f"invalid policy id {policy!r}: {why}")


class InvalidEventError(WeightbusError, ValueError):
    """A payload that is not a valid event of its subject's family.

    Attributes:
        subject: the NATS subject it arrived on.
        family: the subject family (``weights``, ``applied``, ``alerts``, ``drains``) or ``unknown``.
        reason: a low-cardinality label: ``malformed``, ``invalid``, ``oversized``, ``unknown_subject``.
        detail: the decoder's message, e.g. ``Expected `int` >= 0 - at `$.version```.
    """

    def __init__(self, subject: str, family: str, reason: str, detail: str) -> None:
        self.subject = subject
        self.family = family
        self.reason = reason
        self.detail = detail
        super().__init__(f"invalid {family} event on {subject!r} ({reason}): {detail}")


class BusError(WeightbusError):
    """A failure of the message bus itself."""


class BusConnectError(BusError, ConnectionError):
    """NATS at ``url`` could not be reached or used.

    Attributes:
        url: the URL, with any password or token already replaced by ``***``.
        detail: what happened.
        cause: a short label: ``refused``, ``dns``, ``auth``, ``tls``, ``no_jetstream``, ``timeout``,
            ``permission``, ``stream`` or ``config``.
    """

    def __init__(self, url: str, detail: str, cause: str = "timeout") -> None:
        self.url = url
        self.detail = detail
        self.cause = cause
        super().__init__(f"cannot connect to NATS at {url}: {detail}")


class StreamConfigError(BusConnectError):
    """The stream exists but does not give weightbus what it relies on; it was left unchanged.

    Attributes:
        stream: the stream name.
        mismatches: one line per problem, e.g. ``max_msgs_per_subject is 8, needs at least 256``.
    """

    def __init__(self, url: str, stream: str, mismatches: list[str]) -> None:
        self.stream = stream
        self.mismatches = list(mismatches)
        super().__init__(
            url,
            f"stream {stream} does not fit weightbus: {'; '.join(mismatches)} "
            "(left unchanged; an admin fixes it with `weightbus stream create`)",
            cause="stream",
        )


class BusConfigError(BusError, ValueError):
    """Connection options that cannot work: a missing creds or certificate file, a password without a user."""


class StreamNotFoundError(BusError):
    """The stream weightbus reads does not exist on the server: it was never created, or it was deleted.

    Attributes:
        url: the server's URL (secrets redacted).
        stream: the stream name.
    """

    def __init__(self, url: str, stream: str) -> None:
        self.url = url
        self.stream = stream
        super().__init__(
            f"stream {stream} does not exist on {url} (deleted? an admin recreates it with `weightbus stream create`)"
        )


class PermissionDeniedError(BusError):
    """The NATS server refused an action for this user (its permissions do not allow it).

    Attributes:
        action: ``publish`` or ``subscribe``.
        subject: the subject that was refused.
    """

    def __init__(self, action: str, subject: str, detail: str = "") -> None:
        self.action = action
        self.subject = subject
        extra = f" ({detail})" if detail else ""
        super().__init__(f"permission denied: this NATS user may not {action} to {subject!r}{extra}")


class PublishError(BusError):
    """The bus refused a publish, or could not confirm it after every retry."""

    def __init__(self, subject: str, reason: str) -> None:
        self.subject = subject
        self.reason = reason
        super().__init__(f"publish to {subject!r} failed: {reason}")


class SequenceConflictError(PublishError):
    """A conditional publish expected the subject's last sequence to be ``expected``; it had moved on."""

    def __init__(self, subject: str, expected: int) -> None:
        self.expected = expected
        super().__init__(subject, f"the subject's last sequence is no longer {expected}")


class SlowConsumerError(BusError):
    """A subscriber's bounded queue overflowed; events were not silently dropped but this was raised."""

    def __init__(self, subject: str, limit: int) -> None:
        self.subject = subject
        self.limit = limit
        super().__init__(f"subscriber on {subject!r} fell more than {limit} events behind")


class FencedError(WeightbusError):
    """Another publisher has taken over the policy's version counter; nothing was published.

    Attributes:
        policy: the policy id.
        owner: the trainer id that holds the counter now.
        epoch: the owner's epoch.
        version: the latest version on the bus (None if the owner has not published one yet).
    """

    def __init__(self, policy: str, owner: str, epoch: int, version: int | None) -> None:
        self.policy = policy
        self.owner = owner
        self.epoch = epoch
        self.version = version
        at = "no version yet" if version is None else f"version {version}"
        super().__init__(f"policy {policy!r} was taken over by {owner!r} (epoch {epoch}, {at}); nothing was published")


class TrackerNotReadyError(WeightbusError):
    """A tracker cannot say what the current version is: it has not replayed the stream yet, the
    stream holds no valid event, or its subscription is lost. Nothing may be judged against it.

    Attributes:
        policy: the policy id.
        status: the tracker's status (``starting``, ``no_valid_version``, ``deaf``).
    """

    def __init__(self, policy: str, status: str, detail: str = "") -> None:
        self.policy = policy
        self.status = status
        suffix = f": {detail}" if detail else ""
        super().__init__(f"the version tracker of {policy!r} is not ready ({status}){suffix}")


class EngineError(WeightbusError):
    """An SGLang engine answered with an error status, an unexpected body, or not at all."""

    def __init__(self, url: str, status: int | None, message: str) -> None:
        self.url = url
        self.status = status
        self.message = message
        where = f"HTTP {status}" if status is not None else "no response"
        super().__init__(f"engine {url}: {where}: {message}")


class EngineOutOfSyncError(EngineError):
    """An engine read back a different ``weight_version`` than it was stamped with."""

    def __init__(self, url: str, expected: str, actual: str) -> None:
        self.expected = expected
        self.actual = actual
        super().__init__(url, 200, f"stamped weight_version {expected!r} but /model_info reports {actual!r}")


class VersionRegressionError(WeightbusError):
    """A tracker in ``regression="raise"`` mode saw a lower version than the one it holds."""

    def __init__(self, policy: str, current: int, incoming: int, publisher: str) -> None:
        self.policy = policy
        self.current = current
        self.incoming = incoming
        self.publisher = publisher
        super().__init__(
            f"policy {policy!r}: version went back from {current} to {incoming} (published by {publisher!r})"
        )


class NatsServerNotFound(WeightbusError, FileNotFoundError):
    """No ``nats-server`` binary was found for an embedded server; the message says how to get one."""


class NatsServerStartError(WeightbusError, RuntimeError):
    """An embedded nats-server exited or did not become ready; ``reason`` holds what it logged (the port in use)."""

    def __init__(self, message: str, reason: str = "") -> None:
        self.reason = reason
        super().__init__(f"{message}: {reason}" if reason else message)


class OwnerAliveError(WeightbusError):
    """A manual publish found the counter's owner alive (it published recently); ``--takeover`` fences it.

    Attributes:
        policy: the policy id.
        owner: the trainer id that holds the counter.
        age: seconds since the owner's last event.
        window: the ``--alive-window`` it was compared with.
    """

    def __init__(self, policy: str, owner: str, age: float, window: float) -> None:
        self.policy = policy
        self.owner = owner
        self.age = age
        self.window = window
        super().__init__(
            f"policy {policy!r} is owned by {owner!r}, alive ({age:.1f}s since its last event < --alive-window "
            f"{window:g}s); pass --takeover to fence it, or wait; nothing was published"
        )


class EventLoopError(WeightbusError, ValueError):
    """``WEIGHTBUS_EVENT_LOOP`` names an unknown loop, or uvloop was asked for and does not import."""


class TaskLoadError(WeightbusError, ValueError):
    """A ``--task`` import path that does not name a task factory."""


class NoRolloutError(WeightbusError, ConnectionError):
    """No rollout process is subscribed to the policy's batch subject."""


class DemoError(WeightbusError, RuntimeError):
    """A process of the demo failed to start or died without being asked to."""
