"""One TCP client's state: identity, RDY, its subscription and counters.

The client is the :class:`~nsqd.subscription.Consumer` behind its
subscription. RDY is the client's in-flight budget; :meth:`ClientV2.fill`
moves up to ``RDY - in_flight`` messages from the subscription into the
output list in one go (the in-flight insert is one ``dict.update`` per chunk
and the frames are appended with one ``list.extend``: no per-message Python
code).
"""

from __future__ import annotations

from collections.abc import Container
from typing import TYPE_CHECKING, Callable

from . import message
from .options import host_of
from .subscription import Budget

if TYPE_CHECKING:
    from .auth import AuthState
    from .options import Options
    from .subscription import Subscription

#: Go nsqd's client state numbers, as /stats reports them
STATE_INIT = 0
STATE_SUBSCRIBED = 3
STATE_CLOSING = 4

_CLOSE_WAIT = message.encode_response(b"CLOSE_WAIT")

#: bytes of messages one fill takes (at least one message): a client that does not read holds
#: this, its socket buffers and its output buffer in flight, not its whole RDY of large
#: messages (as nsqd's pump, which blocks on the socket; docs/limits.md)
FILL_BYTES = 1024 * 1024
#: a connection's publish counts are looked over once it published to this many topics (see PubCounts)
PUB_COUNTS_PRUNE = 64


class PubCounts(dict):
    """Messages one connection published, by topic name (``pub_counts`` in /stats).

    Go nsqd keeps every name a connection ever published to, so a long-lived
    connection that publishes to many short-lived topics (replies to each
    requester's ``#ephemeral`` topic) grows for good. Here, once the table has
    doubled since it was last looked over, the names of topics that no longer
    exist leave it: it holds at most twice the live topics the connection
    published to, or ``PUB_COUNTS_PRUNE`` names.
    """

    __slots__ = ("_topics", "_prune_at")

    def __init__(self, topics: Container[str]) -> None:
        super().__init__()
        self._topics = topics
        self._prune_at = PUB_COUNTS_PRUNE

    def add(self, topic: str, count: int) -> None:
        self[topic] = self.get(topic, 0) + count
        if len(self) >= self._prune_at:
            topics = self._topics
            for name in [name for name in self if name not in topics]:
                del self[name]
            self._prune_at = max(2 * len(self), PUB_COUNTS_PRUNE)


