"""Daemon options: defaults, parsing of values, validation and /config reporting.

Everything here mirrors Go nsqd's options so that command lines, config files
and ``GET /config/:opt`` answers written for nsqd keep working.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
import resource
import socket
import tomllib
import zlib
from dataclasses import dataclass, field, fields
from decimal import Decimal

from .names import is_valid_name

__all__ = [
    "EXPERIMENTS",
    "LOG_FORMATS",
    "LOG_LEVELS",
    "OPTION_SPECS",
    "STRING_PARSERS",
    "TLS_NOT_REQUIRED",
    "TLS_REQUIRED",
    "TLS_REQUIRED_EXCEPT_HTTP",
    "TLS_VERSIONS",
    "Options",
    "OptionsError",
    "Spec",
    "format_duration",
    "load_config",
    "parse_bool",
    "parse_duration",
    "parse_log_level",
    "parse_percentiles",
    "parse_tls_min_version",
    "parse_tls_required",
    "join_host_port",
    "split_host_port",
]


class OptionsError(ValueError):
    """An option value nsqd cannot run with; the message names the flag or key."""


# Go nsqd's numeric log levels, as reported by GET /config/log_level.
LOG_LEVELS = {"debug": 1, "info": 2, "warn": 3, "error": 4, "fatal": 5}

TLS_NOT_REQUIRED = 0
TLS_REQUIRED_EXCEPT_HTTP = 1
TLS_REQUIRED = 2

# Protocol version numbers as Go's crypto/tls (and Python's ssl.TLSVersion) use them.
TLS_VERSIONS = {"tls1.0": 0x0301, "tls1.1": 0x0302, "tls1.2": 0x0303, "tls1.3": 0x0304}

EXPERIMENTS = ("topology-aware-consumption",)

LOG_FORMATS = ("console", "json")
OVERFLOW_POLICIES = ("reject", "drop-oldest")


# --- value parsers -----------------------------------------------------------

_NS_PER_UNIT = {
    "ns": 1,
    "us": 1_000,
    "\u00b5s": 1_000,  # µs, micro sign
    "\u03bcs": 1_000,  # μs, Greek mu
    "ms": 1_000_000,
    "s": 1_000_000_000,
    "m": 60_000_000_000,
    "h": 3_600_000_000_000,
}
_DURATION_TERM = re.compile(r"([0-9]*)(?:\.([0-9]*))?([^0-9.]*)")
_MAX_NS = 2**63 - 1


def _duration_ns(text: str) -> int:
    """Go's time.ParseDuration, exact to the nanosecond."""
    s = text
    negative = s[:1] == "-"
    if s[:1] in ("-", "+"):
        s = s[1:]
    if s == "0":
        return 0
    if not s:
        raise OptionsError(f"invalid duration {text!r}")
    total = 0
    pos = 0
    while pos < len(s):
        term = _DURATION_TERM.match(s, pos)
        whole, frac, unit = term.groups()
        if not whole and not frac:
            raise OptionsError(f"invalid duration {text!r}")
        if not unit:
            raise OptionsError(f"invalid duration {text!r}: missing unit (write e.g. 10s, 100ms, 1h30m)")
        if unit not in _NS_PER_UNIT:
            raise OptionsError(f"invalid duration {text!r}: unknown unit {unit!r} (use ns, us, ms, s, m, h)")
        scale = _NS_PER_UNIT[unit]
        total += int(whole or 0) * scale
        if frac:
            total += int(frac) * scale // 10 ** len(frac)
        pos = term.end()
    if total > _MAX_NS + negative:
        raise OptionsError(f"invalid duration {text!r}: out of range")
    return -total if negative else total


def parse_duration(text: str) -> float:
    """Parse Go duration syntax ("100ms", "1h30m", "1.5s") into seconds.

    A bare number is refused, except "0" which Go also accepts.
    """
    return _duration_ns(text) / 1e9


def _to_ns(seconds: float) -> int:
    return round(seconds * 1e9)


def _decimal(value: int, digits: int) -> str:
    """``value / 10**digits`` printed without trailing zeros, as Go does."""
    whole, frac = divmod(value, 10**digits)
    frac_text = str(frac).rjust(digits, "0").rstrip("0")
    return f"{whole}.{frac_text}" if frac_text else str(whole)


