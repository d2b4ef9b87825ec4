"""A subscription: one consumer's hold on a channel, and the only way to touch in-flight messages.

NSQ TCP clients, AMQP receiving links and lease readers all consume through
this one object. It takes messages from its channel within its budget, owns
their in-flight state (as Go's channel owns in-flight and checks ownership in
FinishMessage) and settles them: finish, requeue (counting an attempt or
not), touch, reject (dead-letter).

The budget bounds what a connection holds: every subscription of one
connection shares one :class:`Budget`, and messages in leases the
subscription opened count until they are settled, so no client can hold
more than its RDY (or, for AMQP, ``--max-rdy-count`` whatever credit it
grants) by spreading messages over links or lease names.
"""

from __future__ import annotations

import math
import random
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Protocol

from . import message
from .in_flight import InFlight

if TYPE_CHECKING:
    from .channel import Channel, Piece
    from .leases import Lease


class Consumer(Protocol):
    """What a channel needs of the connection behind a subscription."""

    def wake(self) -> None:
        """Messages arrived or room was made: fill when you can."""

    def close(self) -> None:
        """The channel is being deleted: the consumer must go."""

    def drain(self) -> None:
        """The daemon is shutting down: finish what you hold, then leave."""

    def timed_out(self, count: int) -> None:
        """``count`` messages this consumer held timed out (they go back to the channel)."""

    #: True while its connection waits to send (the client is not reading): a wake-up would get
    #: nothing taken until that send is done, so the channel wakes another consumer instead
    write_blocked: bool

    # Optional: ``ready() -> int``, how many messages the consumer would take now apart from
    # its budget (an AMQP link: its credit within the session's window). Without it the budget
    # is all (an NSQ client: RDY is its budget's limit).


class Budget:
    """One connection's in-flight allowance, shared by its subscriptions."""

    __slots__ = ("limit", "subscriptions", "held")

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.subscriptions: list[Subscription] = []
        #: ``used`` counted once for a round of fills (see :meth:`counted`), kept up to date by its
        #: takes: a connection with 1,024 AMQP links summed 1,024 counts for each link's fill
        self.held: int | None = None

    @property
    def used(self) -> int:
        held = self.held
        return sum(s.in_flight_count for s in self.subscriptions) if held is None else held

    @contextmanager
    def counted(self) -> Iterator[None]:
        """Count ``used`` once for a synchronous round of takes by several subscriptions."""
        self.held = self.used
        try:
            yield
        finally:
            self.held = None

    def changed(self, delta: int) -> None:
        """Messages went in or out of flight during a round (:meth:`counted`)."""
        if self.held is not None:
            self.held += delta

    @property
    def free(self) -> int:
        return max(self.limit - self.used, 0)


#: the reasons FIN, REQ and TOUCH give when they cannot find a message (Go nsqd's texts)
NOT_OWNED = "client does not own message"
NOT_IN_FLIGHT = "ID not in flight"


