"""nsqd's HTTP API: the app served by our own HTTP/1.1 server (nsqd/http_server.py).

Paths, parameters, status codes, bodies and headers follow Go nsqd 1.3
(``nsqd/http.go`` and ``internal/http_api``), so nsqadmin, nsq_stat and
scripts written against nsqd work unchanged. Responses come in Go's two
styles: /ping answers plain text; everything else is "V1": an
``X-NSQ-Content-Type`` header, JSON for structured answers, and errors as
``{"message": "<CODE>"}``. Handlers touch the daemon synchronously; the only
thing they await is the request body, which is never read past its limit.
See docs/http.md for the endpoint reference and our differences from Go.
"""

from __future__ import annotations

import json
import re
import socket
import time
from collections.abc import Awaitable, Callable, Sequence
from contextlib import AbstractContextManager, asynccontextmanager, nullcontext
from dataclasses import dataclass
from functools import partial
from urllib.parse import unquote_to_bytes

import structlog
import trio

from . import auth, http_server, message, metrics, policy, stats, statsd
from .body_budget import BIG_BODY, NO_ROOM
from .broker import PublishError, PublishInSteps, Receipt
from .channel import ChannelExiting
from .diskq import DiskQueueError
from .mpub import BadBatch, LinesBatch, MpubBatch, cut_short, split_lines, split_mpub
from .names import go_json_text, is_valid_channel_name, is_valid_topic_name
from .options import (
    MAX_LOOKUPD_ADDRESSES, OVERFLOW_POLICIES, TLS_REQUIRED, OptionsError, host_of, parse_log_level, split_host_port,
)
from .protocol_v2 import go_millis_ns
from .version import NSQD_VERSION

log = structlog.get_logger("nsqd.http")

JSON_TYPE = b"application/json; charset=utf-8"
TEXT_TYPE = b"text/plain; charset=utf-8"
PROMETHEUS_TYPE = b"text/plain; version=0.0.4; charset=utf-8"
_V1_HEADER = (b"X-Nsq-Content-Type", b"nsq; version=1.0")

# Go's boolParams: anything else means "use the default"
_BOOL_PARAMS = {"true": True, "1": True, "false": False, "0": False}
_INT64 = re.compile(r"[+-]?[0-9]+\Z")


class HTTPError(Exception):
    """A non-200 answer: the status and Go's message text."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


@dataclass(frozen=True)
class Body:
    """A response body with its content type (None: no Content-Type header)."""

    data: bytes
    content_type: bytes | None


def json_body(value: object) -> Body:
    return Body(stats.go_json(value), JSON_TYPE)


def text_body(data: bytes | str) -> Body:
    """Raw bytes; Go's net/http sniffs such bodies as text, and types empty ones not at all."""
    if isinstance(data, str):
        data = data.encode()
    return Body(data, TEXT_TYPE if data else None)


# ----------------------------------------------------------------- request


def parse_query(raw: bytes) -> dict[str, list[str]]:
    """Go's url.ParseQuery: ``&``-separated, ``+`` is a space; bad escapes and ``;`` are errors."""
    values: dict[str, list[str]] = {}
    for part in raw.split(b"&"):
        if b";" in part:
            raise ValueError("invalid semicolon separator in query")
        if not part:
            continue
        key, _, value = part.partition(b"=")
        values.setdefault(_unescape(key), []).append(_unescape(value))
    return values


def _unescape(text: bytes) -> str:
    if http_server.BAD_ESCAPE.search(text):
        raise ValueError(f"invalid URL escape in {text!r}")
    return unquote_to_bytes(text.replace(b"+", b" ")).decode("utf-8", "surrogateescape")


@dataclass
class Request:
    method: str
    path: str
    raw_query: bytes
    content_length: int | None
    receive: Callable[[], Awaitable[bytes]]  # the next piece of body, b"" at its end
    secure: bool = False
    secret: str = ""
    remote_ip: str = ""
    #: the context of a wait on the auth server (http_server.Request.waiting_elsewhere)
    waiting_elsewhere: Callable[[], AbstractContextManager[None]] = nullcontext

    @property
    def uri(self) -> str:
        query = self.raw_query.decode("latin-1")
        return f"{self.path}?{query}" if query else self.path

    def query(self) -> dict[str, list[str]]:
        try:
            return parse_query(self.raw_query)
        except ValueError as exc:
            log.error("failed to parse request params", uri=self.uri, error=str(exc))
            raise HTTPError(400, "INVALID_REQUEST") from None

    async def read_body(self, limit: int) -> bytes:
        """The body, cut at ``limit + 1`` bytes: a longer result means "too big".

        Gathered in one buffer: a list of the pieces held an object per chunk of a
        chunked body, 60 bytes for each 1-byte chunk.
        """
        body = bytearray()
        while len(body) <= limit:
            try:
                chunk = await self.receive()
            except http_server.BrokenBody as exc:
                exc.received = bytes(body)
                raise
            if not chunk:
                break
            body += chunk
        del body[limit + 1:]
        return bytes(body)


