"""TLS settings for the TCP protocol's ``tls_v1`` upgrade and the HTTPS listener.

Client certificate policies follow nsqd: none by default, ``require`` and
``require-verify``. Python's ssl module cannot demand a certificate without
verifying it, so ``require`` also verifies, against ``--tls-root-ca-file``
when given, else the system store (documented in docs/configuration.md).
"""

from __future__ import annotations

import ssl

from .options import Options

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


def describe(stream) -> dict:
    """The negotiated TLS parameters of an ``trio.SSLStream`` for /stats."""
    cipher = stream.cipher() or ("", "", 0)
    return {
        "tls_version": stream.version() or "",
        "tls_cipher_suite": cipher[0],
        "tls_negotiated_protocol": stream.selected_alpn_protocol() or "",
        "tls_negotiated_protocol_is_mutual": bool(stream.selected_alpn_protocol()),
    }
