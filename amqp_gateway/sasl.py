"""SASL (spec 5.3): the server offers PLAIN and (unless told not to) ANONYMOUS.

The server checks PLAIN credentials with the ``authenticate(username,
password) -> bool`` callable it is given, or, without one, leaves them in
:attr:`SaslServer.pending` for the application, whose check may need I/O
(the connection engine reports a ``SaslLogin`` event and waits for the
verdict). ANONYMOUS, when offered, always succeeds. Both sides are plain
objects that map one SASL frame to the answer; the connection engine moves
them on the wire.
"""

from __future__ import annotations

from typing import Callable

from .performatives import SASL_AUTH, SASL_OK, SaslInit, SaslMechanisms, SaslOutcome

ANONYMOUS = "ANONYMOUS"
PLAIN = "PLAIN"

Authenticate = Callable[[str, str], bool]


class SaslServer:
    def __init__(self, authenticate: Authenticate | None = None, anonymous: bool = True) -> None:
        self.authenticate = authenticate
        self.mechanisms = (PLAIN, ANONYMOUS) if anonymous else (PLAIN,)
        #: who the peer authenticated as ("" for ANONYMOUS), once it succeeded
        self.identity: str | None = None
        #: PLAIN (username, password) waiting for :meth:`verdict`
        self.pending: tuple[str, str] | None = None

    def offer(self) -> SaslMechanisms:
        return SaslMechanisms(self.mechanisms)

    def init(self, frame: SaslInit) -> SaslOutcome | None:
        """Our outcome, or None when the credentials in :attr:`pending` await the application."""
        if frame.mechanism == ANONYMOUS and ANONYMOUS in self.mechanisms:
            self.identity = ""
            return SaslOutcome(SASL_OK)
        if frame.mechanism == PLAIN:
            credentials = _parse_plain(frame.initial_response or b"")
            if credentials is not None:
                self.pending = credentials
                if self.authenticate is None:
                    return None
                return self.verdict(self.authenticate(*credentials))
        return SaslOutcome(SASL_AUTH)

    def verdict(self, ok: bool) -> SaslOutcome:
        """The outcome for the :attr:`pending` credentials."""
        username, _ = self.pending
        self.pending = None
        if not ok:
            return SaslOutcome(SASL_AUTH)
        self.identity = username
        return SaslOutcome(SASL_OK)


def _parse_plain(response: bytes) -> tuple[str, str] | None:
    """RFC 4616: ``authzid NUL authcid NUL passwd``, UTF-8."""
    parts = response.split(b"\x00")
    if len(parts) != 3:
        return None
    try:
        return parts[1].decode(), parts[2].decode()
    except UnicodeDecodeError:
        return None


class SaslClient:
    def __init__(self, mechanism: str = ANONYMOUS, username: str = "", password: str = "") -> None:
        self.mechanism = mechanism
        self.username = username
        self.password = password

    def init(self, offer: SaslMechanisms, hostname: str | None = None) -> SaslInit | None:
        """Our sasl-init, or None when the server does not offer our mechanism."""
        if self.mechanism not in offer.sasl_server_mechanisms:
            return None
        response = None
        if self.mechanism == PLAIN:
            response = b"\x00" + self.username.encode() + b"\x00" + self.password.encode()
        return SaslInit(self.mechanism, response, hostname)