def _first(query: dict[str, list[str]], key: str) -> str | None:
    """Go's ReqParams.Get: the first value, or None when the key is absent."""
    values = query.get(key)
    return values[0] if values else None


# --------------------------------------------------------------------- app


Handler = Callable[..., Awaitable[object]]


class HTTPAPI:
    """The application: routing, Go's response styles, and the handlers."""

    def __init__(self, nsqd) -> None:
        self.nsqd = nsqd
        #: by (secret, remote IP, TLS): the auth server's answer may depend on all three, as it does
        #: for the TCP protocol's AUTH
        self._auth_cache: dict[tuple[str, str, bool], auth.AuthState] = {}
        #: the auth queries under way, by the same key: requests that need the same answer share
        #: one query (at most one per connection is waiting, so this is bounded by the HTTP cap)
        self._auth_asking: dict[tuple[str, str, bool], _AuthQuery] = {}
        #: the lookupd addresses were last set to JSON null, which Go's /config answers as null
        self._lookupd_null = False
        # path -> method -> handler; /ping alone answers in plain text
        self.routes: dict[str, dict[str, Handler]] = {
            "/ping": {"GET": self.ping},
            "/info": {"GET": self.info},
            "/stats": {"GET": self.stats},
            "/metrics": {"GET": self.metrics},
            "/pub": {"POST": self.pub},
            "/mpub": {"POST": self.mpub},
            "/topic/create": {"POST": self.topic_create},
            "/topic/delete": {"POST": self.topic_delete},
            "/topic/empty": {"POST": self.topic_empty},
            "/topic/pause": {"POST": partial(self.topic_pause, pause=True)},
            "/topic/unpause": {"POST": partial(self.topic_pause, pause=False)},
            "/channel/create": {"POST": self.channel_create},
            "/channel/delete": {"POST": self.channel_delete},
            "/channel/empty": {"POST": self.channel_empty},
            "/channel/pause": {"POST": partial(self.channel_pause, pause=True)},
            "/channel/unpause": {"POST": partial(self.channel_pause, pause=False)},
            "/config/:opt": {"GET": self.config, "PUT": self.config},
            "/topic/limits": {"POST": self.topic_limits},
            "/channel/limits": {"POST": self.channel_limits},
            "/topic/redrive": {"POST": self.topic_redrive},
        }

    async def __call__(self, http_request: http_server.Request) -> http_server.Response:
        """One request in, its answer out (the server adds the framing headers)."""
        started = time.perf_counter()
        fields = http_request.headers
        request = Request(
            method=http_request.method,
            path=http_request.path,
            raw_query=http_request.raw_query,
            content_length=_content_length(fields),
            receive=http_request.receive,
            secure=http_request.secure,
            secret=_bearer(fields),
            remote_ip=host_of(http_request.remote),
            waiting_elsewhere=http_request.waiting_elsewhere,
        )
        status, headers, body = await self.respond(request)
        if body.content_type is not None:
            headers.append((b"Content-Type", body.content_type))
        log.debug("http request", status=status, method=request.method, uri=request.uri,
                  remote=http_request.remote, elapsed_ms=round((time.perf_counter() - started) * 1000, 3))
        return http_server.Response(status, headers, body.data)

    async def respond(self, request: Request) -> tuple[int, list[tuple[bytes, bytes]], Body]:
        """Route the request and shape the answer in the handler's style."""
        if self.nsqd.options.tls_required == TLS_REQUIRED and not request.secure:
            # nsqd refuses plain HTTP outright when TLS is required everywhere
            bound = self.nsqd.https_addresses
            https_port = bound[0][1] if bound else 0
            data = b'{"message": "TLS_REQUIRED", "https_port": %d}' % https_port
            return 403, [_V1_HEADER], Body(data, JSON_TYPE)
        methods, params = self._match(request.path)
        if methods is None:
            return _v1_error(404, "NOT_FOUND")
        handler = methods.get(request.method)
        if handler is None:
            allow = ", ".join(sorted([*methods, "OPTIONS"])).encode()
            if request.method == "OPTIONS":
                return 200, [(b"Allow", allow)], Body(b"", None)
            status, headers, body = _v1_error(405, "METHOD_NOT_ALLOWED")
            return status, [(b"Allow", allow), *headers], body
        if self.nsqd.options.auth_http_addresses and request.path not in _OPEN_PATHS and request.method != "GET":
            try:
                refused = await self._check_auth(request)
            except HTTPError as err:  # a query that does not parse
                refused = err.status, err.message
            if refused is not None:
                return _v1_error(*refused)
        status, result = await self._run(handler, request, params)
        if request.path == "/metrics" and status == 200:
            return 200, [], Body(result, PROMETHEUS_TYPE)
        if request.path == "/ping":  # Go's PlainText style
            return status, [], text_body(result)
        if status != 200:
            return _v1_error(status, result)
        return 200, [_V1_HEADER], _v1_body(result)

    async def _check_auth(self, request: Request) -> tuple[int, str] | None:
        """With auth on, publishing and admin calls carry ``Authorization: Bearer <secret>``.

        /pub and /mpub need publish permission on the topic; topic and channel
        admin calls need both publish and subscribe on the topic (and channel);
        PUT /config needs any valid secret.
        """
        if not request.secret:
            return 401, "AUTH_REQUIRED"
        key = (request.secret, request.remote_ip, request.secure)
        state = self._auth_cache.get(key)
        if state is None or state.is_expired(self.nsqd.now_ns() / 1e9):
            try:
                with request.waiting_elsewhere():
                    state = await self._ask_auth(request, key)
            except auth.AuthError as exc:
                log.warning("HTTP AUTH failed", error=str(exc))
                return 401, "AUTH_FAILED"
        if request.path.startswith("/config/"):
            return None if state.authorizations else (403, "AUTH_UNAUTHORIZED")
        query = request.query()
        # the values the handlers act on: the first of a repeated parameter
        topic = _first(query, "topic") or ""
        channel = _first(query, "channel") or ""
        if request.path in ("/pub", "/mpub"):
            allowed = state.allows(topic)
        else:
            allowed = state.allows(topic) and state.allows(topic, channel or ".")
        if request.path == "/topic/redrive":  # it publishes to another topic too
            allowed = allowed and state.allows(_first(query, "to") or "")
        return None if allowed else (403, "AUTH_UNAUTHORIZED")

    async def _ask_auth(self, request: Request, key: tuple[str, str, bool]) -> auth.AuthState:
        """The auth server's answer for ``key``, cached; joins the query under way for it, if any.

        A query whose asker was cancelled (closed to make room at the cap) leaves no answer: the
        requests that waited on it ask again, one of them for all.
        """
        while (query := self._auth_asking.get(key)) is not None:
            await query.done.wait()
            if query.state is not None:
                return query.state
            if query.error is not None:
                raise query.error
        query = self._auth_asking[key] = _AuthQuery()
        opts = self.nsqd.options
        try:
            state = await auth.query_any(
                opts.auth_http_addresses, remote_ip=request.remote_ip, tls=request.secure,
                secret=request.secret, now=self.nsqd.now_ns() / 1e9, method=opts.auth_http_request_method,
                connect_timeout=opts.http_client_connect_timeout,
                request_timeout=opts.http_client_request_timeout)
        except auth.AuthError as exc:
            query.error = exc
            raise
        finally:
            del self._auth_asking[key]
            query.done.set()
        query.state = state
        if len(self._auth_cache) >= _AUTH_CACHE_SIZE:
            self._auth_cache.pop(next(iter(self._auth_cache)))
        self._auth_cache[key] = state
        return state

    @staticmethod
    async def _run(handler: Handler, request: Request, params: dict[str, str]) -> tuple[int, object]:
        """The handler's status and result; any failure becomes a status and Go's message."""
        try:
            return 200, await handler(request, **params)
        except http_server.BrokenBody as exc:  # as nsqd's handlers answer a failed read
            log.info("HTTP request body broke off", uri=request.uri, error=exc.detail)
            return 500, "INTERNAL_ERROR"
        except http_server.RequestAborted:  # the server answers (or drops) the client itself
            raise
        except HTTPError as err:
            return err.status, err.message
        except Exception:
            log.exception("HTTP handler failed", method=request.method, uri=request.uri)
            return 500, "INTERNAL_ERROR"

    def _match(self, path: str) -> tuple[dict[str, Handler] | None, dict[str, str]]:
        methods = self.routes.get(path)
        if methods is not None:
            return methods, {}
        opt = path.removeprefix("/config/")
        if opt != path and opt and "/" not in opt:
            return self.routes["/config/:opt"], {"opt": opt}
        return None, {}

    # ------------------------------------------------------------ helpers
    def _get_topic(self, name: str):
        try:
            return self.nsqd.get_topic(name)
        except ChannelExiting:  # the daemon is shutting down
            raise HTTPError(503, "EXITING") from None
        except DiskQueueError as exc:
            raise HTTPError(503, f"STORAGE_FAILED: {exc}") from None

    def _existing_topic(self, name: str):
        topic = self.nsqd.get_existing_topic(name)
        if topic is None:
            raise HTTPError(404, "TOPIC_NOT_FOUND")
        return topic

    @staticmethod
    def _topic_arg(query: dict[str, list[str]]) -> str:
        """The topic of /pub, /mpub, /topic/create and /topic/empty."""
        name = _first(query, "topic")
        if name is None:
            raise HTTPError(400, "MISSING_ARG_TOPIC")
        if not is_valid_topic_name(name):
            raise HTTPError(400, "INVALID_TOPIC")
        return name

    def _topic_and_channel(self, request: Request):
        """The existing topic and the channel name of a /channel/* request."""
        query = request.query()
        topic_name = _first(query, "topic")
        if topic_name is None:
            raise HTTPError(400, "MISSING_ARG_TOPIC")
        if not is_valid_topic_name(topic_name):
            raise HTTPError(400, "INVALID_ARG_TOPIC")
        channel_name = _first(query, "channel")
        if channel_name is None:
            raise HTTPError(400, "MISSING_ARG_CHANNEL")
        if not is_valid_channel_name(channel_name):
            raise HTTPError(400, "INVALID_ARG_CHANNEL")
        return self._existing_topic(topic_name), channel_name

    def _existing_channel(self, request: Request):
        topic, channel_name = self._topic_and_channel(request)
        channel = topic.channels.get(channel_name)
        if channel is None:
            raise HTTPError(404, "CHANNEL_NOT_FOUND")
        return channel

    async def _publish(self, cmd: str, topic_name: str, bodies, defer_ns: int = 0) -> None:
        """The core publish, answered once confirmed: 503 when it is refused or cannot be made durable."""
        try:
            receipt = self.nsqd.publish(topic_name, bodies, defer_ns=defer_ns)
        except PublishError as exc:
            raise self._publish_error(cmd, topic_name, exc) from None
        await self._confirmed(cmd, topic_name, receipt)

    async def _confirmed(self, cmd: str, topic_name: str, receipt: Receipt) -> None:
        if not receipt.confirmed:
            try:
                await receipt.wait()
            except PublishError as exc:
                raise self._publish_error(cmd, topic_name, exc) from None

    @staticmethod
    def _publish_error(cmd: str, topic_name: str, exc: PublishError) -> HTTPError:
        if exc.kind == "exiting":
            return HTTPError(503, "EXITING")
        if exc.kind == "storage":
            log.error("publish failed", cmd=cmd, topic=topic_name, error=exc.reason)
        return HTTPError(503, f"{cmd}_FAILED: {exc.reason}")

    # ------------------------------------------------------------ handlers
    async def ping(self, request: Request) -> str:
        if self.nsqd.health != "OK":
            raise HTTPError(500, self.nsqd.health)
        return "OK"

    async def info(self, request: Request) -> dict:
        nsqd = self.nsqd
        opts = nsqd.options
        return {
            "version": NSQD_VERSION,
            "broadcast_address": opts.broadcast_address,
            "hostname": socket.gethostname(),
            "http_port": nsqd.http_addresses[0][1] if nsqd.http_addresses else -1,
            "tcp_port": nsqd.tcp_addresses[0][1] if nsqd.tcp_addresses else -1,
            "start_time": int(nsqd.start_time),
            "max_heartbeat_interval": opts.config_value("max_heartbeat_interval"),
            "max_output_buffer_size": opts.max_output_buffer_size,
            "max_output_buffer_timeout": opts.config_value("max_output_buffer_timeout"),
            "max_deflate_level": opts.max_deflate_level,
            "topology_zone": opts.topology_zone,
            "topology_region": opts.topology_region,
        }

    async def stats(self, request: Request) -> Body:
        query = request.query()
        snap = await stats.snapshot_paced(
            self.nsqd,
            topic=_first(query, "topic") or None,
            channel=_first(query, "channel") or None,
            include_clients=_BOOL_PARAMS.get(_first(query, "include_clients"), True),
            include_mem=_BOOL_PARAMS.get(_first(query, "include_mem"), True),
        )
        if _first(query, "format") == "json":
            return Body(await stats.render_json_paced(snap), JSON_TYPE)
        return text_body(await stats.render_text_paced(snap))

    async def pub(self, request: Request) -> str:
        nsqd = self.nsqd
        opts = nsqd.options
        if request.content_length is not None and request.content_length > opts.max_msg_size:
            raise HTTPError(413, "MSG_TOO_BIG")
        body = await request.read_body(opts.max_msg_size)
        if len(body) > opts.max_msg_size:
            raise HTTPError(413, "MSG_TOO_BIG")
        if not body:
            raise HTTPError(400, "MSG_EMPTY")
        query = request.query()
        topic_name = self._topic_arg(query)
        defer_ns = 0
        defer = _first(query, "defer")
        if defer is not None:
            if not _INT64.match(defer) or not -(2**63) <= int(defer) < 2**63:
                raise HTTPError(400, "INVALID_DEFER")
            defer_ns = go_millis_ns(int(defer))  # a Duration in Go: it may wrap, then is checked
            if not 0 <= defer_ns <= round(opts.max_req_timeout * 1e9):
                raise HTTPError(400, "INVALID_DEFER")
        await self._publish("PUB", topic_name, [body], defer_ns)
        return "OK"

    async def mpub(self, request: Request) -> str:
        nsqd = self.nsqd
        opts = nsqd.options
        if request.content_length is not None and request.content_length > opts.max_body_size:
            raise HTTPError(413, "BODY_TOO_BIG")
        query = request.query()
        topic_name = self._topic_arg(query)
        binary = False
        binary_param = _first(query, "binary")
        if binary_param is not None:
            binary = _BOOL_PARAMS.get(binary_param, True)
            if binary_param not in _BOOL_PARAMS:
                log.warning("deprecated value used for /mpub binary param", value=binary_param)
        async with self._body_memory(request, opts.max_body_size, "MPUB"):
            try:
                body = await request.read_body(opts.max_body_size)
            except http_server.BrokenBody as exc:
                if not binary:
                    raise
                # nsqd's reader fails on the part it could not read, whatever broke it
                code, _ = cut_short(exc.received, opts.max_msg_size, opts.max_body_size)
                raise HTTPError(413, code.removeprefix("E_")) from None
            if len(body) > opts.max_body_size:
                raise HTTPError(413, "BODY_TOO_BIG")
            await self._mpub_body(topic_name, body, binary)
        return "OK"

    async def _mpub_body(self, topic_name: str, body: bytes, binary: bool) -> None:
        nsqd = self.nsqd
        opts = nsqd.options
        try:
            publish = PublishInSteps(nsqd, topic_name)
            if binary and not MpubBatch.is_big(body, publish.per_step):
                bodies = split_mpub(body, opts.max_msg_size, opts.max_body_size)
            elif not binary and not LinesBatch.is_big(body, publish.per_step):
                bodies = split_lines(body, opts.max_msg_size)
            else:
                await self._publish_big(publish, MpubBatch(body, opts.max_msg_size, opts.max_body_size,
                                                           publish.per_step)
                                        if binary else LinesBatch(body, opts.max_msg_size, publish.per_step))
                return
        except BadBatch as err:
            raise HTTPError(413, err.code.removeprefix("E_")) from None
        if not bodies:  # nsqd creates the topic all the same
            self._get_topic(topic_name)
            return
        await self._publish("MPUB", topic_name, bodies)

    @asynccontextmanager
    async def _body_memory(self, request: Request, limit: int, command: str):
        """Hold the shared body budget while a big body is read and published (see body_budget.py):
        its declared size, or ``limit`` for a chunked one. Without room in time the body is read
        and dropped, and the request answered ``503 <command>_FAILED: ...; try again``."""
        size = limit if request.content_length is None else min(request.content_length, limit)
        if size <= BIG_BODY:
            yield
            return
        budget = self.nsqd.body_budget
        if not await budget.take(size):
            received = 0
            while received <= limit:  # past it the connection closes with the answer
                piece = await request.receive()
                if not piece:
                    break
                received += len(piece)
            raise HTTPError(503, f"{command}_FAILED: {NO_ROOM}")
        try:
            yield
        finally:
            budget.give_back(size)

    async def _publish_big(self, publish: PublishInSteps, batch: MpubBatch | LinesBatch) -> None:
        """A big batch (see ``nsqd/mpub.py``): validated, then stored a step at a time, other
        requests and clients served between steps."""
        topic_name = publish.topic_name
        for _ in batch.validate():
            await trio.lowlevel.checkpoint()
        if not batch.count:
            self._get_topic(topic_name)
            return
        publish.total = batch.count
        first = True
        with trio.CancelScope(shield=True):  # stored to its end though the daemon stops meanwhile
            for bodies in batch.steps():
                if not first:
                    await trio.lowlevel.checkpoint()
                first = False
                try:
                    publish.step(bodies)
                except PublishError as exc:
                    raise self._publish_error("MPUB", topic_name, exc) from None
        await self._confirmed("MPUB", topic_name, publish.receipt())

    async def topic_create(self, request: Request) -> None:
        self._get_topic(self._topic_arg(request.query()))
        await self.nsqd.metadata_saved()  # created, deleted, paused: in nsqd.dat before the 200

    async def topic_delete(self, request: Request) -> None:
        name = _first(request.query(), "topic")
        if name is None:
            raise HTTPError(400, "MISSING_ARG_TOPIC")
        self._existing_topic(name)
        self.nsqd.delete_topic(name)
        await self.nsqd.metadata_saved()  # a crash right after must not bring it back

    async def topic_empty(self, request: Request) -> None:
        self._existing_topic(self._topic_arg(request.query())).empty()

    async def topic_pause(self, request: Request, *, pause: bool) -> None:
        name = _first(request.query(), "topic")
        if name is None:
            raise HTTPError(400, "MISSING_ARG_TOPIC")
        topic = self._existing_topic(name)
        if pause:
            topic.pause()
        else:
            topic.unpause()
        self.nsqd.persist_metadata_soon()
        await self.nsqd.metadata_saved()  # as Go: a crash right after must not undo it

    async def metrics(self, request: Request) -> bytes:
        """Prometheus text format of the same figures as /stats."""
        snapshot = await stats.snapshot_paced(self.nsqd, include_clients=False)
        budget = self.nsqd.body_budget
        return await metrics.render_paced(snapshot, len(self.nsqd.clients),
                                          (budget.used, budget.capacity, budget.waits, budget.refusals))

    # ------------------------------------------------- policies beyond nsqd
    async def topic_limits(self, request: Request) -> dict:
        """Set a topic's limits and policies (and its channels' defaults); answers them all."""
        query = request.query()
        name = _first(query, "topic")
        if name is None:
            raise HTTPError(400, "MISSING_ARG_TOPIC")
        topic = self._existing_topic(name)
        changes: dict = _policy_args(query, ("max_messages", "channel_max_messages", "channel_max_bytes",
                                             "max_attempts", "message_ttl_ms"))
        overflow = _first(query, "overflow")
        if overflow is not None:
            if overflow not in OVERFLOW_POLICIES:
                raise HTTPError(400, "INVALID_ARG_OVERFLOW")
            changes["overflow"] = overflow
        durable = _first(query, "durable")
        if durable is not None:
            if durable not in _BOOL_PARAMS:
                raise HTTPError(400, "INVALID_ARG_DURABLE")
            changes["durable"] = _BOOL_PARAMS[durable]
        self.nsqd.set_topic_policy(topic, changes)
        await self.nsqd.metadata_saved()  # a durable policy must outlive a crash right after its 200
        return policy.topic_document(topic.policy)

    async def channel_limits(self, request: Request) -> dict:
        topic, channel_name = self._topic_and_channel(request)
        channel = topic.channels.get(channel_name)
        if channel is None:
            raise HTTPError(404, "CHANNEL_NOT_FOUND")
        self.nsqd.set_channel_policy(channel, _policy_args(
            request.query(), ("max_messages", "max_bytes", "max_attempts", "message_ttl_ms")))
        await self.nsqd.metadata_saved()
        return policy.channel_document(channel.policy)

    async def topic_redrive(self, request: Request) -> dict:
        """Move messages kept by a topic with no channels (dead letters) to another topic.

        They keep their ids and start over with attempts 1. ``count`` bounds how
        many (default: all of them).
        """
        query = request.query()
        name = _first(query, "topic")
        target = _first(query, "to")
        if name is None:
            raise HTTPError(400, "MISSING_ARG_TOPIC")
        if target is None or not is_valid_topic_name(target):
            raise HTTPError(400, "INVALID_ARG_TO")
        source = self._existing_topic(name)
        if source.channels:
            raise HTTPError(400, "TOPIC_HAS_CHANNELS")
        if self.nsqd.draining:
            raise HTTPError(503, "EXITING")
        count = _policy_args(query, ("count",)).get("count", source.depth)
        moved = 0
        per_step = self.nsqd.messages_per_step(target)
        # in steps, other clients served between them: a dead-letter topic may hold millions
        while moved < count and not (source.exiting or source.channels or self.nsqd.draining):
            frames = [message.with_attempts(f, 1) for f in source.take_backlog(min(count - moved, per_step))]
            if not frames:
                break
            try:
                queues = self.nsqd.publish_frames(target, frames)
            except Exception as exc:  # a limit or the disk: the messages go back where they were
                source.publish(list(map(message.frame_id_of, frames)), frames, 0)
                raise HTTPError(503, f"MPUB_FAILED: {exc} ({moved} moved before)") from None
            moved += len(frames)
            await self._confirmed("MPUB", target, Receipt(len(frames), queues))
            await trio.lowlevel.checkpoint()
        return {"moved": moved, "left": source.depth}

    async def channel_create(self, request: Request) -> None:
        topic, channel_name = self._topic_and_channel(request)
        try:
            topic.get_channel(channel_name)
        except ChannelExiting:
            raise HTTPError(503, "EXITING") from None
        except DiskQueueError as exc:
            raise HTTPError(503, f"STORAGE_FAILED: {exc}") from None
        await self.nsqd.metadata_saved()

    async def channel_delete(self, request: Request) -> None:
        topic, channel_name = self._topic_and_channel(request)
        if channel_name not in topic.channels:
            raise HTTPError(404, "CHANNEL_NOT_FOUND")
        self.nsqd.delete_channel(topic, channel_name)
        await self.nsqd.metadata_saved()  # a resurrected channel would collect every message for no one

    async def channel_empty(self, request: Request) -> None:
        channel = self._existing_channel(request)
        channel.empty()
        self.nsqd.topics[channel.topic_name].readers_changed()

    async def channel_pause(self, request: Request, *, pause: bool) -> None:
        channel = self._existing_channel(request)
        if pause:
            channel.pause()
        else:
            channel.unpause()
        self.nsqd.persist_metadata_soon()
        await self.nsqd.metadata_saved()

    async def config(self, request: Request, opt: str) -> Body:
        opts = self.nsqd.options
        if request.method == "PUT":
            body = await request.read_body(opts.max_msg_size)
            if not body or len(body) > opts.max_msg_size:
                raise HTTPError(413, "INVALID_VALUE")
            if opt == "nsqlookupd_tcp_addresses":
                addresses = _lookupd_addresses(body)
                self.nsqd.set_option("lookupd_tcp_addresses", addresses or [])
                self._lookupd_null = addresses is None
            elif opt == "log_level":
                try:
                    self.nsqd.set_option("log_level", parse_log_level(body.decode()))
                except (OptionsError, UnicodeDecodeError):
                    raise HTTPError(400, "INVALID_VALUE") from None
            else:
                raise HTTPError(400, "INVALID_OPTION")
            log.info("option changed", option=opt, value=opts.config_value(opt))
        data = opts.config_json(opt)
        if data is None:
            raise HTTPError(400, "INVALID_OPTION")
        data = b"null" if opt == "nsqlookupd_tcp_addresses" and self._lookupd_null else self._as_started(opt, data)
        if isinstance(opts.config_value(opt), str):
            return text_body(data)
        return Body(data, JSON_TYPE)

    def _as_started(self, opt: str, data: bytes) -> bytes:
        """An option Go's New rewrites once it listens, as /config then reports it: the broadcast
        ports (0: the bound ones) and the statsd prefix (``%s``: the host key, a dot at the end)."""
        nsqd = self.nsqd
        if opt == "broadcast_tcp_port":
            return b"%d" % nsqd.broadcast_tcp_port
        if opt == "broadcast_http_port":
            return b"%d" % nsqd.broadcast_http_port
        if opt == "statsd_prefix":
            opts = nsqd.options
            return statsd.metric_prefix(opts.statsd_prefix, opts.broadcast_address, nsqd.broadcast_http_port).encode()
        return data