class ClientV2:
    def __init__(self, client_id: int, remote_address: str, options: Options, now_ns: int,
                 topics: Container[str]) -> None:
        self.id = client_id
        self.remote_address = remote_address
        self.connect_ts = now_ns // 1_000_000_000
        self.state = STATE_INIT
        # IDENTIFY
        host = host_of(remote_address)
        self.client_id = host
        self.hostname = host
        self.user_agent = ""
        self.topology_region = self.topology_zone = ""
        self.heartbeat_interval_ns = int(options.client_timeout * 1e9) // 2
        self.msg_timeout_ns = int(options.msg_timeout * 1e9)
        self.output_buffer_size = 16 * 1024
        self.output_buffer_timeout_ns = int(options.output_buffer_timeout * 1e9)
        #: when IDENTIFY was last applied (daemon clock; None: never): it restarts the flush ticker
        self.identified_ns: int | None = None
        self.sample_rate = 0
        self.feature_negotiation = False
        self.tls = self.snappy = self.deflate = False
        self.authed = False
        self.auth_identity = self.auth_identity_url = ""
        self.auth_state: AuthState | None = None
        self.auth_secret = ""
        self.tls_version = self.tls_cipher_suite = self.tls_negotiated_protocol = ""
        #: the TLS client certificate's subject CN, which the auth servers are told
        self.common_name = ""
        self.tls_negotiated_protocol_is_mutual = False
        # subscription and flow control: RDY is the budget's limit
        self.budget = Budget(0)
        self.sub: Subscription | None = None
        #: the lease extension: negotiated in IDENTIFY, then LEASE <name> tags deliveries
        self.leases_enabled = False
        #: ``topics``: the names of the daemon's topics (its live dict)
        self.pub_counts = PubCounts(topics)
        # output: frames waiting for the connection's next write
        self.out: list[bytes] = []
        #: a frame other than a message is waiting (a response, an error, a heartbeat): write at once
        self.flush_now = False
        #: the last fill stopped for a budget with room left (see Subscription.stopped_short)
        self.stopped_short = False
        self.exit_requested = False
        #: set by the I/O layer while a send to this client waits (see Consumer.write_blocked)
        self.write_blocked = False
        #: set by the I/O layer: wake the task that writes to this client
        self.on_wake: Callable[[], None] = _noop

    # ----------------------------------------------------------- stats
    @property
    def ready_count(self) -> int:
        return self.budget.limit

    @property
    def in_flight_count(self) -> int:
        return self.sub.in_flight_count if self.sub is not None else 0

    @property
    def message_count(self) -> int:
        return self.sub.message_count if self.sub is not None else 0

    @property
    def finish_count(self) -> int:
        return self.sub.finish_count if self.sub is not None else 0

    @property
    def requeue_count(self) -> int:
        return self.sub.requeue_count if self.sub is not None else 0

    # ------------------------------------------------------------ consumer
    def wake(self) -> None:
        self.on_wake()

    def close(self) -> None:
        """The channel is going away: end this connection (as nsqd does)."""
        self.exit_requested = True
        self.on_wake()

    def drain(self) -> None:
        """Shutdown: tell the client to finish and close, as nsqd answers CLS."""
        if self.state == STATE_SUBSCRIBED:
            self.out.append(_CLOSE_WAIT)
            self.flush_now = True
            self.on_wake()

    def holds_output(self) -> bool:
        """Go nsqd's buffered writer: whether the messages in :attr:`out` may wait for more.

        They may while the output buffer (``output_buffer_size``, negotiated in
        IDENTIFY) is not full, no other frame waits, and the client is ready
        for more (in flight < RDY); the writer sends them at the latest
        ``output_buffer_timeout`` after the first of them (0: never waits).
        """
        if self.flush_now or self.output_buffer_timeout_ns <= 0:
            return False
        sub = self.sub
        if sub is None or self.state != STATE_SUBSCRIBED or sub.in_flight_count >= self.budget.limit:
            return False
        return sum(map(len, self.out)) < self.output_buffer_size

    def timed_out(self, count: int) -> None:
        """Nothing to do: the channel counts timeouts on the subscription."""

    def fill(self, now_ns: int) -> None:
        """Take messages from the subscription while RDY allows, into :attr:`out`, up to
        ``FILL_BYTES`` at a time.

        Whatever is free is taken at once, as nsqd's pump sends while in
        flight < RDY: a busy consumer still gets batches, since a fill comes
        after all the FINs of one read. Holding a small refill back for more
        room cost a client that leaves Nagle on a delayed ACK (about 40 ms)
        per FIN: nothing went back to carry it.
        """
        self.stopped_short = False
        sub = self.sub
        if sub is None or self.state != STATE_SUBSCRIBED:
            return
        free = self.budget.limit - sub.in_flight_count
        if free <= 0:
            return
        out = self.out
        before = len(out)
        for _, frames, _ in sub.take(free, now_ns, FILL_BYTES):
            out.extend(frames)
        taken = len(out) - before
        self.stopped_short = taken < free and sub.stopped_short
        if self.stopped_short:
            # by FILL_BYTES or the step of dropped messages: the writer comes back once these are
            # written (also when the bytes read were all deferred records set aside, or all the
            # messages dropped: messages may wait behind them)
            self.on_wake()

    def unsubscribe(self) -> None:
        """The connection is over: in-flight messages go back to the channel, and the subscription
        is let go (it holds this client: kept, the pair was a cycle left for the collector)."""
        sub, self.sub = self.sub, None
        if sub is not None:
            sub.close()


def _noop() -> None:
    return None
