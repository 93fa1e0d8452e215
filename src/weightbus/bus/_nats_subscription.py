"""A ``NatsBus`` subscription: a JetStream ordered push consumer read as a typed async iterator.

No server-side state; nats-py's pending queue is read directly (``max_pending`` enforced on read); closing ends its
tasks even when the connection is gone.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Final, Protocol

import nats.errors
import nats.js.errors
from nats.aio.msg import Msg
from nats.js.api import DeliverPolicy

from weightbus.bus import _natspy
from weightbus.bus._denials import Denials
from weightbus.bus._subscription import QueueSubscription
from weightbus.bus.protocol import Deliver, Envelope
from weightbus.errors import BusError

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable

    from weightbus.bus.metrics import BusMetrics


class SubscriptionHost(Protocol):
    """What a subscription uses of its bus (``NatsBus`` is one): the clients, the stream, the refusal guard."""

    client: Any
    js: Any
    stream: str
    metrics: BusMetrics
    subscriptions: list[NatsSubscription]

    async def guard(self, match: Callable[[str, str], bool], op: Awaitable[Any]) -> Any: ...


__all__ = ["TRANSIENT_INACTIVE", "NatsSubscription", "SubscriptionHost", "stream_seq"]

log = logging.getLogger("weightbus.bus")

# A JetStream delivery's reply subject:
#   $JS.ACK.<stream>.<consumer>.<delivered>.<stream seq>.<consumer seq>.<ts>.<pending>  (9 tokens), or
# the 12-token form with a domain and an account hash after $JS.ACK (11 when the random token is absent).
_SEQ_TOKEN_V1: Final = 5
_SEQ_TOKEN_V2: Final = 7

#: Seconds the server keeps a transient subscription's consumer once its reader has gone (JetStream's default for an
#: ephemeral consumer is 5 s): a history read in a loop at the stream's consumer limit no longer fills it with its own
#: leftovers. While the reader is subscribed, its interest keeps the consumer, however slow the read.
TRANSIENT_INACTIVE: Final = 1.0

#: JetStream's "maximum consumers limit reached".
_CONSUMER_LIMIT: Final = 10026
_DELIVER: Final = {
    Deliver.LAST_PER_SUBJECT: DeliverPolicy.LAST_PER_SUBJECT,
    Deliver.NEW: DeliverPolicy.NEW,
    Deliver.ALL: DeliverPolicy.ALL,
}


def stream_seq(reply: str | None) -> int | None:
    """The stream sequence in a JetStream delivery's reply subject, or None for anything else.

    nats-py's ``msg.metadata`` builds a dataclass and a datetime per message; the tracker needs one int.
    """
    if not reply or not reply.startswith("$JS.ACK."):
        return None
    tokens = reply.split(".")
    n = len(tokens)
    index = _SEQ_TOKEN_V1 if n == 9 else _SEQ_TOKEN_V2 if n >= 11 else None
    if index is None:
        return None
    try:
        return int(tokens[index])
    except ValueError:
        return None


class NatsSubscription(QueueSubscription):
    """A ``QueueSubscription`` fed by a JetStream ordered push consumer."""

    def __init__(
        self,
        bus: SubscriptionHost,
        pattern: str,
        deliver: Deliver,
        include_invalid: bool = False,
        *,
        transient: bool = False,
    ) -> None:
        super().__init__(pattern, bus.metrics, on_close=self._unsubscribe, include_invalid=include_invalid)
        self._bus = bus
        self._deliver = deliver
        self._transient = transient
        self._js_sub: Any = None
        self._source: Any = None  # the JetStream subscription that fed the queue; kept after close, for _unpack
        self._start_lock = asyncio.Lock()

    async def start(self) -> NatsSubscription:
        """Create the consumer now (otherwise on the first ``__anext__``)."""
        async with self._start_lock:
            if self._js_sub is not None:
                return self
            try:
                # No callback: nats-py then queues each delivery (after its ordered-consumer checks) on the
                # subscription's own pending queue, which this iterator reads directly. A callback would add
                # a task switch per event (nats-py's callback task, then ours).
                self._js_sub = await self._bus.guard(
                    Denials.api_or_inbox("$JS.API."),
                    self._bus.js.subscribe(
                        self.pattern,
                        stream=self._bus.stream,
                        ordered_consumer=True,
                        idle_heartbeat=1.0,
                        deliver_policy=_DELIVER[self._deliver],
                        pending_msgs_limit=0,
                        pending_bytes_limit=0,
                        inactive_threshold=TRANSIENT_INACTIVE if self._transient else None,
                    ),
                )
            except nats.js.errors.APIError as exc:
                if exc.err_code == _CONSUMER_LIMIT:
                    raise BusError(
                        f"cannot subscribe to {self.pattern!r}: stream {self._bus.stream} has all the consumers it "
                        f"allows (its max_consumers; nats-server 2.15 gives a stream that sets none 1,000); every "
                        "tracker, drain, watch and follow holds one: raise it with `weightbus stream create` "
                        "(which sets 10,000 where none is set) or `nats stream edit --max-consumers`"
                    ) from None
                raise BusError(f"cannot subscribe to {self.pattern!r}: {exc!r}") from None
            except nats.errors.Error as exc:
                raise BusError(f"cannot subscribe to {self.pattern!r}: {exc!r}") from None
            self._source = self._js_sub
            pending = _natspy.delivery_queue(self._js_sub)
            while not self._queue.empty():  # a close or failure that came before the subscription
                pending.put_nowait(self._queue.get_nowait())
            self._queue = pending
            self._bus.subscriptions.append(self)
        return self

    def _unpack(self, item: object) -> tuple[str, bytes, Mapping[str, str] | None, int | None, float]:
        msg: Msg = item  # type: ignore[assignment]
        data = msg.data
        _natspy.consumed(self._source, len(data))
        return msg.subject, data, msg.headers, stream_seq(msg.reply), time.time()

    async def __anext__(self) -> Envelope:
        if self._js_sub is None:
            await self.start()
        return await super().__anext__()

    async def __aenter__(self) -> NatsSubscription:
        return await self.start()

    async def _unsubscribe(self) -> None:
        sub, self._js_sub = self._js_sub, None
        if self in self._bus.subscriptions:
            self._bus.subscriptions.remove(self)
        if sub is None:
            return
        if not self._bus.client.is_closed:
            try:
                await sub.unsubscribe()
            except nats.errors.Error as exc:
                log.debug("unsubscribe failed", extra={"pattern": self.pattern, "error": repr(exc)})
        # nats-py cancels these only in a successful unsubscribe; on a closed connection they would poll on.
        for task in _natspy.subscription_tasks(sub):
            task.cancel()