def _lookupd_addresses(body: bytes) -> list[str] | None:
    """A JSON list of host:port strings, or None for null (none); anything else is INVALID_VALUE."""
    try:
        value = json.loads(body)
        if value is None:
            return None
        if not isinstance(value, list) or not all(isinstance(a, str) for a in value):
            raise ValueError("not a list of strings")
        value = [go_json_text(address) for address in value]
        if len(set(value)) > MAX_LOOKUPD_ADDRESSES:
            raise ValueError("too many addresses")
        for address in value:
            split_host_port(address)
    except (ValueError, RecursionError):  # also OptionsError, JSON errors, and JSON nested too deep
        raise HTTPError(400, "INVALID_VALUE") from None
    return value


def _v1_body(result: object) -> Body:
    """Go's RespondV1 for a 200: strings and bytes raw, nothing empty, the rest JSON."""
    if isinstance(result, Body):
        return result
    if result is None:
        return Body(b"", None)
    if isinstance(result, (str, bytes)):
        return text_body(result)
    return json_body(result)


def _v1_error(status: int, message: str) -> tuple[int, list[tuple[bytes, bytes]], Body]:
    return status, [_V1_HEADER], json_body({"message": message})


#: endpoints that stay open when auth is on (they only read)
_OPEN_PATHS = frozenset(("/ping", "/info", "/stats", "/metrics"))
_AUTH_CACHE_SIZE = 1024


