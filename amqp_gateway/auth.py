"""Where the daemon's authentication plugs into the gateway's SASL PLAIN.

:func:`authenticate` is the hook: ``serve_amqp`` hands it to every
connection's SASL server, which calls it with the PLAIN username and
password. The gateway does not consult the daemon's auth servers
(``--auth-http-address``) yet, so:

- without auth servers every login is accepted, PLAIN or ANONYMOUS;
- with auth servers configured the gateway must not be an open back door:
  ANONYMOUS and connections without SASL are refused, and PLAIN is checked
  with :func:`refuse` unless a real check is plugged in.
"""

from __future__ import annotations


def authenticate(username: str, password: str) -> bool:
    return True


def refuse(username: str, password: str) -> bool:
    return False