def format_duration(seconds: float) -> str:
    """Print seconds the way Go's time.Duration.String() does ("1m0s", "250ms")."""
    ns = _to_ns(seconds)
    sign = "-" if ns < 0 else ""
    u = abs(ns)
    if u == 0:
        return "0s"
    if u < 1_000:
        return f"{sign}{u}ns"
    if u < 1_000_000:
        return f"{sign}{_decimal(u, 3)}\u00b5s"
    if u < 1_000_000_000:
        return f"{sign}{_decimal(u, 6)}ms"
    whole_seconds, sub_ns = divmod(u, 1_000_000_000)
    hours, rest = divmod(whole_seconds, 3600)
    minutes, secs = divmod(rest, 60)
    text = _decimal(secs * 1_000_000_000 + sub_ns, 9) + "s"
    if hours:
        text = f"{hours}h{minutes}m{text}"
    elif minutes:
        text = f"{minutes}m{text}"
    return sign + text


_TRUE = ("1", "t", "T", "TRUE", "true", "True")
_FALSE = ("0", "f", "F", "FALSE", "false", "False")


def parse_bool(text: str) -> bool:
    """Go's strconv.ParseBool, which nsqd's boolean flags use."""
    if text in _TRUE:
        return True
    if text in _FALSE:
        return False
    raise OptionsError(f"invalid boolean {text!r} (use true or false)")


def parse_log_level(text: str) -> str:
    level = text.lower()
    if level not in LOG_LEVELS:
        raise OptionsError(f"invalid log level {text!r} (use {', '.join(LOG_LEVELS)})")
    return level


def parse_tls_required(text: str) -> int:
    """ "tcp-https" requires TLS on TCP only; otherwise a Go boolean."""
    if text.lower() == "tcp-https":
        return TLS_REQUIRED_EXCEPT_HTTP
    try:
        return TLS_REQUIRED if parse_bool(text) else TLS_NOT_REQUIRED
    except OptionsError:
        raise OptionsError(f"invalid tls-required {text!r} (use true, false or tcp-https)") from None


def parse_tls_min_version(text: str) -> int:
    """An empty value keeps Go nsqd's default, TLS 1.0."""
    name = text.lower() or "tls1.0"
    if name not in TLS_VERSIONS:
        raise OptionsError(f"invalid TLS version {text!r} (use {', '.join(TLS_VERSIONS)})")
    return TLS_VERSIONS[name]


def parse_percentiles(text: str) -> list[float]:
    """One or more comma separated floats, as --e2e-processing-latency-percentile takes."""
    try:
        return [float(part) for part in text.split(",")]
    except ValueError:
        raise OptionsError(f"invalid percentile list {text!r} (use e.g. 1.0,0.99,0.95)") from None


def split_host_port(address: str) -> tuple[str, int]:
    """Split "host:port" or "[v6]:port"; an empty host means every interface."""
    host, sep, port = address.rpartition(":")
    bracketed = host.startswith("[") and host.endswith("]")
    if bracketed:
        host = host[1:-1]
    if (
        not sep
        or "[" in host
        or "]" in host
        or (":" in host and not bracketed)  # a bare IPv6 address needs brackets
        or not (port.isascii() and port.isdigit())
        or int(port) > 65535
    ):
        raise OptionsError(f"invalid address {address!r} (want host:port)")
    return host, int(port)


