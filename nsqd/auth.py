"""Client authorization through nsqd's auth HTTP protocol.

The daemon asks an auth server ``GET <addr>/auth?common_name=&remote_ip=&secret=&tls=``
(or POSTs the same form) and gets back ``{"ttl": s, "identity": ..., "identity_url":
..., "authorizations": [{"topic": re, "channels": [re...], "permissions":
["subscribe"|"publish"]}]}``. Servers are tried in a random order until one
answers. The decision logic (``AuthState``) is pure; only :func:`query_any`
does I/O, over h11 on Trio with the daemon's connect and request timeouts.

The patterns are RE2's, as Go nsqd's ``regexp``: same syntax, and matching
in time linear in the name. Python's ``re`` backtracks: with the pattern
``^([a-z]+_?)+[.]log$`` one client's PUB to a topic of 28 letters held the
event loop for 8 s, and each letter more doubled it.
"""

from __future__ import annotations

import json
import random
import ssl
import time
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlencode, urlsplit

import re2
import trio

from .http_client import FAILURES, ResponseError, exchange

PERMISSIONS = ("subscribe", "publish")


class AuthError(Exception):
    """No auth server gave a usable answer."""


#: RE2 reports a bad pattern by raising, not also on standard error
_RE2_OPTIONS = re2.Options()
_RE2_OPTIONS.log_errors = False
#: memory one compiled pattern may take (RE2's default is 8 MiB): ``\pL{300}\pN{300}``, 25 bytes
#: of reply, took 0.24 s and up to 10 MB to compile; refused now ("pattern too large")
_RE2_OPTIONS.max_mem = 2 << 20
#: most topic and channel patterns one reply may hold
MAX_PATTERNS = 1024
#: most time one reply's patterns may take to compile, in the event loop (RE2 holds the GIL)
COMPILE_BUDGET = 0.25
_GO_INT = 1 << 63


def _pattern(source: Any) -> Any:
    """A compiled RE2 pattern; raises TypeError or ValueError for anything else."""
    if not isinstance(source, str):
        raise TypeError(f"pattern {source!r} is not a string")
    try:
        return re2.compile(source, _RE2_OPTIONS)
    except re2.error as exc:
        reason = exc.args[0] if exc.args else ""
        reason = reason.decode(errors="replace") if isinstance(reason, bytes) else str(reason)
        raise ValueError(f"pattern {source!r}: {reason}") from None


@dataclass(frozen=True)
class Authorization:
    topic: Any  #: compiled RE2 patterns, searched as Go's MatchString
    channels: tuple[Any, ...]
    permissions: frozenset[str]

    def allows(self, topic: str, channel: str) -> bool:
        """nsqd's rule: subscribe needs a channel match, publish matches channel ``""``."""
        needed = "subscribe" if channel else "publish"
        if needed not in self.permissions or not self.topic.search(topic):
            return False
        return any(c.search(channel) for c in self.channels)


@dataclass(frozen=True)
class AuthState:
    identity: str
    identity_url: str
    expires: float
    authorizations: tuple[Authorization, ...]

    def is_expired(self, now: float) -> bool:
        return now >= self.expires

    def allows(self, topic: str, channel: str = "") -> bool:
        return any(a.allows(topic, channel) for a in self.authorizations)


