"""``fdatasync`` through io_uring: a commit's sync without a worker thread of our own.

A worker thread must take the GIL from the busy event loop when it starts,
again after its ``fdatasync`` and again after it reports back, and each
hand-off costs the loop too: on tmpfs, where the sync itself is free, those
hand-offs alone held durable ``MPUB`` at three quarters of the default rate.
Submitted as ``IORING_OP_FSYNC``, the sync runs in the kernel's io-wq
workers of this process, on whichever CPU is free, and its completion is
counted on an eventfd that the event loop waits on like a socket. The
worker looks the descriptor up when it runs, so a descriptor must stay open
until its sync completes (the queue closes descriptors under a new
generation only, and then disregards the results of the syncs in flight). The rings are shared memory, read and written here with plain
loads and stores, which x86-64's ordering of memory accesses makes safe;
elsewhere this module stays off.

Where io_uring cannot be used (another architecture, an older kernel,
``kernel.io_uring_disabled``, a seccomp filter, out of memory)
:func:`open_context` returns None and the queue syncs in worker threads.
"""

from __future__ import annotations

import ctypes
import errno
import mmap
import os
import platform
import select
import struct
import sys

_SYS_SETUP, _SYS_ENTER, _SYS_REGISTER = 425, 426, 427
_OP_FSYNC = 3
_FSYNC_DATASYNC = 1
_REGISTER_EVENTFD = 4
_OFF_SQ_RING, _OFF_CQ_RING, _OFF_SQES = 0, 0x8000000, 0x10000000
_FEAT_SINGLE_MMAP = 1
#: submission slots; a commit round submits one sync per descriptor, and only one round is in flight
ENTRIES = 64
#: rings open at once in this process: each is two descriptors (the ring and its eventfd) and some
#: kernel memory, so beyond this many queues that commit, the others sync in worker threads
MAX_RINGS = 256
_open_rings = 0
_libc: ctypes.CDLL | None = None
_SQE_SIZE, _CQE_SIZE = 64, 16

_U32 = struct.Struct("=I")
#: opcode, flags, ioprio, fd, off, addr, len, fsync_flags, user_data, then 24 zero bytes
_SQE = struct.Struct("=BBHiQQIIQ24x")
_CQE = struct.Struct("=QiI")


class _Params(ctypes.Structure):
    _fields_ = [
        ("sq_entries", ctypes.c_uint32), ("cq_entries", ctypes.c_uint32), ("flags", ctypes.c_uint32),
        ("sq_thread_cpu", ctypes.c_uint32), ("sq_thread_idle", ctypes.c_uint32), ("features", ctypes.c_uint32),
        ("wq_fd", ctypes.c_uint32), ("resv", ctypes.c_uint32 * 3),
        ("sq_head", ctypes.c_uint32), ("sq_tail", ctypes.c_uint32), ("sq_ring_mask", ctypes.c_uint32),
        ("sq_ring_entries", ctypes.c_uint32), ("sq_flags", ctypes.c_uint32), ("sq_dropped", ctypes.c_uint32),
        ("sq_array", ctypes.c_uint32), ("sq_resv1", ctypes.c_uint32), ("sq_user_addr", ctypes.c_uint64),
        ("cq_head", ctypes.c_uint32), ("cq_tail", ctypes.c_uint32), ("cq_ring_mask", ctypes.c_uint32),
        ("cq_ring_entries", ctypes.c_uint32), ("cq_overflow", ctypes.c_uint32), ("cq_cqes", ctypes.c_uint32),
        ("cq_flags", ctypes.c_uint32), ("cq_resv1", ctypes.c_uint32), ("cq_user_addr", ctypes.c_uint64),
    ]


