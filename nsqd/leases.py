"""Leases: deliveries tagged with a name, settled together from any connection.

A stream processor reads messages in one process and acknowledges them from
another once its sink has committed (see docs/leases.md). A lease owns its
in-flight messages, so they outlive the connection that received them; the
connection that opened it counts them in its in-flight budget while it is
connected, so a client cannot hold more than its RDY by spreading messages
over many lease names. A sealed lease takes no new messages.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .in_flight import InFlight, Item

if TYPE_CHECKING:
    from .subscription import Subscription


class Lease:
    __slots__ = ("name", "in_flight", "holder", "sealed", "timeout_ns")

    def __init__(self, name: str, timeout_ns: int) -> None:
        self.name = name
        self.in_flight = InFlight()
        #: the subscription that opened it and counts it in its budget, while it is connected
        self.holder: Subscription | None = None
        self.sealed = False
        self.timeout_ns = timeout_ns

    def renew(self, now_ns: int) -> list[Item]:
        """Give every message a fresh deadline; returns them in delivery order."""
        items = self.in_flight.drain()
        if items:
            self.restore(items, now_ns)
        return items

    def restore(self, items: list[Item], now_ns: int) -> None:
        """Hold ``items`` (again), with a fresh deadline."""
        self.in_flight.add_items(items, now_ns + self.timeout_ns, now_ns)


class Leases:
    """A channel's leases by name."""

    def __init__(self) -> None:
        self.by_name: dict[str, Lease] = {}

    def __iter__(self):
        return iter(list(self.by_name.values()))

    def __len__(self) -> int:
        return len(self.by_name)

    def __contains__(self, name: object) -> bool:
        return name in self.by_name

    @property
    def in_flight_count(self) -> int:
        return sum(len(lease.in_flight) for lease in self.by_name.values())

    def open(self, name: str, holder: Subscription, now_ns: int, timeout_ns: int) -> tuple[Lease, list[Item]]:
        """Tag ``holder``'s next deliveries with lease ``name``.

        Reopening a live lease hands over exactly its messages again (returned,
        to be resent) and takes no new ones: the lease is sealed.
        """
        lease = self.by_name.get(name)
        if lease is None:
            lease = self.by_name[name] = Lease(name, timeout_ns)
            resend: list[Item] = []
        else:
            lease.sealed = True
            resend = lease.renew(now_ns)
            if lease.holder is not None and lease.holder is not holder:
                lease.holder.leases.discard(lease)
        lease.holder = holder
        holder.leases.add(lease)
        return lease, resend

    def restore(self, name: str, items: list[Item], now_ns: int, timeout_ns: int) -> Lease:
        """A lease recovered after a restart: sealed, held by nobody until a client reopens it."""
        lease = self.by_name.get(name)
        if lease is None:
            lease = self.by_name[name] = Lease(name, timeout_ns)
        lease.sealed = True
        lease.restore(items, now_ns)
        return lease

    def seal(self, lease: Lease) -> None:
        """Its connection moved on: the lease keeps its messages and takes no more."""
        lease.sealed = True
        if not lease.in_flight:
            self._drop(lease)

    def release_holder(self, lease: Lease) -> None:
        """The holder's connection went: the lease lives on, counted nowhere."""
        lease.sealed = True
        lease.holder = None
        if not lease.in_flight:
            self._drop(lease)

    def settle(self, name: str) -> tuple[Lease | None, list[Item]]:
        """Remove a lease; returns it and its messages (to finish or requeue)."""
        lease = self.by_name.get(name)
        if lease is None:
            return None, []
        items = lease.in_flight.drain()
        self._drop(lease)
        return lease, items

    def finish(self, name: str) -> list[bytes]:
        """Remove a lease whose messages are done with; returns their ids (cheaper than :meth:`settle`)."""
        lease = self.by_name.get(name)
        if lease is None:
            return []
        ids = list(lease.in_flight.map)
        lease.in_flight.clear()
        self._drop(lease)
        return ids

    def get(self, name: str) -> Lease | None:
        return self.by_name.get(name)

    def expire(self, now_ns: int, limit: int | None = None) -> list[Item]:
        """Timed-out messages of every lease (at most ``limit``); leases left empty and sealed go.

        The holder of a lease that lost messages is woken, as a subscription
        whose messages timed out is: its budget has room again, and it may
        not be among the channel's hungry consumers (it had taken all it
        asked for), so no arrival would wake it.
        """
        expired: list[Item] = []
        for lease in list(self.by_name.values()):
            if limit is not None and len(expired) >= limit:
                break
            items = lease.in_flight.expire(now_ns, None if limit is None else limit - len(expired))
            if not items:
                if lease.sealed and not lease.in_flight:
                    self._drop(lease)
                continue
            expired += items
            if not lease.in_flight:
                self._drop(lease)  # wakes the holder
            elif lease.holder is not None:
                lease.holder.consumer.wake()
        return expired

    def _drop(self, lease: Lease) -> None:
        if self.by_name.get(lease.name) is lease:
            del self.by_name[lease.name]
        lease.sealed = True
        holder, lease.holder = lease.holder, None
        if holder is not None:
            holder.leases.discard(lease)
            # (still its current lease, sealed: the connection takes nothing until its next LEASE)
            holder.consumer.wake()  # its budget has room again

    def kept(self) -> tuple[list, int]:
        """Disk intervals of every lease's messages, noted with the lease name (for recovery)."""
        out: list = []
        count = 0
        for lease in self.by_name.values():
            # "r": the queue never reads these back; the channel restores the lease from them
            note = {"l": lease.name, "t": lease.timeout_ns // 1_000_000, "r": 1}
            runs, n = lease.in_flight.kept(note, singles=True)
            out += runs
            count += n
        return out, count

    def drain(self) -> list[tuple[str, list[Item]]]:
        """Every lease's messages, for an orderly shutdown."""
        out = [(lease.name, lease.in_flight.drain()) for lease in self.by_name.values()]
        self.by_name.clear()
        return out

    def clear(self) -> None:
        for lease in list(self.by_name.values()):
            lease.in_flight.clear()
            self._drop(lease)
