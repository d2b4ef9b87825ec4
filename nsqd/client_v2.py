"""One TCP client's state: identity, RDY, in-flight messages and counters.

The client is the channel's :class:`~nsqd.channel.Consumer`. :meth:`fill`
moves up to ``RDY - in_flight`` messages from the channel into the output
list in one go: the in-flight insert is one ``dict.update`` per chunk and the
frames are appended with one ``list.extend``, with no per-message Python code.
"""

from __future__ import annotations

import random
from typing import TYPE_CHECKING, Callable

from . import message
from .in_flight import InFlight

if TYPE_CHECKING:
    from .auth import AuthState
    from .channel import Channel, Lease
    from .options import Options

#: Go nsqd's client state numbers, as /stats reports them
STATE_INIT = 0
STATE_SUBSCRIBED = 3
STATE_CLOSING = 4

_CLOSE_WAIT = message.encode_response(b"CLOSE_WAIT")

#: a client with messages in flight refills only once this share of RDY is free,
#: so a busy consumer gets big batches instead of one message per FIN
MIN_REFILL_FRACTION = 8


class ClientV2:
    def __init__(self, client_id: int, remote_address: str, options: Options, now_ns: int) -> None:
        self.id = client_id
        self.remote_address = remote_address
        self.connect_ts = now_ns // 1_000_000_000
        self.state = STATE_INIT
        # IDENTIFY
        host = remote_address.rsplit(":", 1)[0]
        self.client_id = host
        self.hostname = host
        self.user_agent = ""
        self.heartbeat_interval_ns = int(options.client_timeout * 1e9) // 2
        self.msg_timeout_ns = int(options.msg_timeout * 1e9)
        self.output_buffer_size = 16 * 1024
        self.output_buffer_timeout_ns = int(options.output_buffer_timeout * 1e9)
        self.sample_rate = 0
        self.feature_negotiation = False
        self.tls = self.snappy = self.deflate = False
        self.authed = False
        self.auth_identity = self.auth_identity_url = ""
        self.auth_state: AuthState | None = None
        self.auth_secret = ""
        self.tls_version = self.tls_cipher_suite = self.tls_negotiated_protocol = ""
        self.tls_negotiated_protocol_is_mutual = False
        # subscription and flow control
        self.channel: Channel | None = None
        self.ready_count = 0
        self.in_flight = InFlight()
        #: the lease extension: negotiated in IDENTIFY, then LEASE <name> tags deliveries
        self.leases_enabled = False
        self.lease: Lease | None = None
        self.max_msg_timeout_ns = int(options.max_msg_timeout * 1e9)
        # counters
        self.message_count = 0
        self.finish_count = 0
        self.requeue_count = 0
        self.timeout_count = 0
        self.pub_counts: dict[str, int] = {}
        # output: frames waiting for the connection's next write
        self.out: list[bytes] = []
        self.exit_requested = False
        #: set by the I/O layer: wake the task that writes to this client
        self.on_wake: Callable[[], None] = _noop

    # ------------------------------------------------------------ consumer
    def wake(self) -> int:
        self.on_wake()
        in_flight = len(self.in_flight) + (len(self.lease.in_flight) if self.lease else 0)
        return max(self.ready_count - in_flight, 0)

    def close(self) -> None:
        """The channel is going away: end this connection (as nsqd does)."""
        self.exit_requested = True
        self.on_wake()

    def drain(self) -> None:
        """Shutdown: tell the client to finish and close, as nsqd answers CLS."""
        if self.state == STATE_SUBSCRIBED:
            self.out.append(_CLOSE_WAIT)
            self.on_wake()

    def messages_timed_out(self, count: int) -> None:
        self.timeout_count += count

    def fill(self, now_ns: int) -> None:
        """Take messages from the channel while RDY allows, into :attr:`out`."""
        channel = self.channel
        if channel is None or self.state != STATE_SUBSCRIBED:
            return
        target = self.in_flight
        in_flight = len(target)
        lease = self.lease
        if lease is not None:
            if lease.sealed:
                return
            target = lease.in_flight
            in_flight += len(target)
        free = self.ready_count - in_flight
        if free <= 0 or (in_flight and free * MIN_REFILL_FRACTION < self.ready_count):
            return
        pieces = channel.take(free, self, now_ns)
        if not pieces:
            return
        deadline = now_ns + self.msg_timeout_ns
        add = target.add
        extend = self.out.extend
        for ids, frames in pieces:
            if self.sample_rate:
                ids, frames = self._sample(channel, ids, frames)
            add(ids, frames, deadline, now_ns)
            extend(frames)
            self.message_count += len(frames)

    def _sample(self, channel: Channel, ids: list[bytes], frames: list[bytes]):
        """Keep about ``sample_rate`` percent of messages; nsqd drops the rest for the channel."""
        keep = [i for i in range(len(ids)) if random.randrange(100) < self.sample_rate]
        return [ids[i] for i in keep], [frames[i] for i in keep]


def _noop() -> None:
    return None
