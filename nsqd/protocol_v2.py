"""NSQ protocol V2: a sans-I/O parser and the command handlers.

:class:`V2Parser` turns bytes into commands and nothing else: it buffers
partial input, parses every complete command per call, enforces the line and
body size limits before a body is buffered, and merges runs of well-formed
``FIN <id>`` lines into one batch command so a consumer's stream of FINs costs
one ``dict.pop`` each. :class:`ProtocolV2` executes commands for one client
against the daemon, appending response, error and message frames to the
client's output list. Neither touches a socket or the event loop; the I/O
layer (``nsqd.tcp``) only moves bytes.

Work per call is bounded: :meth:`V2Parser.commands` returns at most
``STEP_COMMANDS`` commands (a FIN of a run counts as ``1 / FINS_PER_COMMAND``:
settling one is a ``dict.pop``, and a consumer FINs what it got in one burst,
which should come back as one burst; fewer while a client's steps run longer
than ``STEP_SECONDS``), so a read full of tiny commands is executed in steps
and the I/O layer yields between them.
As nsqd reads a body only after checking the command line, a body command
whose line is wrong (``PUB`` without a topic) is answered at once instead of
waiting for a body that may never come.

Errors mirror nsqd: the frame text is ``"<CODE> <description>"``, and fatal
errors end the connection after the error frame is written.
"""

from __future__ import annotations

import json
import math
import re
import struct
import time
from itertools import chain
from typing import TYPE_CHECKING

import structlog

from . import message
from .body_budget import NO_ROOM
from .broker import PublishError, PublishInSteps, SubscribeError
from .client_v2 import STATE_CLOSING, STATE_INIT, STATE_SUBSCRIBED, ClientV2
from .mpub import BadBatch, MpubBatch, cut_short, split_mpub
from .names import go_json_text, is_valid_channel_name, is_valid_topic_name
from .options import TLS_NOT_REQUIRED
from .version import NSQD_VERSION

if TYPE_CHECKING:
    from collections.abc import Callable, Iterator

    from .broker import Broker, Receipt
    from .staging import PublishBatch, StagedPublish

log = structlog.get_logger("nsqd.protocol")

MAGIC_V2 = b"  V2"
#: nsqd's read buffer: a command line must fit in it with its newline
MAX_LINE = 16 * 1024

#: most commands one parser call returns
STEP_COMMANDS = 256
#: about how long one step of a client's commands runs before others get the event loop: a
#: connection's step shrinks (to ``MIN_STEP_COMMANDS``) while its steps take longer, and grows
#: back to ``STEP_COMMANDS`` while they are quick (10 clients pipelining 256 PUBs a step had a
#: single PUB wait 124 ms)
STEP_SECONDS = 0.001
MIN_STEP_COMMANDS = 16
#: FINs of a run that cost as much of a step as one other command (a step holds up to 4,096 FINs)
FINS_PER_COMMAND = 16
#: largest IDENTIFY body: its JSON is decoded in one go, so it stays small (clients send ~300 bytes)
MAX_IDENTIFY_BODY = 64 * 1024
_U64 = (1 << 64) - 1
_I64_MIN = -(1 << 63)

FIN_BATCH = b"FIN*"
_FIN_LINE = 21  # "FIN " + 16-byte id + "\n"
#: ids of printable ASCII only (one byte range: as fast as any byte): a space (nsqd splits
#: the line there) or a final \r (nsqd strips it) must take the slow path, whose answer
#: is nsqd's fatal "invalid message ID"; other bytes lose only speed there
_FIN_RUN = re.compile(rb"(?:FIN [!-~]{16}\n)+")
PARSE_ERROR = b"!ERR"
#: a body command whose body was dropped as it arrived (see V2Parser.skip_awaited); params: [name]
SKIPPED = b"!SKIP"
_BODY_COMMANDS = frozenset((b"PUB", b"MPUB", b"DPUB", b"IDENTIFY", b"AUTH"))
_I32 = struct.Struct(">i")
_OK = message.encode_response(b"OK")
_DONE = object()
_CLOSE_WAIT = message.encode_response(b"CLOSE_WAIT")
HEARTBEAT = message.encode_response(b"_heartbeat_")


class ClientError(Exception):
    """A command failed; ``fatal`` errors close the connection (nsqd's FatalClientErr)."""

    def __init__(self, code: str, desc: str, fatal: bool = True) -> None:
        super().__init__(f"{code} {desc}")
        self.code = code
        self.desc = desc
        self.fatal = fatal


class AuthRefresh(Exception):
    """The client's authorization expired: ask the auth server again, then retry."""


class Unconfirmed:
    """The answer to a publish that waits for its receipt: OK once fsynced (durable) or once
    the staged batch it is part of is stored (see ``nsqd/staging.py``)."""

    __slots__ = ("receipt", "command", "topic", "error")

    def __init__(self, receipt: Receipt | StagedPublish, command: str, topic: str) -> None:
        self.receipt = receipt
        self.command = command
        self.topic = topic
        #: why the receipt failed, once it settled (None: confirmed, or not settled yet)
        self.error: PublishError | None = None