def parse_reply(body: bytes, now: float) -> AuthState:
    """Validate an auth server's JSON reply as nsqd does.

    ``ttl`` is a JSON integer (Go's int: a string, a fraction or 1e400 is
    refused as Go's decoder refuses it). At most ``MAX_PATTERNS`` patterns,
    each text compiled once: every publish and subscribe is checked against
    them in the event loop, and a 1 MB reply of 250,000 entries had held it
    for seconds.
    """
    try:
        doc = json.loads(body)
        ttl = doc.get("ttl", 0)
        if ttl is None:
            ttl = 0
        if type(ttl) is not int or not -_GO_INT <= ttl < _GO_INT:
            raise ValueError(f"ttl {str(ttl)[:32]} is not an integer")
        compiled: dict[str, Any] = {}
        patterns = 0
        deadline = time.perf_counter() + COMPILE_BUDGET

        def pattern(source: Any) -> Any:
            nonlocal patterns
            patterns += 1
            if patterns > MAX_PATTERNS:
                raise ValueError(f"more than {MAX_PATTERNS} topic and channel patterns")
            if isinstance(source, str) and source in compiled:
                return compiled[source]
            if time.perf_counter() > deadline:
                raise ValueError(f"patterns that take more than {COMPILE_BUDGET} s to compile")
            compiled[source] = found = _pattern(source)
            return found

        auths = []
        for item in _list(doc.get("authorizations"), "authorizations"):
            if not isinstance(item, dict):
                raise TypeError(f"authorization {str(item)[:32]} is not an object")
            perms = frozenset(_strings(item.get("permissions"), "permissions"))
            unknown = perms - set(PERMISSIONS)
            if unknown:
                raise AuthError(f"unknown permission {sorted(unknown)[0]}")
            auths.append(Authorization(
                pattern(_string(item.get("topic"), "topic")),
                tuple(pattern(c) for c in _strings(item.get("channels"), "channels")),
                perms,
            ))
        state = AuthState(_string(doc.get("identity"), "identity"), _string(doc.get("identity_url"), "identity_url"),
                          now + ttl, tuple(auths))
    except (ValueError, TypeError, AttributeError, RecursionError, OverflowError) as exc:
        raise AuthError(f"invalid auth reply: {exc}") from None
    finally:
        re2.purge()  # the module's own cache of 128 compiled patterns: ours live in the states only
    if ttl <= 0:
        raise AuthError(f"invalid TTL {ttl} (must be >0)")
    return state


def _list(value: Any, what: str) -> list:
    """A JSON array, as Go decodes one into a slice: null is empty, anything else is refused."""
    if value is None:
        return []
    if not isinstance(value, list):
        raise TypeError(f"{what} {str(value)[:32]} is not an array")
    return value


def _strings(value: Any, what: str) -> list[str]:
    items = _list(value, what)
    if not all(isinstance(item, str) for item in items):
        raise TypeError(f"{what} {str(value)[:32]} is not an array of strings")
    return items


def _string(value: Any, what: str) -> str:
    if value is None:
        return ""
    if not isinstance(value, str):
        raise TypeError(f"{what} {str(value)[:32]} is not a string")
    return value


async def query_any(addresses: list[str], *, remote_ip: str, tls: bool, secret: str, common_name: str = "",
                    now: float, method: str = "get", connect_timeout: float = 2.0,
                    request_timeout: float = 5.0, ssl_context: ssl.SSLContext | None = None) -> AuthState:
    """Ask the auth servers in turn; ``now`` (daemon clock, seconds) dates the expiry."""
    errors = []
    start = random.randrange(len(addresses))
    for i in range(len(addresses)):
        address = addresses[(start + i) % len(addresses)]
        try:
            body = await _request(address, remote_ip, tls, secret, common_name, method,
                                  connect_timeout, request_timeout, ssl_context)
            return parse_reply(body, now)
        except (AuthError, ResponseError, *FAILURES) as exc:
            errors.append(f"failed to auth against {address} - {str(exc) or type(exc).__name__}")
    raise AuthError("; ".join(errors))


async def _request(address, remote_ip, tls, secret, common_name, method, connect_timeout, request_timeout,
                   ssl_context) -> bytes:
    endpoint = address if "://" in address else f"http://{address}/auth"
    url = urlsplit(endpoint)
    # sorted by key, as Go's url.Values.Encode writes them
    # a secret's bytes go as they came (a str with surrogate escapes for those not UTF-8), as Go's
    form = urlencode({"common_name": common_name, "remote_ip": remote_ip, "secret": secret,
                      "tls": "true" if tls else "false"}, errors="surrogateescape")
    target = url.path or "/"
    if url.query:
        target += "?" + url.query
    body = b""
    headers = [("host", url.netloc), ("accept", "application/vnd.nsq; version=1.0")]
    if method == "post":
        body = form.encode()
        headers += [("content-type", "application/x-www-form-urlencoded"), ("content-length", str(len(body)))]
    else:
        target += ("&" if "?" in target else "?") + form
    port = url.port or (443 if url.scheme == "https" else 80)
    with trio.fail_after(connect_timeout):
        stream = await trio.open_tcp_stream(url.hostname, port)
    try:
        if url.scheme == "https":
            stream = trio.SSLStream(stream, ssl_context or ssl.create_default_context(),
                                    server_hostname=url.hostname)
        with trio.fail_after(request_timeout):
            return await exchange(stream, method.upper(), target, headers, body)
    finally:
        await stream.aclose()
