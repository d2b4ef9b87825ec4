"""How AMQP logins are checked.

Without auth servers, SASL PLAIN logins go through :func:`authenticate`
(``serve_amqp``'s ``authenticate=`` hook), which accepts everything, and
ANONYMOUS is offered too. With ``--auth-http-address`` the PLAIN password is
the secret that nsqd's AUTH command carries: :func:`query` asks the auth
servers as ``nsqd/tcp.py`` does, and the authorizations it returns govern the
connection's links (see :mod:`gateway`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import structlog

from nsqd.auth import AuthError, AuthState, query_any

if TYPE_CHECKING:
    from nsqd.broker import Broker

log = structlog.get_logger("amqp_gateway.auth")


def authenticate(username: str, password: str) -> bool:
    return True


async def query(nsqd: Broker, remote_address: str, secret: str, *, tls: bool = False) -> AuthState | None:
    """The auth servers' answer for ``secret`` (asked with ``tls``, as nsqd asks); None when none approves it."""
    opts = nsqd.options
    try:
        return await query_any(
            opts.auth_http_addresses, remote_ip=remote_address.rsplit(":", 1)[0], tls=tls, secret=secret,
            now=nsqd.now_ns() / 1e9, method=opts.auth_http_request_method,
            connect_timeout=opts.http_client_connect_timeout, request_timeout=opts.http_client_request_timeout)
    except AuthError as exc:
        log.warning("AMQP auth failed", client=remote_address, error=str(exc))
        return None