class V2Parser:
    """Bytes in, commands out: ``(name, params, body)`` tuples.

    ``FIN_BATCH`` commands carry a list of message ids as params. A framing
    problem (oversized line or body, bad size, a body command's line that nsqd
    refuses before reading the body) yields one ``PARSE_ERROR`` command whose
    params are ``[code, description]``; nothing is parsed after it. The code
    is None where nsqd's read itself fails (a line that does not fit its
    buffer): nsqd hangs up then without an answer.
    """

    def __init__(self, max_msg_size: int, max_body_size: int, max_req_timeout_ms: int) -> None:
        self.max_msg_size = max_msg_size
        self.max_body_size = max_body_size
        self.max_req_timeout_ms = max_req_timeout_ms
        #: complete commands may be left: call :meth:`commands` again
        self.more = False
        #: commands returned so far (a FIN run counts once): shows progress
        self.parsed = 0
        #: the size of the body command the buffer starts with, line and body, while its body
        #: is still arriving (0 otherwise): what the I/O layer reserves for a big one
        self.awaiting = 0
        self._buf = bytearray()
        self._failed = False
        #: bytes of a skipped body command still to arrive and be dropped, and its name
        self._skip = 0
        self._skipped: bytes | None = None
        #: what nsqd refuses a body command for before its line: the connection's state (the
        #: protocol sets it; the state lives there); ``(code, description)`` or None
        self.refusal_before_line: Callable[[bytes], tuple[str, str] | None] = _no_refusal
        #: what nsqd refuses an MPUB for once its line is read, before its body: its authorization
        self.refusal_before_mpub_body: Callable[[str], tuple[str, str] | None] = _no_refusal
        #: body commands whose refusal depends on what the commands before them did: each is
        #: parsed only once those have run (see :meth:`commands`)
        self.after_previous: frozenset[bytes] = frozenset((b"IDENTIFY", b"AUTH"))

    def receive_data(self, data: bytes) -> None:
        skip = self._skip
        if skip:
            dropped = min(skip, len(data))
            self._skip = skip - dropped
            data = data[dropped:]
        self._buf += data

    def skip_awaited(self) -> None:
        """Drop the body command the buffer starts with (see :attr:`awaiting`) and the rest of it
        as it arrives; once it has, :meth:`commands` yields ``(SKIPPED, [name], None)`` in its place.

        For a body the daemon has no memory for: reading it on, rather than
        hanging up, keeps the connection and lets the client be told why.
        """
        buf = self._buf
        name = bytes(buf[:buf.find(b"\n")]).split(b" ")[0]
        self._skip = self.awaiting - len(buf)
        self._skipped = name
        self._buf = bytearray()
        self.awaiting = 0

    @property
    def buffered(self) -> int:
        return len(self._buf)

    def cut_short(self) -> tuple[str, str] | None:
        """nsqd's error when the stream ends (or the read deadline passes) inside the body
        command buffered: the part it failed to read. None for a partial line or nothing."""
        buf = self._buf
        nl = buf.find(b"\n")
        if self._failed or self._skip or nl < 0:
            return None
        name = bytes(buf[:nl]).rstrip(b"\r").split(b" ")[0]
        if name not in _BODY_COMMANDS:
            return None
        rest = memoryview(buf)[nl + 1:]
        cmd = name.decode()
        if name == b"MPUB":
            if len(rest) < 4:
                return "E_BAD_BODY", "MPUB failed to read body size"
            return cut_short(rest[4:], self.max_msg_size, self.max_body_size)
        code, what = ("E_BAD_BODY", "body") if name in (b"IDENTIFY", b"AUTH") else ("E_BAD_MESSAGE", "message body")
        return code, f"{cmd} failed to read {what}{' size' if len(rest) < 4 else ''}"

    def restart(self) -> None:
        """Start over on a new stream (an upgrade): nothing buffered, no failure from the old one."""
        self.clear()
        self._failed = False

    def clear(self) -> None:
        """Drop whatever is buffered (the connection is gone; a partial body must not linger), and
        the protocol's hooks: they hold it, which holds this parser (a cycle left for the collector)."""
        self.refusal_before_line = self.refusal_before_mpub_body = _no_refusal
        self._buf = bytearray()
        self.more = False
        self.awaiting = 0
        self._skip = 0
        self._skipped = None

    def commands(self, limit: int = STEP_COMMANDS) -> list[tuple[bytes, list, bytes | None]]:
        """Up to ``limit`` complete commands; :attr:`more` tells whether others are buffered."""
        buf = self._buf
        self.more = False
        self.awaiting = 0
        out: list[tuple[bytes, list, bytes | None]] = []
        if self._skipped is not None and not self._skip:
            out.append((SKIPPED, [self._skipped], None))
            self._skipped = None
        if self._failed or not buf:
            self.parsed += len(out)
            return out
        fins: list[bytes] | None = None
        budget = limit * FINS_PER_COMMAND  # in FINs
        pos = 0
        end = len(buf)
        find = buf.find
        fin_run = _FIN_RUN.match
        while pos < end:
            if budget <= 0:
                self.more = True
                break
            # fast path: a run of "FIN <16-byte id>\n" lines, found by one regex match
            if buf[pos] == 70:
                run = fin_run(buf, pos, min(end, pos + _FIN_LINE * budget))
                if run is not None:
                    lines = bytes(buf[pos:run.end()])
                    if fins is None:
                        fins = []
                        out.append((FIN_BATCH, fins, None))
                    fins += [lines[i:i + 16] for i in range(4, len(lines), _FIN_LINE)]
                    budget -= len(lines) // _FIN_LINE
                    pos = run.end()
                    continue
            nl = find(b"\n", pos)
            if (end if nl < 0 else nl) - pos >= MAX_LINE:  # however the line was split into reads
                out.append(self._fail(None, f"command line longer than {MAX_LINE - 1} bytes"))
                break
            if nl < 0:
                break
            line = bytes(buf[pos:nl])
            if line.endswith(b"\r"):
                line = line[:-1]
            params = line.split(b" ")
            name = params[0]
            budget -= FINS_PER_COMMAND
            if name in _BODY_COMMANDS:
                if out and name in self.after_previous:
                    self.more = True  # the commands before it run first
                    break
                problem = self._check_line(name, params)
                if problem is None:
                    if nl + 5 > end:
                        break
                    problem = self._check_body_size(name, _I32.unpack_from(buf, nl + 1)[0])
                if problem is not None:
                    out.append(self._fail(*problem))
                    break
                size = _I32.unpack_from(buf, nl + 1)[0]
                body_start = nl + 5
                if body_start + size > end:
                    self.awaiting = body_start + size - pos
                    break
                out.append((name, params, bytes(buf[body_start:body_start + size])))
                pos = body_start + size
            else:
                out.append((name, params, None))
                pos = nl + 1
            fins = None
        del buf[:pos]
        self.parsed += len(out)
        return out

    def _check_line(self, name: bytes, params: list[bytes]) -> tuple[str, str] | None:
        """What nsqd checks in a body command's line before it reads the body, in its order."""
        refusal = self.refusal_before_line(name)
        if refusal is not None or name == b"IDENTIFY":
            return refusal
        if name == b"AUTH":
            return ("E_INVALID", "AUTH invalid number of parameters") if len(params) != 1 else None
        if len(params) < (3 if name == b"DPUB" else 2):
            return "E_INVALID", f"{name.decode()} insufficient number of parameters"
        topic = params[1].decode(errors="replace")
        if not is_valid_topic_name(topic):
            return "E_BAD_TOPIC", bad_topic_text(name.decode(), params[1])
        if name == b"DPUB":
            try:
                timeout_ms = go_base10(params[2], "DPUB could not parse timeout")
            except ClientError as exc:
                return exc.code, exc.desc
            if not 0 <= go_millis_ns(timeout_ms) <= self.max_req_timeout_ms * 1_000_000:
                return "E_INVALID", f"DPUB timeout {timeout_ms} out of range 0-{self.max_req_timeout_ms}"
        if name == b"MPUB":
            return self.refusal_before_mpub_body(topic)
        return None

    def _check_body_size(self, name: bytes, size: int) -> tuple[str, str] | None:
        if name == b"PUB" or name == b"DPUB":
            if 0 < size <= self.max_msg_size:
                return None
            if size <= 0:
                return "E_BAD_MESSAGE", f"{name.decode()} invalid message body size {size}"
            return "E_BAD_MESSAGE", f"{name.decode()} message too big {size} > {self.max_msg_size}"
        cmd = name.decode()
        limit = min(self.max_body_size, MAX_IDENTIFY_BODY) if name == b"IDENTIFY" else self.max_body_size
        if size > limit:
            return "E_BAD_BODY", f"{cmd} body too big {size} > {limit}"
        if size <= 0:
            return "E_BAD_BODY", f"{cmd} invalid body size {size}"
        return None

    def _fail(self, code: str | None, desc: str) -> tuple[bytes, list, None]:
        self._failed = True
        self.clear()
        return (PARSE_ERROR, [code, desc], None)


