"""TLS settings for the TCP protocol's ``tls_v1`` upgrade and the HTTPS listener.

Client certificate policies follow nsqd: none by default, ``require`` and
``require-verify``. Python's ssl module cannot demand a certificate without
verifying it, so ``require`` also verifies, against ``--tls-root-ca-file``
when given, else the system store (documented in docs/configuration.md).
"""

from __future__ import annotations

import ssl

import trio

from .options import Options

#: bytes read from the socket per receive (every complete record in them is decrypted)
_RECEIVE_SIZE = 256 * 1024

_VERSIONS = {
    0x0301: ssl.TLSVersion.TLSv1,
    0x0302: ssl.TLSVersion.TLSv1_1,
    0x0303: ssl.TLSVersion.TLSv1_2,
    0x0304: ssl.TLSVersion.TLSv1_3,
}


def server_context(options: Options) -> ssl.SSLContext | None:
    """The server context, or None when no certificate is configured."""
    if not options.tls_cert and not options.tls_key:
        return None
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.options |= ssl.OP_NO_RENEGOTIATION  # a client could make us redo handshakes at will
    context.load_cert_chain(options.tls_cert, options.tls_key)
    context.minimum_version = _VERSIONS.get(options.tls_min_version, ssl.TLSVersion.TLSv1_2)
    if options.tls_client_auth_policy:
        context.verify_mode = ssl.CERT_REQUIRED
        if options.tls_root_ca_file:
            context.load_verify_locations(options.tls_root_ca_file)
        else:
            context.load_default_certs(ssl.Purpose.CLIENT_AUTH)
    elif options.tls_root_ca_file:
        context.verify_mode = ssl.CERT_OPTIONAL
        context.load_verify_locations(options.tls_root_ca_file)
    return context


#: how Go nsqd v1.3.0's /stats names the TLS versions, and the cipher suites it knows by IANA
#: number (client_v2.go's prettyConnectionState); any other suite is "Unknown <number>"
_GO_VERSION_NAMES = {"TLSv1": "TLS1.0", "TLSv1.1": "TLS1.1", "TLSv1.2": "TLS1.2", "TLSv1.3": "TLS1.3"}
_GO_SUITE_NAMES = {
    0x0005: "TLS_RSA_WITH_RC4_128_SHA",
    0x000A: "TLS_RSA_WITH_3DES_EDE_CBC_SHA",
    0x002F: "TLS_RSA_WITH_AES_128_CBC_SHA",
    0x0035: "TLS_RSA_WITH_AES_256_CBC_SHA",
    0xC007: "TLS_ECDHE_ECDSA_WITH_RC4_128_SHA",
    0xC009: "TLS_ECDHE_ECDSA_WITH_AES_128_CBC_SHA",
    0xC00A: "TLS_ECDHE_ECDSA_WITH_AES_256_CBC_SHA",
    0xC011: "TLS_ECDHE_RSA_WITH_RC4_128_SHA",
    0xC012: "TLS_ECDHE_RSA_WITH_3DES_EDE_CBC_SHA",
    0xC013: "TLS_ECDHE_RSA_WITH_AES_128_CBC_SHA",
    0xC014: "TLS_ECDHE_RSA_WITH_AES_256_CBC_SHA",
    0xC02F: "TLS_ECDHE_RSA_WITH_AES_128_GCM_SHA256",
    0xC02B: "TLS_ECDHE_ECDSA_WITH_AES_128_GCM_SHA256",
}
#: OpenSSL's cipher names -> IANA numbers, filled from the contexts in use
_SUITE_NUMBERS: dict[str, int] = {}


def describe(stream) -> dict:
    """The negotiated TLS parameters of a :class:`TLSStream`, for /stats, named as Go nsqd names them.

    Go's ``NegotiatedProtocolIsMutual`` is always true.
    """
    name = (stream.cipher() or ("", "", 0))[0]
    version = stream.version() or ""
    return {
        "tls_version": _GO_VERSION_NAMES.get(version, version),
        "tls_cipher_suite": _go_suite_name(name, stream.context),
        "tls_negotiated_protocol": stream.selected_alpn_protocol() or "",
        "tls_negotiated_protocol_is_mutual": True,
    }


def _go_suite_name(name: str, context: ssl.SSLContext) -> str:
    if name not in _SUITE_NUMBERS:
        _SUITE_NUMBERS.update((c["name"], c["id"] & 0xFFFF) for c in context.get_ciphers())
    number = _SUITE_NUMBERS.get(name)
    if number is None:
        return name
    return _GO_SUITE_NAMES.get(number, f"Unknown {number}")