def join_host_port(host: str, port: int) -> str:
    """The inverse of split_host_port, as Go's net.JoinHostPort ("[::1]:4150")."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def host_of(address: str) -> str:
    """The host of a peer's "host:port" without brackets, as Go's net.SplitHostPort
    gives it ("::1" for "[::1]:5000"): the client_id, hostname and auth remote_ip nsqd uses."""
    host = address.rpartition(":")[0]
    return host[1:-1] if host.startswith("[") and host.endswith("]") else host


# Parsers for option values given as text, by Spec.kind; for list kinds they
# parse one occurrence of the repeatable flag.
STRING_PARSERS = {
    "str": str,
    "int": int,
    "float": float,
    "bool": parse_bool,
    "duration": parse_duration,
    "log_level": parse_log_level,
    "tls_required": parse_tls_required,
    "tls_min_version": parse_tls_min_version,
    "strs": str,
    "floats": parse_percentiles,
}


# --- the options -------------------------------------------------------------


@dataclass(frozen=True)
class Spec:
    """How one option is spelled and typed outside Python.

    ``kind`` selects the parser: str, int, float, bool, duration, strs, floats,
    log_level, tls_required or tls_min_version.
    """

    kind: str
    help: str
    flag: str = ""  # command-line name; the field name in kebab case if empty
    cfg: str = ""  # Go nsqd's config-file and /config name; the field name if empty
    exposed: bool = True  # reported by GET /config/:opt (Go exposes its flag-tagged fields)


def _opt(kind, default, help, **spec):
    """A field with its Spec; a callable default is called for each instance."""
    meta = {"spec": Spec(kind, help, **spec)}
    if callable(default):
        return field(default_factory=default, metadata=meta)
    return field(default=default, metadata=meta)


def _hostname() -> str:
    return socket.gethostname()


def _default_node_id() -> int:
    """nsqd's default: crc32 of the md5 of the hostname, modulo 1024."""
    return zlib.crc32(hashlib.md5(_hostname().encode()).digest()) % 1024


_MIB = 1024 * 1024
#: most nsqlookupd addresses: each has a task that dials, identifies and registers; 15,000 of them
#: (one PUT /config, open to anyone as in Go) kept the event loop busy for seconds at a time
MAX_LOOKUPD_ADDRESSES = 64