class Subscription:
    def __init__(self, channel: Channel, consumer: Consumer, sub_id: int, budget: Budget,
                 msg_timeout_ns: int, max_msg_timeout_ns: int) -> None:
        self.channel = channel
        self.consumer = consumer
        self.id = sub_id
        self.budget = budget
        budget.subscriptions.append(self)
        self.msg_timeout_ns = msg_timeout_ns
        self.max_msg_timeout_ns = max_msg_timeout_ns
        self.in_flight = InFlight()
        #: the consumer's ``ready`` (see :class:`Consumer`), or None: what a wake-up can count on
        self._ready = getattr(consumer, "ready", None)
        #: the lease deliveries go to (the lease extension), and every lease this subscription opened
        self.lease: Lease | None = None
        self.leases: set[Lease] = set()
        #: percent of messages delivered (IDENTIFY sample_rate); the rest are dropped for the channel
        self.sample_rate = 0
        self.closed = False
        self.message_count = 0
        #: bytes the last take went through: its messages' (from disk: the records read, headers
        #: included), and those of the messages it dropped (expired, not sampled)
        self.taken_bytes = 0
        #: the last take stopped for its byte or step budget (Channel.take), not because the channel ran
        #: dry: it is not counted hungry, so the taker comes back (after a checkpoint) for more
        self.stopped_short = False
        self.finish_count = 0
        self.requeue_count = 0
        self.timeout_count = 0

    # --------------------------------------------------------------- counts
    @property
    def in_flight_count(self) -> int:
        count = len(self.in_flight.map)
        for lease in self.leases:
            count += len(lease.in_flight.map)
        return count

    @property
    def available(self) -> int:
        """Messages the channel could deliver now (0 while the daemon drains): AMQP's ``available``."""
        channel = self.channel
        return 0 if channel.draining else channel.depth

    def statistics(self) -> dict:
        """This subscription's figures (what /stats shows per client)."""
        return {"in_flight_count": self.in_flight_count, "message_count": self.message_count,
                "finish_count": self.finish_count, "requeue_count": self.requeue_count,
                "timeout_count": self.timeout_count}

    def room(self, want: int) -> int:
        """How many of ``want`` messages this subscription may take now."""
        budget = self.budget
        used = budget.used if len(budget.subscriptions) > 1 else self.in_flight_count
        return max(min(want, budget.limit - used), 0)

    def wake_room(self, want: int) -> int:
        """How many of ``want`` new messages a wake-up would get taken: the room, within what
        the consumer is ready for (an AMQP link whose credit went to 0 takes nothing, nor does a
        consumer whose connection waits to send)."""
        room = self.room(want)
        if room > 0:
            if self.consumer.write_blocked:
                return 0
            ready = self._ready
            if ready is not None:
                room = max(min(room, ready()), 0)
        return room

    # ------------------------------------------------------------------ take
    def take(self, count: int, now_ns: int, max_bytes: float = math.inf) -> list[Piece]:
        """Up to ``count`` messages (within the budget), now in flight here; as chunk slices.

        With ``max_bytes`` the take stops at the message that reaches it (see
        :meth:`Channel.take`): a consumer takes what it can write soon, not
        its whole RDY of messages at once.
        """
        self.taken_bytes = 0
        self.stopped_short = False
        lease = self.lease
        if lease is not None and lease.sealed:
            return []
        count = self.room(count)
        if count <= 0:
            return []
        pieces = self.channel.take(count, self, now_ns, max_bytes)
        if not pieces:
            return pieces
        add = (lease.in_flight if lease is not None else self.in_flight).add
        deadline = now_ns + (lease.timeout_ns if lease is not None else self.msg_timeout_ns)
        taken = 0
        for ids, frames, positions in pieces:
            add(ids, frames, positions, deadline, now_ns)
            taken += len(ids)
        self.message_count += taken
        self.budget.changed(taken)
        return pieces

    # ---------------------------------------------------------------- settle
    def finish(self, ids: list[bytes]) -> list[tuple[bytes, str]]:
        """FIN every id; returns ``(id, reason)`` for those this subscription does not hold."""
        channel = self.channel
        if channel.e2e is not None:
            return self._finish_timed(ids)
        pop = self.in_flight.map.pop
        missing = [msg_id for msg_id in ids if pop(msg_id, None) is None]
        if missing and self.leases:
            missing = [msg_id for msg_id in missing if not self._finish_leased(msg_id)]
        finished = len(ids) - len(missing)
        self.finish_count += finished
        if channel.failed or channel.released:  # only those finished: another holder's copy keeps its counts
            channel.forget(ids if not missing else set(ids).difference(missing))
        channel.settled(finished)
        if missing:
            return [(msg_id, self._reason(msg_id)) for msg_id in missing]
        return []

    def _finish_leased(self, msg_id: bytes) -> bool:
        for lease in self.leases:
            if lease.in_flight.finish(msg_id):
                return True
        return False

    def _finish_timed(self, ids: list[bytes]) -> list[tuple[bytes, str]]:
        """FIN that also records publish-to-FIN latency (only with e2e percentiles on)."""
        channel = self.channel
        published = []
        missing = []
        for msg_id in ids:
            delivery = self.in_flight.map.pop(msg_id, None)
            if delivery is None:
                delivery = self._pop_leased(msg_id)
            if delivery is None:
                missing.append((msg_id, self._reason(msg_id)))
                continue
            published.append(message.frame_timestamp(delivery.frame(msg_id)))
        self.finish_count += len(published)
        channel.e2e.add_many(published, channel.clock())
        if channel.failed or channel.released:
            channel.forget(ids if not missing else set(ids).difference(msg_id for msg_id, _ in missing))
        channel.settled(len(published))
        return missing

    def _pop_leased(self, msg_id: bytes):
        for lease in self.leases:
            delivery = lease.in_flight.map.pop(msg_id, None)
            if delivery is not None:
                return delivery
        return None

    def _take_item(self, msg_id: bytes):
        item = self.in_flight.take(msg_id)
        if item is None:
            for lease in self.leases:
                item = lease.in_flight.take(msg_id)
                if item is not None:
                    break
        return item

    def requeue(self, msg_id: bytes, delay_ns: int, now_ns: int, *, count_attempt: bool = True) -> str | None:
        """Give a message back, at once or after ``delay_ns``; returns why not, or None.

        NSQ's REQ counts the delivery as an attempt and a failure; AMQP's
        ``released`` counts neither (``count_attempt=False``).
        """
        item = self._take_item(msg_id)
        if item is None:
            return self._reason(msg_id)
        self.channel.requeue(item, delay_ns, now_ns, count_attempt=count_attempt)
        self.requeue_count += 1
        self.channel.settled()
        return None

    def requeue_many(self, ids: list[bytes], now_ns: int, *, count_attempt: bool) -> int:
        """Requeue at once, so that the first id is delivered first again; returns how many."""
        items = [item for item in map(self._take_item, ids) if item is not None]
        self.channel.requeue_many(items, now_ns, count_attempt=count_attempt)
        self.requeue_count += len(items)
        self.channel.settled()
        return len(items)

    def touch(self, msg_id: bytes, now_ns: int) -> str | None:
        """Reset a message's timeout; returns why not, or None."""
        if self.in_flight.touch(msg_id, now_ns, self.msg_timeout_ns, self.max_msg_timeout_ns):
            return None
        for lease in self.leases:
            if lease.in_flight.touch(msg_id, now_ns, lease.timeout_ns, self.max_msg_timeout_ns):
                return None
        return self._reason(msg_id)

    def reject(self, ids: list[bytes]) -> int:
        """Refuse messages for good: they go to the dead-letter topic; returns how many."""
        rejected = 0
        for msg_id in ids:
            item = self._take_item(msg_id)
            if item is not None:
                self.channel.reject(item)
                rejected += 1
        self.channel.settled()
        return rejected

    def failures(self, ids: list[bytes]) -> list[int] | None:
        """Failed deliveries of each message (AMQP's delivery-count); None when none has any."""
        failed = self.channel.failed
        if not failed:
            return None
        return [failed.get(msg_id, 0) for msg_id in ids]

    def released(self, ids: list[bytes]) -> list[bool] | None:
        """Whether each message was delivered and given back before without counting it; None if none was."""
        released = self.channel.released
        if not released:
            return None
        return [msg_id in released for msg_id in ids]

    def forget_in_flight(self, ids: list[bytes]) -> None:
        """Finish messages that were delivered at most once (pre-settled AMQP deliveries)."""
        pop = self.in_flight.map.pop
        for msg_id in ids:
            pop(msg_id, None)
        self.finish_count += len(ids)
        self.budget.changed(-len(ids))
        if self.channel.failed or self.channel.released:
            self.channel.forget(ids)
        self.channel.settled()

    def _reason(self, msg_id: bytes) -> str:
        return NOT_OWNED if self.channel.holds_elsewhere(msg_id, self) else NOT_IN_FLIGHT

    # ---------------------------------------------------------------- leases
    def open_lease(self, name: str, now_ns: int) -> tuple[Lease, int, bool, list[bytes]]:
        """``LEASE name``: returns the lease, its count, whether it was reopened, and frames to resend."""
        channel = self.channel
        if self.lease is not None:
            channel.leases.seal(self.lease)
            self.lease = None
        lease, resend = channel.leases.open(name, self, now_ns, self.msg_timeout_ns)
        self.lease = lease
        reopened = lease.sealed
        if resend:
            self.message_count += len(resend)
        return lease, len(lease.in_flight), reopened, [frame for frame, _ in resend]

    def finish_lease(self, name: str) -> int:
        """``LFIN``: finish every message of a lease, from whichever connection; returns how many."""
        channel = self.channel
        ids = channel.leases.finish(name)
        if ids and (channel.failed or channel.released):
            channel.forget(ids)
        self.finish_count += len(ids)
        channel.settled()
        return len(ids)

    def touch_lease(self, name: str, now_ns: int) -> int:
        """``LTOUCH``: a fresh timeout for every message of a lease; returns how many."""
        lease = self.channel.leases.get(name)
        if lease is None:
            return 0
        lease.renew(now_ns)
        return len(lease.in_flight)

    def requeue_lease(self, name: str, delay_ns: int, now_ns: int) -> int:
        """``LREQ``: give every message of a lease back; returns how many."""
        channel = self.channel
        _, items = channel.leases.settle(name)
        for item in items if delay_ns > 0 else reversed(items):  # each to the head: the first stays first
            channel.requeue(item, delay_ns, now_ns, front=True)
        self.requeue_count += len(items)
        channel.settled()
        return len(items)

    def close_lease(self) -> None:
        """``LEASE`` alone: deliveries are no longer tagged."""
        if self.lease is not None:
            self.channel.leases.seal(self.lease)
            self.lease = None

    # ------------------------------------------------------------- lifetime
    def close(self) -> None:
        """Leave the channel: unfinished messages go back to the head of the queue, in order."""
        if self.closed:
            return
        self.closed = True
        if self in self.budget.subscriptions:
            self.budget.subscriptions.remove(self)
        self.channel.unsubscribe(self)


def keep_sample(pieces: list, rate: int) -> tuple[list, list]:
    """Split pieces into the kept and the rest (dropped for the channel), as nsqd: each is kept
    with chance ``(rate + 1) / 100``, so a rate of 99 keeps them all."""
    kept, dropped = [], []
    for ids, frames, positions in pieces:
        keep = [i for i in range(len(ids)) if random.randrange(100) <= rate]  # as Go: Int31n(100) <= rate
        if len(keep) == len(ids):
            kept.append((ids, frames, positions))
            continue
        chosen = set(keep)
        drop = [i for i in range(len(ids)) if i not in chosen]
        if keep:
            kept.append(_select(ids, frames, positions, keep))
        dropped.append(_select(ids, frames, positions, drop))
    return kept, dropped


def _select(ids, frames, positions, indexes):
    return ([ids[i] for i in indexes], [frames[i] for i in indexes],
            None if positions is None else tuple(positions[i] for i in indexes))