class _AuthQuery:
    """One auth query under way, and its outcome once ``done`` is set (neither: cancelled)."""

    __slots__ = ("done", "state", "error")

    def __init__(self) -> None:
        self.done = trio.Event()
        self.state: auth.AuthState | None = None
        self.error: auth.AuthError | None = None


def _policy_args(query: dict[str, list[str]], names: tuple[str, ...]) -> dict[str, int]:
    """Non-negative integer parameters (ASCII digits, within int64, as ``nsqd.dat`` keeps them);
    a bad one is a 400 naming it."""
    out = {}
    for name in names:
        value = _first(query, name)
        if value is None:
            continue
        if not (value.isascii() and value.isdigit()) or len(value) > 19 or int(value) > _INT64_MAX:
            raise HTTPError(400, f"INVALID_ARG_{name.upper()}")
        out[name] = int(value)
    return out


_INT64_MAX = (1 << 63) - 1


def _bearer(headers: Sequence[tuple[bytes, bytes]]) -> str:
    for name, value in headers:
        if name.lower() == b"authorization" and value[:7].lower() == b"bearer ":
            return value[7:].decode("latin-1").strip()
    return ""


def _content_length(headers: Sequence[tuple[bytes, bytes]]) -> int | None:
    """The body's declared length; None when it has none, or is chunked: Transfer-Encoding frames
    the body then, and its Content-Length means nothing (RFC 9112 6.3; Go drops it too)."""
    length = None
    for name, value in headers:
        if name == b"transfer-encoding":
            return None
        if name == b"content-length" and length is None:
            length = int(value) if value.isdigit() else None
    return length


# ------------------------------------------------------------------ server


async def serve_http(nsqd, address: str, *, https: bool = False,
                     task_status=trio.TASK_STATUS_IGNORED) -> None:
    """Serve the API on ``address`` ("host:port", port 0 for any) until cancelled.

    Reports the (host, port) actually bound through ``task_status`` as soon as
    the socket listens. With ``https`` the daemon's TLS settings are used
    (``--tls-cert``, ``--tls-key``, client certificate policy), as Go nsqd does.
    """
    if https and nsqd.tls_context is None:
        raise OSError("--https-address needs --tls-cert and --tls-key")
    listener = await http_server.open_listener(address)
    server = http_server.HTTPServer(HTTPAPI(nsqd), http_server.DEFAULT_LIMITS,
                                    nsqd.tls_context if https else None)
    task_status.started([listener.socket.getsockname()[:2]])
    await server.serve(listener)