def handshake_failure(stream: TLSStream, error: BaseException) -> str:
    """Why an upgrade failed, as Go's crypto/tls says it where it can (after ``IDENTIFY failed ``)."""
    head = stream.head
    if len(head) == 5 and (head[0] not in (0x15, 0x16) or (head[1] << 8 | head[2]) >= 0x1000):
        return "tls: first record does not look like a TLS handshake"
    if isinstance(error, trio.TooSlowError):
        return "i/o timeout"
    if isinstance(error, ssl.SSLCertVerificationError):
        if error.verify_code in _UNKNOWN_AUTHORITY:
            return "tls: failed to verify certificate: x509: certificate signed by unknown authority"
        return f"tls: failed to verify certificate: x509: {error.verify_message}"
    if isinstance(error, ssl.SSLError):
        if error.reason == "PEER_DID_NOT_RETURN_A_CERTIFICATE":
            return "tls: client didn't provide a certificate"
        return f"tls: {error.reason or error}".lower().replace("_", " ")
    return "EOF"


#: OpenSSL's verify codes for a chain that does not end at a trusted root (Go: UnknownAuthorityError)
_UNKNOWN_AUTHORITY = {18, 19, 20, 21}


class TLSStream(trio.abc.Stream):
    """Server-side TLS over a Trio stream, through memory BIOs.

    ``trio.SSLStream`` hands back at most one 16 KiB TLS record per receive, so
    a 40 KB MPUB took three trips through the read loop. This stream reads up
    to 256 KiB from the socket and decrypts the complete records in it, at
    most 256 KiB of plaintext per receive (TLS records do not expand: Python
    turns TLS compression off). Receiving never writes: TLS data the peer's messages call for (a
    key update) waits in the outgoing BIO for the next ``send_all``, so the
    connection's single-writer rule holds.
    """

    def __init__(self, transport: trio.abc.Stream, context: ssl.SSLContext) -> None:
        self.transport = transport
        self._incoming = ssl.MemoryBIO()
        self._outgoing = ssl.MemoryBIO()
        self._ssl = context.wrap_bio(self._incoming, self._outgoing, server_side=True)
        #: the first bytes the peer sent (the first record's header tells a TLS client from anything else)
        self.head = b""

    async def do_handshake(self) -> None:
        while True:
            try:
                self._ssl.do_handshake()
            except ssl.SSLWantReadError:
                await self._send_pending()
                if not await self._feed():
                    raise trio.BrokenResourceError("connection closed during the TLS handshake")
                continue
            await self._send_pending()
            return

    async def _send_pending(self) -> None:
        data = self._outgoing.read()
        if data:
            await self.transport.send_all(data)

    async def _feed(self) -> bool:
        data = await self.transport.receive_some(_RECEIVE_SIZE)
        if not data:
            return False
        if len(self.head) < 5:
            self.head = (self.head + data)[:5]
        self._incoming.write(data)
        return True

    async def send_all(self, data) -> None:
        self._ssl.write(data)
        await self._send_pending()

    async def wait_send_all_might_not_block(self) -> None:
        await self.transport.wait_send_all_might_not_block()

    async def receive_some(self, max_bytes=None) -> bytes:
        """Up to 256 KiB of plaintext; a checkpoint even when the records were already read."""
        read = self._ssl.read
        fed = False
        while True:
            chunks = []
            size = 0
            try:
                while size < _RECEIVE_SIZE:
                    chunk = read(_RECEIVE_SIZE)
                    if not chunk:
                        break
                    chunks.append(chunk)
                    size += len(chunk)
            except ssl.SSLWantReadError:
                pass
            except ssl.SSLZeroReturnError:  # the peer's close_notify
                return b"".join(chunks)
            if chunks:
                if not fed:
                    await trio.lowlevel.checkpoint()
                return b"".join(chunks)
            if not await self._feed():
                return b""
            fed = True

    async def aclose(self) -> None:
        await self.transport.aclose()

    @property
    def context(self) -> ssl.SSLContext:
        return self._ssl.context

    def cipher(self):
        return self._ssl.cipher()

    def version(self) -> str | None:
        return self._ssl.version()

    def selected_alpn_protocol(self) -> str | None:
        return self._ssl.selected_alpn_protocol()

    def peer_common_name(self) -> str:
        """The client certificate's subject CN ("" without one), as Go's ``Subject.CommonName`` (the last)."""
        name = ""
        for rdn in (self._ssl.getpeercert() or {}).get("subject", ()):
            for key, value in rdn:
                if key == "commonName":
                    name = value
        return name