class SyncRing:
    """One io_uring for ``fdatasync``s and the eventfd its completions are counted on.

    ``fileno`` is the eventfd: readable once a submitted sync completed.
    Owned by one task; :meth:`close` only once nothing is in flight.
    """

    def __init__(self, libc: ctypes.CDLL) -> None:
        self._libc = libc
        self._syscall = syscall = libc.syscall
        params = _Params()
        ring = syscall(_SYS_SETUP, ENTRIES, ctypes.byref(params))
        if ring < 0:
            raise _last_error("io_uring_setup")
        self._ring = ring
        self._maps: list[tuple[int, int]] = []
        self.fileno = -1
        try:
            self._map_rings(params)
            self.fileno = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
            eventfd = ctypes.c_int32(self.fileno)
            if syscall(_SYS_REGISTER, ring, _REGISTER_EVENTFD, ctypes.byref(eventfd), 1) < 0:
                raise _last_error("io_uring_register")
        except BaseException:
            self._release()
            raise
        self.in_flight = 0
        global _open_rings
        _open_rings += 1

    def _map_rings(self, p: _Params) -> None:
        sq_size = p.sq_array + p.sq_entries * 4
        cq_size = p.cq_cqes + p.cq_entries * _CQE_SIZE
        if p.features & _FEAT_SINGLE_MMAP:
            self._sq = self._cq = self._map(max(sq_size, cq_size), _OFF_SQ_RING)
        else:
            self._sq = self._map(sq_size, _OFF_SQ_RING)
            self._cq = self._map(cq_size, _OFF_CQ_RING)
        self._sqes = self._map(p.sq_entries * _SQE_SIZE, _OFF_SQES)
        self._sq_head, self._sq_tail, self._sq_array = p.sq_head, p.sq_tail, p.sq_array
        self._sq_mask = _U32.unpack_from(self._sq, p.sq_ring_mask)[0]
        self._cq_head, self._cq_tail, self._cqes = p.cq_head, p.cq_tail, p.cq_cqes
        self._cq_mask = _U32.unpack_from(self._cq, p.cq_ring_mask)[0]

    def _map(self, size: int, offset: int):
        """Map a part of the ring (with libc's mmap: Python's would keep a duplicate descriptor)."""
        address = self._libc.mmap(None, size, mmap.PROT_READ | mmap.PROT_WRITE, mmap.MAP_SHARED, self._ring, offset)
        if address in (None, ctypes.c_void_p(-1).value):
            raise _last_error("mmap")
        self._maps.append((address, size))
        return (ctypes.c_char * size).from_address(address)

    def submit(self, fds: list[int], tag: int) -> None:
        """Start an ``fdatasync`` of each descriptor; each completes as an event carrying ``tag``.

        Raises OSError, with nothing in flight, if the kernel did not take them
        all (it takes fewer only when out of memory; those it took are waited
        for first).
        """
        if not 0 < len(fds) <= ENTRIES:
            raise OSError(0, f"cannot submit {len(fds)} syncs at once")
        tail = _U32.unpack_from(self._sq, self._sq_tail)[0]
        for fd in fds:
            index = tail & self._sq_mask
            _SQE.pack_into(self._sqes, index * _SQE_SIZE, _OP_FSYNC, 0, 0, fd, 0, 0, 0, _FSYNC_DATASYNC, tag)
            _U32.pack_into(self._sq, self._sq_array + index * 4, index)
            tail = (tail + 1) & 0xFFFFFFFF
        _U32.pack_into(self._sq, self._sq_tail, tail)
        taken = self._syscall(_SYS_ENTER, self._ring, len(fds), 0, 0, None, 0)
        if taken == len(fds):
            self.in_flight += taken
            # The io-wq worker that runs the sync is often runnable on this very CPU, behind the
            # event loop (it was preempted when its last completion woke us): yield it the moment it
            # needs to start the writes, or the sync waits for the loop's time slice (up to 1.4 ms).
            os.sched_yield()
            return
        error = _last_error("io_uring_enter") if taken < 0 else OSError(
            errno.EAGAIN, f"io_uring took {taken} of {len(fds)} syncs")
        # drop what the kernel did not take, and wait for what it did
        _U32.pack_into(self._sq, self._sq_tail, _U32.unpack_from(self._sq, self._sq_head)[0])
        self.in_flight += max(taken, 0)
        poller = select.poll()
        poller.register(self.fileno, select.POLLIN)
        while self.in_flight:
            poller.poll()
            self.reap()
        raise error

    def reap(self) -> list[tuple[int, int]]:
        """The syncs that completed: ``(tag, result)``, a negative result being ``-errno``."""
        try:
            os.eventfd_read(self.fileno)
        except BlockingIOError:
            pass
        head = _U32.unpack_from(self._cq, self._cq_head)[0]
        tail = _U32.unpack_from(self._cq, self._cq_tail)[0]
        completed = []
        while head != tail:
            tag, result, _ = _CQE.unpack_from(self._cq, self._cqes + (head & self._cq_mask) * _CQE_SIZE)
            completed.append((tag, result))
            head = (head + 1) & 0xFFFFFFFF
        _U32.pack_into(self._cq, self._cq_head, head)
        self.in_flight -= len(completed)
        return completed

    def close(self) -> None:
        global _open_rings
        _open_rings -= 1
        self._release()

    def _release(self) -> None:
        for address, size in self._maps:
            self._libc.munmap(ctypes.c_void_p(address), ctypes.c_size_t(size))
        self._maps = []
        os.close(self._ring)
        if self.fileno >= 0:
            os.close(self.fileno)


def open_ring() -> SyncRing | None:
    """A ring for this queue's syncs, or None where io_uring cannot be used (or MAX_RINGS are open)."""
    if _open_rings >= MAX_RINGS:
        return None
    if platform.machine() != "x86_64" or not sys.platform.startswith("linux") or not hasattr(os, "eventfd"):
        return None
    global _libc
    if _libc is None:
        try:
            _libc = _load_libc()
        except (OSError, AttributeError):
            return None
    try:
        return SyncRing(_libc)
    except OSError:
        return None


def _load_libc() -> ctypes.CDLL:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.syscall.restype = ctypes.c_long
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    return libc


def _last_error(call: str) -> OSError:
    code = ctypes.get_errno()
    return OSError(code, f"{call}: {os.strerror(code)}")