def _no_refusal(_what) -> None:
    return None


def bad_topic_text(cmd: str, topic: bytes | str) -> str:
    """The description of an E_BAD_TOPIC; nsqd's MPUB writes its code into it as well
    (the frame reads ``E_BAD_TOPIC E_BAD_TOPIC MPUB ...``), and clients may match the text."""
    text = f"{cmd} topic name {_go_quote(topic)} is not valid"
    return f"E_BAD_TOPIC {text}" if cmd == "MPUB" else text


def _checked_topic(params: list[bytes]) -> str:
    """The topic of a PUB, DPUB or MPUB, whose line the parser checked before reading its body."""
    return params[1].decode(errors="replace")


def go_base10(value: bytes, what: str) -> int:
    """nsqd's ByteToBase10: digits only, the empty string is 0, and the value wraps
    around at 64 bits as Go's uint64 does (so no length of digits is too long)."""
    if not value:
        return 0
    if not value.isdigit():
        raise ClientError("E_INVALID", f"{what} {_raw(value)}")
    n = 0
    for start in range(0, len(value), 18):  # int() of a huge digit string is refused, 18 digits never are
        chunk = value[start:start + 18]
        n = (n * 10 ** len(chunk) + int(chunk)) & _U64
    return n


def go_int64(value: int) -> int:
    """A uint64 read as Go's int64."""
    return value - (1 << 64) if value >> 63 else value


def go_millis_ns(ms: int) -> int:
    """``time.Duration(ms) * time.Millisecond`` for a uint64 ``ms``, overflow included."""
    return go_int64(ms * 1_000_000 & _U64)