def _default_max_connections() -> int:
    """The open-file limit (RLIMIT_NOFILE) less a reserve for HTTP, listeners and disk queue files:
    a quarter of the limit, at least 256 descriptors, at most half ("unlimited" counts as 2**20)."""
    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    if soft == resource.RLIM_INFINITY:
        soft = 1 << 20
    return soft - min(soft // 2, max(256, soft // 4))


@dataclass(slots=True)
class Options:
    """Every nsqd option; durations are float seconds, sizes are int bytes."""

    # basic
    node_id: int = _opt(
        "int",
        _default_node_id,
        "unique part for message IDs, in [0,1024); defaults to a hash of the hostname",
        cfg="id",
    )
    tcp_address: str = _opt("str", "127.0.0.1:4150", "<addr>:<port> to listen on for TCP clients")
    http_address: str = _opt(
        "str", "127.0.0.1:4151", "<addr>:<port> to listen on for HTTP clients (empty disables)"
    )
    https_address: str = _opt(
        "str", "0.0.0.0:4152", "<addr>:<port> to listen on for HTTPS clients, served with --tls-cert and --tls-key "
        "(empty disables)"
    )
    broadcast_address: str = _opt(
        "str",
        _hostname,
        "address registered with lookupd; defaults to the OS hostname",
    )
    broadcast_tcp_port: int = _opt("int", 0, "TCP port registered with lookupd (0 = the listening TCP port)")
    broadcast_http_port: int = _opt(
        "int", 0, "HTTP port registered with lookupd (0 = the listening HTTP port)"
    )
    http_client_connect_timeout: float = _opt("duration", 2.0, "timeout for outgoing HTTP connects")
    http_client_request_timeout: float = _opt("duration", 5.0, "timeout for outgoing HTTP requests")
    # newer nsqd's flags: GET /config answers INVALID_OPTION for them, as v1.3.0 does
    topology_region: str = _opt("str", "", "region of this node, for preferring closer consumers", exposed=False)
    topology_zone: str = _opt("str", "", "zone of this node, for preferring closer consumers", exposed=False)
    enable_experiments: list[str] = _opt(
        "strs",
        list,
        f"enable an experimental feature (repeatable; valid: {', '.join(EXPERIMENTS)})",
        flag="enable-experiment",
        cfg="enable_experiment",
        exposed=False,
    )
    config: str = _opt("str", "", "path to a TOML config file", exposed=False)

    # auth
    auth_http_addresses: list[str] = _opt(
        "strs",
        list,
        "<addr>:<port> or full URL of an auth server (repeatable)",
        flag="auth-http-address",
    )
    auth_http_request_method: str = _opt("str", "get", "HTTP method for auth server requests (get or post)",
                                         exposed=False)

    # lookupd
    lookupd_tcp_addresses: list[str] = _opt(
        "strs",
        list,
        "nsqlookupd TCP <addr>:<port> (repeatable)",
        flag="lookupd-tcp-address",
        cfg="nsqlookupd_tcp_addresses",
    )

    # diskqueue
    data_path: str = _opt("str", "./data", "directory for disk-backed messages")
    mem_queue_size: int = _opt("int", 10000, "number of messages kept in memory per topic/channel")
    max_bytes_per_file: int = _opt("int", 100 * _MIB, "bytes per diskqueue file before rolling")
    sync_every: int = _opt("int", 2500, "messages per diskqueue fsync")
    sync_timeout: float = _opt("duration", 2.0, "longest time between diskqueue fsyncs")
    durable: bool = _opt(
        "bool", False, "confirm a publish only once it is fsynced (write-through; a topic can also be made "
        "durable over HTTP)", exposed=False,
    )

    # queue scan
    queue_scan_interval: float = _opt(
        "duration", 0.1, "time between scans for timed-out and deferred messages", exposed=False
    )
    queue_scan_refresh_interval: float = _opt(
        "duration", 5.0, "time between refreshes of the channel set scanned", exposed=False
    )
    queue_scan_selection_count: int = _opt(
        "int", 20, "channels checked per scan for timed-out and deferred messages"
    )
    queue_scan_worker_pool_max: int = _opt("int", 4, "most concurrent queue scan workers")
    queue_scan_dirty_percent: float = _opt(
        "float",
        0.25,
        "fraction of dirty channels, in (0,1], that triggers an immediate rescan",
        exposed=False,
    )

    # msg and command
    msg_timeout: float = _opt("duration", 60.0, "default time before an in-flight message is requeued")
    max_msg_timeout: float = _opt("duration", 900.0, "largest message timeout a client may ask for")
    max_msg_size: int = _opt("int", _MIB, "largest single message in bytes")
    max_body_size: int = _opt("int", 5 * _MIB, "largest command body in bytes")
    max_body_memory: int = _opt(
        "int", 256 * _MIB, "most bytes of big bodies (TCP over 256 KiB, HTTP /mpub over 1 MiB) received at once "
        "over all connections, AMQP multi-frame deliveries included; a body that would pass it waits up to 5 s "
        "for room, then is refused (try again), an AMQP delivery at once (0: no limit)", exposed=False)
    max_req_timeout: float = _opt("duration", 3600.0, "largest requeue delay")
    client_timeout: float = _opt(
        "duration", 60.0, "time without a heartbeat response before a client is dropped", exposed=False
    )

    # client overridable
    max_heartbeat_interval: float = _opt("duration", 60.0, "largest heartbeat interval a client may ask for")
    max_rdy_count: int = _opt("int", 2500, "largest RDY count for a client")
    max_output_buffer_size: int = _opt(
        "int", 64 * 1024, "largest output buffer in bytes a client may ask for"
    )
    max_output_buffer_timeout: float = _opt(
        "duration", 30.0, "longest output flush interval a client may ask for"
    )
    min_output_buffer_timeout: float = _opt(
        "duration", 0.025, "shortest output flush interval a client may ask for"
    )
    output_buffer_timeout: float = _opt("duration", 0.25, "default time between output flushes to a client")
    max_channel_consumers: int = _opt("int", 0, "most consumers per channel (0 = unlimited)")

    # connections (not in Go nsqd)
    max_connections: int = _opt(
        "int", _default_max_connections, "most client connections, NSQ TCP and AMQP together, before new ones are "
        "refused (0 = no limit); defaults to the open-file limit less max(256, a quarter of it)", exposed=False,
    )

    # statsd
    statsd_address: str = _opt("str", "", "UDP <addr>:<port> of a statsd daemon (empty disables)")
    statsd_prefix: str = _opt("str", "nsq.%s", "prefix for statsd keys (%s becomes the host)")
    statsd_interval: float = _opt("duration", 60.0, "time between pushes to statsd")
    statsd_mem_stats: bool = _opt("bool", True, "send memory and GC stats to statsd")
    statsd_udp_packet_size: int = _opt("int", 508, "size in bytes of statsd UDP packets")
    statsd_exclude_ephemeral: bool = _opt("bool", False, "leave ephemeral topics and channels out of statsd")

    # e2e latency
    e2e_processing_latency_window_time: float = _opt(
        "duration", 600.0, "window over which end-to-end latency quantiles are computed"
    )
    e2e_processing_latency_percentiles: list[float] = _opt(
        "floats",
        list,
        "end-to-end latency percentile in (0,1] to track (repeatable or comma separated)",
        flag="e2e-processing-latency-percentile",
    )

    # TLS
    tls_cert: str = _opt("str", "", "path to the certificate file")
    tls_key: str = _opt("str", "", "path to the key file")
    tls_client_auth_policy: str = _opt(
        "str", "", "client certificate policy: require or require-verify (implies --tls-required)"
    )
    tls_root_ca_file: str = _opt("str", "", "path to the certificate authority file")
    tls_required: int = _opt(
        "tls_required", TLS_NOT_REQUIRED, "require TLS from clients: true, false or tcp-https"
    )
    tls_min_version: int = _opt(
        "tls_min_version", TLS_VERSIONS["tls1.0"], f"lowest TLS version accepted: {', '.join(TLS_VERSIONS)}"
    )

    # compression
    deflate: bool = _opt("bool", True, "let clients negotiate deflate compression")
    max_deflate_level: int = _opt("int", 6, "highest deflate level a client may ask for, in [1,9]")
    snappy: bool = _opt("bool", True, "let clients negotiate snappy compression")

    # logging
    log_level: str = _opt("log_level", "info", f"log verbosity: {', '.join(LOG_LEVELS)}")
    log_prefix: str = _opt("str", "[nsqd] ", "prefix of console log lines")
    log_format: str = _opt("str", "console", f"log output format: {' or '.join(LOG_FORMATS)}", exposed=False)

    # bounded queues (not in Go nsqd; 0 = unbounded, as nsqd)
    topic_max_messages: int = _opt(
        "int", 0, "most messages a topic may hold before publishes are refused (0 = no limit)", exposed=False
    )
    channel_max_messages: int = _opt(
        "int", 0, "most messages a channel may hold before publishes to its topic are refused (0 = no limit)",
        exposed=False,
    )

    channel_max_bytes: int = _opt(
        "int", 0, "most bytes a channel may hold (memory and disk) before publishes to its topic are refused "
        "(0 = no limit)", exposed=False,
    )
    max_disk_bytes: int = _opt(
        "int", 0, "disk budget for every queued message together; past it publishes are refused (0 = no limit)",
        exposed=False,
    )
    overflow_policy: str = _opt(
        "str", "reject", "what a full topic or channel does: reject (refuse publishes) or drop-oldest", exposed=False
    )
    max_attempts: int = _opt(
        "int", 0, "deliveries a message gets before it goes to the dead-letter topic (0 = no limit)", exposed=False
    )
    dead_letter_suffix: str = _opt(
        "str", ".dead", "a channel's dead letters go to the topic named <topic><suffix>", exposed=False
    )
    message_ttl: float = _opt(
        "duration", 0.0, "messages older than this are dropped instead of delivered (0 = no limit)", exposed=False
    )

    declare: list[str] = _opt(
        "strs", list, "topic or topic:channel to create at start, so nothing published before the "
        "first consumer is lost (repeatable)", exposed=False,
    )

    # shutdown (not in Go nsqd)
    shutdown_grace: float = _opt(
        "duration", 5.0, "on SIGTERM/SIGINT, how long consumers get to finish in-flight messages", exposed=False
    )

    # AMQP gateway (not in Go nsqd)
    amqp_address: str = _opt(
        "str", "", "<addr>:<port> for the AMQP gateway, e.g. 127.0.0.1:5672 (empty: off, as Go nsqd opens no such "
        "port)", exposed=False
    )
    amqps_address: str = _opt(
        "str", "", "<addr>:<port> for the AMQP gateway over TLS (amqps), e.g. 127.0.0.1:5671; needs --tls-cert and "
        "--tls-key (empty: off)", exposed=False
    )

    def __post_init__(self) -> None:
        # nsqd: asking for client certificates implies requiring TLS.
        if self.tls_client_auth_policy and self.tls_required == TLS_NOT_REQUIRED:
            self.tls_required = TLS_REQUIRED

    def validate(self) -> None:
        """Raise OptionsError for the first value nsqd could not start with."""
        _need(0 <= self.node_id < 1024, "--node-id must be [0,1024)")
        _address("--tcp-address", self.tcp_address)
        for flag, value in (
            ("--http-address", self.http_address),
            ("--https-address", self.https_address),
            ("--statsd-address", self.statsd_address),
            ("--amqp-address", self.amqp_address),
            ("--amqps-address", self.amqps_address),
        ):
            if value:
                _address(flag, value)
        _need(not self.amqps_address or bool(self.tls_cert and self.tls_key),
              "--amqps-address needs --tls-cert and --tls-key")
        for value in self.lookupd_tcp_addresses:
            _address("--lookupd-tcp-address", value)
        _need(len(set(self.lookupd_tcp_addresses)) <= MAX_LOOKUPD_ADDRESSES,
              f"--lookupd-tcp-address may be given at most {MAX_LOOKUPD_ADDRESSES} times")
        _need(bool(self.broadcast_address), "--broadcast-address must not be empty")
        for flag, port in (
            ("--broadcast-tcp-port", self.broadcast_tcp_port),
            ("--broadcast-http-port", self.broadcast_http_port),
        ):
            _need(0 <= port <= 65535, f"{flag} must be [0,65535]")
        for value in self.enable_experiments:
            _need(
                value in EXPERIMENTS,
                f"--enable-experiment: unknown experiment {value!r} (valid: {', '.join(EXPERIMENTS)})",
            )

        _need(all(self.auth_http_addresses), "--auth-http-address must not be empty")
        _need(
            self.auth_http_request_method in ("get", "post"), "--auth-http-request-method must be post or get"
        )

        _need(self.mem_queue_size >= 0, "--mem-queue-size must be >= 0")
        _need(0 < self.max_bytes_per_file < 1 << 32, "--max-bytes-per-file must be > 0 and < 4GiB")
        _need(self.sync_every > 0, "--sync-every must be > 0")

        _need(self.queue_scan_selection_count >= 1, "--queue-scan-selection-count must be >= 1")
        _need(self.queue_scan_worker_pool_max >= 1, "--queue-scan-worker-pool-max must be >= 1")
        _need(0 < self.queue_scan_dirty_percent <= 1, "--queue-scan-dirty-percent must be in (0,1]")

        for name in (
            "http_client_connect_timeout",
            "http_client_request_timeout",
            "sync_timeout",
            "queue_scan_interval",
            "queue_scan_refresh_interval",
            "msg_timeout",
            "client_timeout",
            "max_heartbeat_interval",
            "max_output_buffer_timeout",
            "output_buffer_timeout",
            "statsd_interval",
            "e2e_processing_latency_window_time",
        ):
            _need(getattr(self, name) > 0, f"{_flag(name)} must be > 0")
        _need(self.max_msg_timeout >= self.msg_timeout, "--max-msg-timeout must be >= --msg-timeout")
        _need(self.max_req_timeout >= 0, "--max-req-timeout must be >= 0")
        _need(self.min_output_buffer_timeout >= 0, "--min-output-buffer-timeout must be >= 0")
        _need(
            self.max_output_buffer_timeout >= self.min_output_buffer_timeout,
            "--max-output-buffer-timeout must be >= --min-output-buffer-timeout",
        )

        for name in (
            "max_msg_size",
            "max_body_size",
            "max_rdy_count",
            "max_output_buffer_size",
            "statsd_udp_packet_size",
        ):
            _need(getattr(self, name) > 0, f"{_flag(name)} must be > 0")
        _need(self.max_channel_consumers >= 0, "--max-channel-consumers must be >= 0")
        _need(self.max_connections >= 0, "--max-connections must be >= 0")
        _need(self.max_body_memory >= 0, "--max-body-memory must be >= 0")
        _need(self.shutdown_grace >= 0, "--shutdown-grace must be >= 0")
        _need(self.overflow_policy in OVERFLOW_POLICIES,
              f"--overflow-policy must be one of {', '.join(OVERFLOW_POLICIES)}")
        _need(self.max_attempts >= 0, "--max-attempts must be >= 0")
        for value in self.declare:
            topic, _, channel = value.partition(":")
            _need(is_valid_name(topic) and (not channel or is_valid_name(channel)),
                  f"--declare: {value!r} is not topic or topic:channel with valid names")
        _need(self.message_ttl >= 0, "--message-ttl must be >= 0")
        _need(bool(self.dead_letter_suffix) and all(ch.isalnum() or ch in "._-" for ch in self.dead_letter_suffix),
              "--dead-letter-suffix must be non-empty and use only [.a-zA-Z0-9_-]")
        _need(self.topic_max_messages >= 0, "--topic-max-messages must be >= 0")
        _need(self.channel_max_messages >= 0, "--channel-max-messages must be >= 0")
        _need(self.channel_max_bytes >= 0, "--channel-max-bytes must be >= 0")
        _need(self.max_disk_bytes >= 0, "--max-disk-bytes must be >= 0")

        for value in self.e2e_processing_latency_percentiles:
            _need(0 < value <= 1, f"--e2e-processing-latency-percentile must be in (0,1], got {value}")

        _need(
            self.tls_required in (TLS_NOT_REQUIRED, TLS_REQUIRED_EXCEPT_HTTP, TLS_REQUIRED),
            "--tls-required must be true, false or tcp-https",
        )
        _need(
            self.tls_min_version in TLS_VERSIONS.values(),
            f"--tls-min-version must be one of {', '.join(TLS_VERSIONS)}",
        )
        _need(
            self.tls_client_auth_policy in ("", "require", "require-verify"),
            "--tls-client-auth-policy must be require or require-verify",
        )
        _need(bool(self.tls_cert) == bool(self.tls_key), "--tls-cert and --tls-key must be given together")
        _need(
            self.tls_required == TLS_NOT_REQUIRED or bool(self.tls_cert),
            "--tls-required (or --tls-client-auth-policy) needs --tls-cert and --tls-key",
        )

        _need(1 <= self.max_deflate_level <= 9, "--max-deflate-level must be [1,9]")
        _need(self.log_level in LOG_LEVELS, f"--log-level must be one of {', '.join(LOG_LEVELS)}")
        _need(self.log_format in LOG_FORMATS, f"--log-format must be {' or '.join(LOG_FORMATS)}")

    def config_value(self, name: str) -> object:
        """The value GET /config/<name> reports, as Go nsqd encodes it.

        Durations are integer nanoseconds and the log level is Go's number.
        Raises KeyError for names Go nsqd answers with INVALID_OPTION.
        """
        field_name = _CONFIG_ENDPOINT_NAMES[name]
        value = getattr(self, field_name)
        kind = OPTION_SPECS[field_name].kind
        if kind == "duration":
            return _to_ns(value)
        if kind == "log_level":
            return LOG_LEVELS[value]
        if isinstance(value, list):
            return list(value)
        return value

    def config_json(self, name: str) -> bytes | None:
        """The GET /config/<name> response body, or None for an unknown option.

        nsqd writes string values raw and everything else as JSON.
        """
        try:
            value = self.config_value(name)
        except KeyError:
            return None
        if isinstance(value, str):
            return value.encode()
        return _go_json(value).encode()


def _need(ok: bool, message: str) -> None:
    if not ok:
        raise OptionsError(message)


def _flag(name: str) -> str:
    return "--" + OPTION_SPECS[name].flag


def _address(flag: str, value: str) -> None:
    try:
        split_host_port(value)
    except OptionsError as exc:
        raise OptionsError(f"{flag}: {exc}") from None


def _resolve_specs() -> dict[str, Spec]:
    specs = {}
    for f in fields(Options):
        spec = f.metadata["spec"]
        specs[f.name] = Spec(
            spec.kind,
            spec.help,
            flag=spec.flag or f.name.replace("_", "-"),
            cfg=spec.cfg or f.name,
            exposed=spec.exposed,
        )
    return specs


OPTION_SPECS: dict[str, Spec] = _resolve_specs()
"""Field name -> spelling and type, with ``flag`` and ``cfg`` filled in."""

_CONFIG_ENDPOINT_NAMES = {spec.cfg: name for name, spec in OPTION_SPECS.items() if spec.exposed}

# Config files may use Go nsqd's key (e.g. "id") or the field name ("node_id").
_CONFIG_KEYS = {
    key: name for name, spec in OPTION_SPECS.items() if name != "config" for key in (spec.cfg, name)
}


# --- Go-compatible JSON ------------------------------------------------------


def _go_float(value: float) -> str:
    """Go's encoding/json float form: 1 not 1.0, exponents only outside [1e-6, 1e21)."""
    if not math.isfinite(value):
        raise ValueError(f"unsupported value: {value}")
    magnitude = abs(value)
    if magnitude != 0 and (magnitude < 1e-6 or magnitude >= 1e21):
        mantissa, exponent = repr(value).split("e")
        return f"{mantissa}e{exponent[0]}{exponent[1:].lstrip('0')}"
    text = format(Decimal(repr(value)), "f")
    return text.rstrip("0").rstrip(".") if "." in text else text


# Go's encoder escapes these even though JSON does not require it.
_GO_STRING_ESCAPES = str.maketrans(
    {"<": "\\u003c", ">": "\\u003e", "&": "\\u0026", "\u2028": "\\u2028", "\u2029": "\\u2029"}
)


def _go_json(value: object) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        return _go_float(value)
    if isinstance(value, str):
        return json.dumps(value, ensure_ascii=False).translate(_GO_STRING_ESCAPES)
    if isinstance(value, list):
        return "[" + ",".join(_go_json(item) for item in value) + "]"
    raise TypeError(f"cannot encode {type(value).__name__}")


# --- config file -------------------------------------------------------------


_KIND_NAMES = {
    "str": "a string",
    "int": "an integer",
    "float": "a number",
    "bool": "a boolean",
    "duration": 'a duration string such as "2s" (or integer milliseconds)',
    "strs": "a list of strings",
    "floats": "a list of numbers",
    "log_level": "a log level string",
    "tls_required": 'true, false or "tcp-https"',
    "tls_min_version": 'a TLS version string such as "tls1.2"',
}


def _from_toml(kind: str, value: object) -> object:
    """Convert one TOML value with go-options' coercions, minus the surprising ones.

    Strings parse as on the command line, integers for durations are
    milliseconds (as Go nsqd reads them), and lists convert item by item.
    """
    if isinstance(value, bool):
        if kind == "bool":
            return value
        if kind == "tls_required":
            return TLS_REQUIRED if value else TLS_NOT_REQUIRED
    elif isinstance(value, str):
        if kind == "strs":
            return value.split(",")
        if kind not in ("int", "float", "bool"):
            return STRING_PARSERS[kind](value)
    elif isinstance(value, list):
        if kind in ("strs", "floats"):
            return [_from_toml(kind[:-1], item) for item in value]
    elif isinstance(value, int):
        if kind == "int":
            return value
        if kind == "float":
            return float(value)
        if kind == "duration":
            return value / 1000
    elif isinstance(value, float) and kind == "float":
        return value
    raise OptionsError(f"wrong type {type(value).__name__}, expected {_KIND_NAMES[kind]}")


def load_config(path: str) -> dict[str, object]:
    """Read a TOML config file into field name -> value."""
    try:
        with open(path, "rb") as file:
            document = tomllib.load(file)
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise OptionsError(f"failed to load config file {path} - {exc}") from None
    values: dict[str, object] = {}
    for key, raw in document.items():
        name = _CONFIG_KEYS.get(key)
        if name is None:
            raise OptionsError(f"config file {path}: unknown option {key!r}")
        if name in values:
            raise OptionsError(f"config file {path}: {key!r} repeats another key for the same option")
        try:
            values[name] = _from_toml(OPTION_SPECS[name].kind, raw)
        except OptionsError as exc:
            raise OptionsError(f"config file {path}: {key!r}: {exc}") from None
    return values