class ProtocolV2:
    """Runs parsed commands for one client against the daemon."""

    def __init__(self, nsqd: Broker, client: ClientV2, batch: PublishBatch | None = None) -> None:
        self.nsqd = nsqd
        self.client = client
        #: while it is open (a pass of the readiness hub), PUB and MPUB are staged there
        self.batch = batch
        opts = nsqd.options
        self.parser = V2Parser(opts.max_msg_size, opts.max_body_size, int(opts.max_req_timeout * 1000))
        self.closed = False
        #: answers held back behind an unconfirmed publish, in order (see :meth:`answer`)
        self.held: list[bytes | Unconfirmed] = []
        #: async steps the I/O layer must perform before :meth:`resume`:
        #: ("tls",), ("snappy",), ("deflate", level), ("auth",), ("steps",) (a big MPUB: :meth:`publish_step`)
        self.pending: list[tuple] = []
        self._stash: list[tuple[bytes, list, bytes | None]] = []
        #: commands a step may run now (see STEP_SECONDS)
        self._step_commands = STEP_COMMANDS
        #: a big MPUB being validated and stored a step at a time: its steps and its publish
        self._big_mpub: tuple[Iterator, PublishInSteps] | None = None
        #: the topic of the last single PUB staged by :meth:`stage_single_pub`, as sent and as checked
        self._pub_topic_raw: bytes | None = None
        self._pub_topic = ""
        self.auth_enabled = bool(opts.auth_http_addresses)
        self.tls_required = opts.tls_required != TLS_NOT_REQUIRED
        self.parser.refusal_before_line = self._refusal_before_line
        if self.auth_enabled:
            self.parser.refusal_before_mpub_body = self._mpub_refusal
            self.parser.after_previous |= {b"MPUB"}

    def stage_single_pub(self, data: bytearray, end: int) -> bool:
        """Stage ``data[:end]`` if it is exactly one valid ``PUB`` and nothing else; else do nothing.

        The usual read of a publisher that waits for each answer, taken
        without the parser's buffer and command loop: about a tenth of the
        daemon's CPU per single ``PUB``. Anything else (other commands, a
        partial or invalid ``PUB``, auth or TLS to check, a closed batch) is
        refused here and goes the general way, which answers it as nsqd does.
        """
        batch = self.batch
        if (end < 10 or data[0] != 80 or data[1:4] != b"UB " or batch is None or not batch.open
                or self.auth_enabled or self.tls_required or self.parser.buffered or self.held):
            return False
        nl = data.find(b"\n", 4, end)
        body_start = nl + 5
        if nl < 0 or body_start > end:
            return False
        size = _I32.unpack_from(data, nl + 1)[0]
        if body_start + size != end or not 0 < size <= self.parser.max_msg_size:
            return False
        raw = bytes(data[4:nl])
        if raw == self._pub_topic_raw:
            topic_name = self._pub_topic
        else:
            topic_name = raw.decode(errors="replace")
            if b" " in raw or not is_valid_topic_name(topic_name):  # ("\r" is not valid in a name)
                return False
            self._pub_topic_raw, self._pub_topic = raw, topic_name
        self.parser.parsed += 1
        self.held.append(Unconfirmed(batch.stage(topic_name, [bytes(data[body_start:end])]), "PUB", topic_name))
        return True

    def receive_data(self, data: bytes, now_ns: int) -> None:
        """Buffer ``data`` and run the first :meth:`step` of the commands it completes."""
        self.parser.receive_data(data)
        self.step(now_ns)

    def step(self, now_ns: int) -> None:
        """Parse and execute up to ``STEP_COMMANDS`` commands (fewer while steps run long, see
        ``STEP_SECONDS``); set :attr:`closed` on a fatal error.

        While :attr:`more` is true, complete commands are still buffered: the
        I/O layer yields to other tasks, then steps again. A command that needs
        I/O (a TLS or compression upgrade, an auth server query) leaves its
        steps in :attr:`pending` and the commands after it waiting until :meth:`resume`.
        """
        start = time.perf_counter()
        self._run(self.parser.commands(self._step_commands), now_ns)
        took = time.perf_counter() - start
        if took > 2 * STEP_SECONDS:
            self._step_commands = max(self._step_commands // 2, MIN_STEP_COMMANDS)
        elif took < STEP_SECONDS / 2 and self._step_commands < STEP_COMMANDS:
            self._step_commands = min(self._step_commands * 2, STEP_COMMANDS)

    @property
    def more(self) -> bool:
        return self.parser.more and not self.closed

    def cut_short(self) -> bool:
        """The client's stream ended inside a body command: answer what nsqd failed to read (fatal).

        Returns whether there was such a command (its error frame is in the client's output).
        """
        problem = self.parser.cut_short()
        if problem is None or self.closed:
            return False
        self._client_error(ClientError(*problem), self.client.out)
        self.client.flush_now = True
        return True

    def drop_before_upgrade(self) -> tuple[int, int]:
        """Forget what the client sent behind an upgrading IDENTIFY: (commands parsed, bytes unparsed).

        Those bytes were meant for the stream before its upgrade (TLS,
        snappy, deflate) and are not part of the new one; nsqd drops them
        with its old buffered reader. Running them as plain commands would
        let plaintext in behind ``--tls-required``.
        """
        dropped = (len(self._stash), self.parser.buffered)
        self.parser.restart()
        self._stash = []
        return dropped

    def resume(self, now_ns: int) -> None:
        """Go on with the commands that waited for the pending steps (none after a fatal error)."""
        commands, self._stash = self._stash, []
        if self.closed:
            return
        self._run(commands, now_ns)

    def _run(self, commands: list[tuple[bytes, list, bytes | None]], now_ns: int) -> None:
        """Run commands; whatever they answer must be written at once (not held like messages)."""
        client = self.client
        answered = len(client.out)
        self._run_commands(commands, now_ns)
        if len(client.out) != answered:
            client.flush_now = True

    def _run_commands(self, commands: list[tuple[bytes, list, bytes | None]], now_ns: int) -> None:
        client = self.client
        for index, (name, params, body) in enumerate(commands):
            out = self.held if self.held else client.out
            if name is FIN_BATCH and not self.tls_required:
                self._fin_many(params)
                if self.closed:
                    return
                continue
            try:
                if name is SKIPPED:
                    command = params[0].decode(errors="replace")
                    raise ClientError(f"E_{command}_FAILED", f"{command} failed {NO_ROOM}", fatal=False)
                if name is PARSE_ERROR:
                    if params[0] is None:  # nsqd's read failed: it hangs up without an answer
                        log.warning("client error", client=client.remote_address, error=params[1])
                        self.closed = True
                        return
                    raise ClientError(*params)
                if name is FIN_BATCH:
                    self._check_tls(b"FIN")
                    self._fin_many(params)
                    if self.closed:
                        return
                    continue
                if name != b"IDENTIFY":
                    self._check_tls(name)
                handler = _HANDLERS.get(name)
                if handler is None:
                    raise ClientError("E_INVALID", f"invalid command {_raw(name)}")
                response = handler(self, params, body, now_ns)
            except AuthRefresh:
                self.pending.append(("auth",))
                self._stash = commands[index:]
                return
            except ClientError as err:
                self._client_error(err, out)
                if err.fatal:
                    return
                continue
            if response is not None:
                if type(response) is Unconfirmed:
                    out = self.held
                out.append(response)
            if self.pending:
                self._stash = commands[index + 1:]
                return

    def _client_error(self, err: ClientError, out: list) -> None:
        text = str(err).encode(errors="surrogateescape")  # the client's own bytes, as nsqd echoes them
        log.log(30 if err.fatal else 20, "client error", client=self.client.remote_address,
                error=text.decode(errors="replace"))
        out.append(message.encode_error(text))
        if err.fatal:
            self.closed = True

    def answer(self, unconfirmed: Unconfirmed, error: str | None) -> bytes:
        """The frame for a held publish once its receipt is settled (``error``: why it failed)."""
        if error is None:
            self.client.pub_counts.add(unconfirmed.topic, unconfirmed.receipt.count)
            return _OK
        cmd = unconfirmed.command
        log.warning("publish not confirmed", client=self.client.remote_address, error=error)
        return message.encode_error(f"E_{cmd}_FAILED {cmd} failed {error}".encode())

    # ------------------------------------------------------------ helpers
    def _check_tls(self, name: bytes) -> None:
        if self.tls_required and not self.client.tls:
            raise ClientError("E_INVALID", f"cannot {_raw(name)} in current state (TLS required)")

    def _check_auth(self, cmd: str, topic: str, channel: str = "") -> None:
        if not self.auth_enabled:
            return
        state = self.client.auth_state
        if state is None:
            raise ClientError("E_AUTH_FIRST", f"AUTH required before {cmd}")
        if state.is_expired(self.nsqd.now_ns() / 1e9):
            raise AuthRefresh()
        if not state.allows(topic, channel):
            raise ClientError("E_UNAUTHORIZED", f"AUTH failed for {cmd} on {_go_quote(topic)} {_go_quote(channel)}")

    def _refusal_before_line(self, name: bytes) -> tuple[str, str] | None:
        """nsqd's checks of a body command before its line: IDENTIFY's state; for the others
        the TLS policy, then AUTH's state (no body is read when one fails)."""
        try:
            if name != b"IDENTIFY":
                self._check_tls(name)
            if name == b"IDENTIFY" or name == b"AUTH":
                self._require_state(name.decode(), STATE_INIT)
        except ClientError as err:
            return err.code, err.desc
        return None

    def _mpub_refusal(self, topic: str) -> tuple[str, str] | None:
        """nsqd authorizes an MPUB before it reads the body (PUB and DPUB after); an expired
        authorization is asked again once the body is in, by the handler."""
        try:
            self._check_auth("MPUB", topic)
        except ClientError as err:
            return err.code, err.desc
        except AuthRefresh:
            pass
        return None

    def _require_state(self, cmd: str, *states: int) -> None:
        if self.client.state not in states:
            raise ClientError("E_INVALID", f"cannot {cmd} in current state")

    @staticmethod
    def _message_id(params: list[bytes], cmd: str, needed: int) -> bytes:
        if len(params) < needed:
            raise ClientError("E_INVALID", f"{cmd} insufficient number of params")
        if len(params[1]) != message.MSG_ID_LENGTH:
            raise ClientError("E_INVALID", "invalid message ID")
        return params[1]

    _base10 = staticmethod(go_base10)

    def _req_timeout_ns(self, ms: int) -> int:
        """nsqd's REQ timeout: milliseconds made a Duration (which may wrap past int64),
        then clamped to [0, --max-req-timeout] instead of refused."""
        max_ns = int(self.nsqd.options.max_req_timeout * 1000) * 1_000_000
        return min(max(go_millis_ns(ms), 0), max_ns)

    def _topic_name(self, params: list[bytes], cmd: str, needed: int) -> str:
        if len(params) < needed:
            raise ClientError("E_INVALID", f"{cmd} insufficient number of parameters")
        name = params[1].decode(errors="replace")
        if not is_valid_topic_name(name):
            raise ClientError("E_BAD_TOPIC", bad_topic_text(cmd, params[1]))
        return name

    # ------------------------------------------------------------ commands
    def IDENTIFY(self, params, body, now_ns):
        client = self.client
        self._require_state("IDENTIFY", STATE_INIT)
        data = _decode_identify(body)
        opts = self.nsqd.options
        try:
            _identify(client, data, opts)
        except ValueError as exc:
            raise ClientError("E_BAD_BODY", f"IDENTIFY {exc}") from None
        client.identified_ns = now_ns
        log.info("IDENTIFY", client=client.remote_address, client_id=client.client_id,
                 user_agent=client.user_agent)
        client.on_wake()  # the pump re-reads the heartbeat interval
        if not client.feature_negotiation:
            return _OK
        tls_v1 = self.nsqd.tls_context is not None and data["tls_v1"]
        deflate = opts.deflate and data["deflate"]
        snappy = opts.snappy and data["snappy"]
        level = 6
        if deflate and data["deflate_level"] > 0:
            level = data["deflate_level"]
        level = min(level, opts.max_deflate_level)
        if deflate and snappy:
            raise ClientError("E_IDENTIFY_FAILED", "cannot enable both deflate and snappy compression")
        # a stream is upgraded once: TLS, then compression (each upgrade nested another layer, and a
        # client repeating IDENTIFY could nest them until the daemon ran out of stack)
        if tls_v1 and (client.tls or client.snappy or client.deflate):
            raise ClientError("E_IDENTIFY_FAILED", "IDENTIFY failed TLS must come first and only once")
        if (deflate or snappy) and (client.snappy or client.deflate):
            raise ClientError("E_IDENTIFY_FAILED", "IDENTIFY failed compression is already enabled")
        if tls_v1:
            self.pending.append(("tls",))
        if snappy:
            self.pending.append(("snappy",))
        if deflate:
            self.pending.append(("deflate", level))
        return message.encode_response(json.dumps({
            "max_rdy_count": opts.max_rdy_count,
            "version": NSQD_VERSION,
            "max_msg_timeout": int(opts.max_msg_timeout * 1000),
            "msg_timeout": client.msg_timeout_ns // 1_000_000,
            "tls_v1": tls_v1,
            "deflate": deflate,
            "deflate_level": level,
            "max_deflate_level": opts.max_deflate_level,
            "snappy": snappy,
            "sample_rate": client.sample_rate,
            "auth_required": self.auth_enabled,
            "output_buffer_size": client.output_buffer_size,
            "output_buffer_timeout": client.output_buffer_timeout_ns // 1_000_000,
            "topology_region": opts.topology_region,
            "topology_zone": opts.topology_zone,
            **({"leases": True} if client.leases_enabled else {}),
        }, separators=(",", ":")).encode())

    def AUTH(self, params, body, now_ns):
        self._require_state("AUTH", STATE_INIT)
        if len(params) != 1:
            raise ClientError("E_INVALID", "AUTH invalid number of parameters")
        if self.client.auth_state is not None:
            raise ClientError("E_INVALID", "AUTH already set")
        if not self.auth_enabled:
            raise ClientError("E_AUTH_DISABLED", "AUTH disabled")
        self.client.auth_secret = body.decode(errors="surrogateescape")  # the auth servers get its bytes
        self.pending.append(("auth",))
        return None

    def auth_done(self, state, error: str | None) -> None:
        """The I/O layer's answer to a pending ("auth",) step."""
        client = self.client
        client.flush_now = True
        first = client.auth_state is None
        if error is not None or state is None:
            log.warning("AUTH failed", client=client.remote_address, error=error)
            client.auth_state = None
            client.out.append(message.encode_error(b"E_AUTH_FAILED AUTH failed"))
            self.closed = True
            return
        if first and not state.authorizations:  # a refresh keeps it: the command's check refuses, as Go's
            client.out.append(message.encode_error(b"E_UNAUTHORIZED AUTH no authorizations found"))
            self.closed = True
            return
        client.auth_state = state
        client.authed = True
        client.auth_identity, client.auth_identity_url = state.identity, state.identity_url
        if first:
            client.out.append(message.encode_response(json.dumps({
                "identity": state.identity, "identity_url": state.identity_url,
                "permission_count": len(state.authorizations)}, separators=(",", ":")).encode()))

    def SUB(self, params, body, now_ns):
        client = self.client
        self._require_state("SUB", STATE_INIT)
        if client.heartbeat_interval_ns <= 0:
            raise ClientError("E_INVALID", "cannot SUB with heartbeats disabled")
        if len(params) < 3:
            raise ClientError("E_INVALID", "SUB insufficient number of parameters")
        topic_name = self._topic_name(params, "SUB", 3)
        channel_name = params[2].decode(errors="replace")
        if not is_valid_channel_name(channel_name):
            raise ClientError("E_BAD_CHANNEL", f"SUB channel name {_go_quote(params[2])} is not valid")
        self._check_auth("SUB", topic_name, channel_name)
        try:
            sub = self.nsqd.subscribe(topic_name, channel_name, client, budget=client.budget,
                                      msg_timeout_ns=client.msg_timeout_ns)
        except SubscribeError as exc:
            raise ClientError("E_SUB_FAILED", f"SUB failed {exc}") from None
        sub.sample_rate = client.sample_rate
        client.sub = sub
        client.state = STATE_SUBSCRIBED
        return _OK

    def RDY(self, params, body, now_ns):
        client = self.client
        if client.state == STATE_CLOSING:
            return None
        self._require_state("RDY", STATE_SUBSCRIBED)
        count = 1
        if len(params) > 1:
            count = go_int64(self._base10(params[1], "RDY could not parse count"))
        max_rdy = self.nsqd.options.max_rdy_count
        if not 0 <= count <= max_rdy:
            raise ClientError("E_INVALID", f"RDY count {count} out of range 0-{max_rdy}")
        client.budget.limit = count
        return None

    def FIN(self, params, body, now_ns):
        self._require_state("FIN", STATE_SUBSCRIBED, STATE_CLOSING)
        self._fin_many([self._message_id(params, "FIN", 2)])
        return None

    def _fin_many(self, ids: list[bytes]) -> None:
        client = self.client
        if client.state != STATE_SUBSCRIBED and client.state != STATE_CLOSING:
            err = ClientError("E_INVALID", "cannot FIN in current state")
            (self.held or client.out).append(message.encode_error(str(err).encode()))
            self.closed = True
            return
        failures = client.sub.finish(ids)
        if failures:
            out = self.held or client.out
            for msg_id, reason in failures:
                out.append(message.encode_error(
                    f"E_FIN_FAILED FIN {_raw(msg_id)} failed {reason}".encode(errors="surrogateescape")))

    def REQ(self, params, body, now_ns):
        client = self.client
        self._require_state("REQ", STATE_SUBSCRIBED, STATE_CLOSING)
        msg_id = self._message_id(params, "REQ", 3)
        delay_ns = self._req_timeout_ns(self._base10(params[2], "REQ could not parse timeout"))
        reason = client.sub.requeue(msg_id, delay_ns, now_ns)
        if reason is not None:
            raise ClientError("E_REQ_FAILED", f"REQ {_raw(msg_id)} failed {reason}",
                              fatal=False)
        return None

    def TOUCH(self, params, body, now_ns):
        client = self.client
        self._require_state("TOUCH", STATE_SUBSCRIBED, STATE_CLOSING)
        msg_id = self._message_id(params, "TOUCH", 2)
        reason = client.sub.touch(msg_id, now_ns)
        if reason is not None:
            raise ClientError("E_TOUCH_FAILED", f"TOUCH {_raw(msg_id)} failed {reason}",
                              fatal=False)
        return None

    def CLS(self, params, body, now_ns):
        self._require_state("CLS", STATE_SUBSCRIBED)
        self.client.state = STATE_CLOSING
        self.client.budget.limit = 0
        return _CLOSE_WAIT

    def NOP(self, params, body, now_ns):
        return None

    # ------------------------------------------------- lease extension
    def _lease_args(self, params: list[bytes], cmd: str, needed: int) -> str:
        client = self.client
        if not client.leases_enabled:  # a client that did not ask sees plain nsqd, which knows no such verb
            raise ClientError("E_INVALID", f"invalid command {cmd}")
        self._require_state(cmd, STATE_SUBSCRIBED, STATE_CLOSING)
        if len(params) < needed:
            raise ClientError("E_INVALID", f"{cmd} insufficient number of params")
        name = params[1].decode(errors="replace") if len(params) > 1 else ""
        if name and not _LEASE_NAME.match(name):
            raise ClientError("E_BAD_LEASE", f"{cmd} lease name {_go_quote(params[1])} is not valid")
        return name

    def LEASE(self, params, body, now_ns):
        """``LEASE <name>`` tags this connection's next deliveries; ``LEASE`` alone stops."""
        client = self.client
        name = self._lease_args(params, "LEASE", 1)
        sub = client.sub
        if not name:
            sub.close_lease()
            return _lease_response({"lease": "", "count": 0, "reopened": False})
        _lease, count, reopened, resend = sub.open_lease(name, now_ns)
        response = _lease_response({"lease": name, "count": count, "reopened": reopened})
        if resend:
            out = self.held or client.out
            out.append(response)
            out.extend(resend)
            return None
        return response

    def LFIN(self, params, body, now_ns):
        name = self._lease_args(params, "LFIN", 2)
        return _lease_response({"lease": name, "count": self.client.sub.finish_lease(name)})

    def LTOUCH(self, params, body, now_ns):
        name = self._lease_args(params, "LTOUCH", 2)
        return _lease_response({"lease": name, "count": self.client.sub.touch_lease(name, now_ns)})

    def LREQ(self, params, body, now_ns):
        name = self._lease_args(params, "LREQ", 3)
        delay_ns = self._req_timeout_ns(self._base10(params[2], "LREQ could not parse timeout"))
        count = self.client.sub.requeue_lease(name, delay_ns, now_ns)
        return _lease_response({"lease": name, "count": count})

    def PUB(self, params, body, now_ns):
        topic_name = _checked_topic(params)
        self._check_auth("PUB", topic_name)
        return self._publish(topic_name, "PUB", [body], 0)

    def DPUB(self, params, body, now_ns):
        """Deferred by nsqd's Duration of the timeout, which the parser checked (it may have wrapped)."""
        topic_name = _checked_topic(params)
        defer_ns = go_millis_ns(go_base10(params[2], "DPUB could not parse timeout"))
        self._check_auth("DPUB", topic_name)
        return self._publish(topic_name, "DPUB", [body], defer_ns)

    def MPUB(self, params, body, now_ns):
        topic_name = _checked_topic(params)
        self._check_auth("MPUB", topic_name)
        opts = self.nsqd.options
        try:
            if not MpubBatch.is_big(body, self.nsqd.messages_per_step(topic_name)):
                return self._publish(topic_name, "MPUB", split_mpub(body, opts.max_msg_size, opts.max_body_size), 0)
            publish = PublishInSteps(self.nsqd, topic_name)
            batch = MpubBatch(body, opts.max_msg_size, opts.max_body_size, publish.per_step)
        except BadBatch as err:
            raise ClientError(err.code, err.desc) from None
        # a big batch: validated, then stored a step at a time, other clients served between steps
        publish.total = batch.count
        self._big_mpub = (chain(batch.validate(), batch.steps()), publish)
        self.pending.append(("steps",))
        return None

    def publish_step(self) -> bool:
        """One step of a big ``MPUB`` (see ``nsqd/mpub.py``); False once it is answered.

        The I/O layer lets other tasks run between steps. Commands after the
        ``MPUB`` wait in the stash, as for any pending step.
        """
        steps, publish = self._big_mpub
        out = self.held if self.held else self.client.out
        try:
            bodies = next(steps, _DONE)
            if bodies is None:  # still validating
                return True
            if bodies is not _DONE:
                publish.step(bodies)
                return True
        except BadBatch as err:
            error = ClientError(err.code, err.desc)
        except PublishError as exc:
            error = ClientError("E_MPUB_FAILED", f"MPUB failed {exc.reason}", fatal=False)
        else:
            error = None
        self._big_mpub = None
        if error is not None:
            self._client_error(error, out)
            self.client.flush_now = True
            return False
        receipt = publish.receipt()
        if receipt.confirmed:
            self.client.pub_counts.add(publish.topic_name, receipt.count)
            out.append(_OK)
            self.client.flush_now = True
        else:
            self.held.append(Unconfirmed(receipt, "MPUB", publish.topic_name))
        return False

    def _publish(self, topic_name: str, cmd: str, bodies, defer_ns: int):
        batch = self.batch
        if batch is not None and batch.open and not defer_ns:
            return Unconfirmed(batch.stage(topic_name, bodies), cmd, topic_name)
        try:
            receipt = self.nsqd.publish(topic_name, bodies, defer_ns=defer_ns)
        except PublishError as exc:  # the publisher may retry on the same connection
            raise ClientError(f"E_{cmd}_FAILED", f"{cmd} failed {exc.reason}", fatal=False) from None
        if not receipt.confirmed:
            return Unconfirmed(receipt, cmd, topic_name)
        self.client.pub_counts.add(topic_name, receipt.count)
        return _OK


#: the commands, by name: functions of the class, not bound methods a connection would keep (a
#: table of those made each connection a reference cycle, freed only by a full collection)
_HANDLERS = {
    name.encode(): getattr(ProtocolV2, name)
    for name in ("IDENTIFY", "SUB", "RDY", "FIN", "REQ", "TOUCH", "PUB", "MPUB", "DPUB", "NOP", "CLS", "AUTH",
                 "LEASE", "LFIN", "LTOUCH", "LREQ")
}

#: IDENTIFY's fields, typed as nsqd's identifyDataV2 types them (leases is our
#: extension); sample_rate is an int32
_IDENTIFY_FIELDS = {
    "client_id": str, "hostname": str, "user_agent": str,
    "topology_region": str, "topology_zone": str,
    "heartbeat_interval": int, "output_buffer_size": int, "output_buffer_timeout": int,
    "deflate_level": int, "msg_timeout": int, "sample_rate": int,
    "feature_negotiation": bool, "tls_v1": bool, "deflate": bool, "snappy": bool, "leases": bool,
}
_FOLDED_FIELDS = {key.lower(): key for key in _IDENTIFY_FIELDS}
#: fields nsqd v1.3.0's identifyDataV2 does not have (newer nsqd's topology, our leases)
_NOT_IN_NSQD_130 = frozenset(("topology_region", "topology_zone", "leases"))
_INT_TOP = {"sample_rate": 1 << 31}  # the other integers are Go ints: 64 bits
_ZERO = {str: "", int: 0, bool: False}
_BAD_IDENTIFY_JSON = ("E_BAD_BODY", "IDENTIFY failed to decode JSON body")


def _raw(value: bytes) -> str:
    """Bytes from the client for an error text that gives them back as they came (nsqd formats
    them raw): undecodable ones ride as surrogates and are encoded back when the frame is written."""
    return value.decode(errors="surrogateescape")


def _no_constant(name: str):
    raise ValueError(f"{name} is not JSON")


def _json_int(text: str) -> int | float:
    """Integers past int64 become a float, which no integer field accepts (and
    Python's int() is never asked for thousands of digits)."""
    return int(text) if len(text) <= 20 else math.inf


class _Pairs(list):
    """A JSON object's members in their order (arrays stay plain lists)."""


def _decode_identify(body: bytes) -> dict:
    """Go's ``json.Unmarshal`` into identifyDataV2, so clients see nsqd's answer.

    Strict JSON (no NaN or Infinity); a known field of the wrong type, or an
    integer out of its Go type's range, fails; unknown fields are ignored;
    absent and null fields are zero, as is a ``null`` body; invalid UTF-8 in a
    string becomes U+FFFD. A key matches its field in any letter case, the
    exact name first, and the last key given for a field wins. Every failure is ``IDENTIFY failed to decode JSON body``.
    """
    try:
        pairs = json.loads(body.decode(errors="replace"), parse_constant=_no_constant, parse_int=_json_int,
                           object_pairs_hook=_Pairs)
    except (ValueError, RecursionError):
        raise ClientError(*_BAD_IDENTIFY_JSON) from None
    if pairs is None:
        pairs = _Pairs()
    if type(pairs) is not _Pairs:
        raise ClientError(*_BAD_IDENTIFY_JSON)
    data = {}
    for key, value in pairs:  # in order: a later key for the same field wins, a null changes nothing
        field = key if key in _IDENTIFY_FIELDS else _FOLDED_FIELDS.get(key.lower().replace("\u017f", "s"))
        if field is not None and value is not None:
            data[field] = value
    fields = {}
    for key, kind in _IDENTIFY_FIELDS.items():
        value = data.get(key)
        if value is None or (type(value) is not kind and key in _NOT_IN_NSQD_130):
            value = _ZERO[kind]  # nsqd v1.3.0 ignores a field it does not know, whatever its type
        elif type(value) is not kind:
            raise ClientError(*_BAD_IDENTIFY_JSON)
        elif kind is int and not -_INT_TOP.get(key, 1 << 63) <= value < _INT_TOP.get(key, 1 << 63):
            raise ClientError(*_BAD_IDENTIFY_JSON)
        elif kind is str:
            value = go_json_text(value)
        fields[key] = value
    return fields


def _identify(client: ClientV2, data: dict, opts) -> None:
    """Apply decoded IDENTIFY fields with nsqd's validation; raises ValueError naming the field.

    As nsqd's clientV2.Identify, the names and the topology are copied as given,
    absent ones as "": /stats then shows what the client said about itself.
    """
    client.client_id = data["client_id"]
    client.hostname = data["hostname"]
    client.user_agent = data["user_agent"]
    client.topology_region = data["topology_region"]
    client.topology_zone = data["topology_zone"]
    client.feature_negotiation = data["feature_negotiation"]
    client.leases_enabled = data["leases"]

    heartbeat = data["heartbeat_interval"]
    max_hb_ms = int(opts.max_heartbeat_interval * 1000)
    if heartbeat == -1:
        client.heartbeat_interval_ns = 0
    elif heartbeat == 0:
        pass
    elif 1000 <= heartbeat <= max_hb_ms:
        client.heartbeat_interval_ns = heartbeat * 1_000_000
    else:
        raise ValueError(f"heartbeat interval ({heartbeat}) is invalid")

    buf_timeout = data["output_buffer_timeout"]
    if buf_timeout == -1:
        client.output_buffer_timeout_ns = 0
    elif buf_timeout == 0:
        pass
    elif int(opts.min_output_buffer_timeout * 1000) <= buf_timeout <= int(opts.max_output_buffer_timeout * 1000):
        client.output_buffer_timeout_ns = buf_timeout * 1_000_000
    else:
        raise ValueError(f"output buffer timeout ({buf_timeout}) is invalid")

    buf_size = data["output_buffer_size"]
    if buf_size == -1:
        client.output_buffer_size = 1
        client.output_buffer_timeout_ns = 0
    elif buf_size == 0:
        pass
    elif 64 <= buf_size <= opts.max_output_buffer_size:
        client.output_buffer_size = buf_size
    else:
        raise ValueError(f"output buffer size ({buf_size}) is invalid")

    sample_rate = data["sample_rate"]
    if not 0 <= sample_rate <= 99:
        raise ValueError(f"sample rate ({sample_rate}) is invalid")
    client.sample_rate = sample_rate

    msg_timeout = data["msg_timeout"]
    if msg_timeout == 0:
        pass
    elif 1000 <= msg_timeout <= int(opts.max_msg_timeout * 1000):
        client.msg_timeout_ns = msg_timeout * 1_000_000
    else:
        raise ValueError(f"msg timeout ({msg_timeout}) is invalid")


_LEASE_NAME = re.compile(r"^[.a-zA-Z0-9_:#-]{1,128}$")


def _lease_response(fields: dict) -> bytes:
    return message.encode_response(json.dumps(fields, separators=(",", ":")).encode())


_GO_ESCAPES = {7: "\\a", 8: "\\b", 9: "\\t", 10: "\\n", 11: "\\v", 12: "\\f", 13: "\\r",
               0x22: '\\"', 0x5C: "\\\\"}


def _go_quote(raw: bytes | str) -> str:
    """Go's %q (``strconv.Quote``) for the names we echo back in errors, from their bytes.

    Printable characters as they are, Go's short escapes, other control
    bytes as ``\\xHH`` (JSON wrote ``\\u0000``), bytes that are not UTF-8 as
    ``\\xHH`` (a decode had made them U+FFFD), other unprintable characters as
    ``\\uHHHH`` or ``\\UHHHHHHHH``.
    """
    text = raw.decode("utf-8", "surrogateescape") if isinstance(raw, bytes) else raw
    out = ['"']
    for ch in text:
        code = ord(ch)
        if 0xDC80 <= code <= 0xDCFF:  # a byte that was not UTF-8
            out.append(f"\\x{code - 0xDC00:02x}")
        elif code in _GO_ESCAPES:
            out.append(_GO_ESCAPES[code])
        elif ch.isprintable():
            out.append(ch)
        elif code < 0x20 or code == 0x7F:
            out.append(f"\\x{code:02x}")
        elif code < 0x10000:
            out.append(f"\\u{code:04x}")
        else:
            out.append(f"\\U{code:08x}")
    out.append('"')
    return "".join(out)
