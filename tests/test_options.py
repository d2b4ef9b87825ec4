"""Options, flags and config files behave like Go nsqd's."""

import dataclasses
import json
import pathlib
import re
import sys
import types

import pytest
import structlog
from hypothesis import given
from hypothesis import strategies as st

from nsqd import cli
from nsqd.options import (
    OPTION_SPECS,
    TLS_REQUIRED,
    TLS_REQUIRED_EXCEPT_HTTP,
    Options,
    OptionsError,
    format_duration,
    load_config,
    parse_duration,
    split_host_port,
)

FIELDS = [f.name for f in dataclasses.fields(Options)]
DOCS = pathlib.Path(__file__).resolve().parent.parent / "docs" / "configuration.md"


def write_config(tmp_path, text):
    path = tmp_path / "nsqd.toml"
    path.write_text(text)
    return str(path)


def exit_error(capsys, argv):
    """Run parse_args expecting argparse's exit status 2; return stderr."""
    with pytest.raises(SystemExit) as exc_info:
        cli.parse_args(argv)
    assert exc_info.value.code == 2
    return capsys.readouterr().err


# --- defaults ----------------------------------------------------------------

# Go nsqd's NewOptions(), except the TCP and HTTP listen addresses and the
# data path (docs/compatibility.md says why), and the extensions, which are
# off or keep Go's behaviour by default.
EXPECTED_DEFAULTS = {
    "tcp_address": "127.0.0.1:4150",
    "http_address": "127.0.0.1:4151",
    "https_address": "0.0.0.0:4152",
    "broadcast_tcp_port": 0,
    "broadcast_http_port": 0,
    "http_client_connect_timeout": 2.0,
    "http_client_request_timeout": 5.0,
    "topology_region": "",
    "topology_zone": "",
    "enable_experiments": [],
    "config": "",
    "auth_http_addresses": [],
    "auth_http_request_method": "get",
    "lookupd_tcp_addresses": [],
    "data_path": "./data",
    "mem_queue_size": 10000,
    "max_bytes_per_file": 104857600,
    "sync_every": 2500,
    "sync_timeout": 2.0,
    "durable": False,
    "queue_scan_interval": 0.1,
    "queue_scan_refresh_interval": 5.0,
    "queue_scan_selection_count": 20,
    "queue_scan_worker_pool_max": 4,
    "queue_scan_dirty_percent": 0.25,
    "msg_timeout": 60.0,
    "max_msg_timeout": 900.0,
    "max_msg_size": 1048576,
    "max_body_size": 5242880,
    "max_req_timeout": 3600.0,
    "client_timeout": 60.0,
    "max_heartbeat_interval": 60.0,
    "max_rdy_count": 2500,
    "max_output_buffer_size": 65536,
    "max_output_buffer_timeout": 30.0,
    "min_output_buffer_timeout": 0.025,
    "output_buffer_timeout": 0.25,
    "max_channel_consumers": 0,
    "statsd_address": "",
    "statsd_prefix": "nsq.%s",
    "statsd_interval": 60.0,
    "statsd_mem_stats": True,
    "statsd_udp_packet_size": 508,
    "statsd_exclude_ephemeral": False,
    "e2e_processing_latency_window_time": 600.0,
    "e2e_processing_latency_percentiles": [],
    "tls_cert": "",
    "tls_key": "",
    "tls_client_auth_policy": "",
    "tls_root_ca_file": "",
    "tls_required": 0,
    "tls_min_version": 0x0301,
    "deflate": True,
    "max_deflate_level": 6,
    "snappy": True,
    "log_level": "info",
    "log_prefix": "[nsqd] ",
    "log_format": "console",
    "topic_max_messages": 0,
    "channel_max_messages": 0,
    "channel_max_bytes": 0,
    "max_disk_bytes": 0,
    "overflow_policy": "reject",
    "max_attempts": 0,
    "dead_letter_suffix": ".dead",
    "message_ttl": 0.0,
    "declare": [],
    "shutdown_grace": 5.0,
    "max_body_memory": 256 * 1024 * 1024,
    "amqp_address": "",
    "amqps_address": "",
}


def test_defaults_match_nsqd(monkeypatch):
    monkeypatch.setattr("socket.gethostname", lambda: "nsq-test-host")
    monkeypatch.setattr("resource.getrlimit", lambda which: (1024, 4096))
    options = Options()
    values = dataclasses.asdict(options)
    # crc32(md5("nsq-test-host")) % 1024, nsqd's default ID
    assert values.pop("node_id") == 806
    assert values.pop("broadcast_address") == "nsq-test-host"
    assert values.pop("max_connections") == 768  # 1024 descriptors less max(256, 1024 // 4)
    assert values == EXPECTED_DEFAULTS
    options.validate()


def test_list_defaults_are_not_shared():
    first, second = Options(), Options()
    first.lookupd_tcp_addresses.append("a:1")
    assert second.lookupd_tcp_addresses == []


def test_no_flags_gives_defaults():
    assert cli.parse_args([]) == Options()


# --- flags -------------------------------------------------------------------

# One command-line value per field and what it must become.
FLAG_SAMPLES = {
    "node_id": ("7", 7),
    "tcp_address": ("0.0.0.0:1", "0.0.0.0:1"),
    "http_address": ("0.0.0.0:2", "0.0.0.0:2"),
    "https_address": ("0.0.0.0:3", "0.0.0.0:3"),
    "broadcast_address": ("bcast.example", "bcast.example"),
    "broadcast_tcp_port": ("4000", 4000),
    "broadcast_http_port": ("4001", 4001),
    "http_client_connect_timeout": ("3s", 3.0),
    "http_client_request_timeout": ("7s", 7.0),
    "topology_region": ("eu", "eu"),
    "topology_zone": ("eu-1a", "eu-1a"),
    "enable_experiments": ("topology-aware-consumption", ["topology-aware-consumption"]),
    "config": ("/etc/nsqd.toml", "/etc/nsqd.toml"),
    "auth_http_addresses": ("auth:80", ["auth:80"]),
    "auth_http_request_method": ("post", "post"),
    "lookupd_tcp_addresses": ("lk:4160", ["lk:4160"]),
    "data_path": ("/var/lib/nsq", "/var/lib/nsq"),
    "mem_queue_size": ("5", 5),
    "max_bytes_per_file": ("1024", 1024),
    "sync_every": ("10", 10),
    "sync_timeout": ("250ms", 0.25),
    "durable": ("true", True),
    "queue_scan_interval": ("50ms", 0.05),
    "queue_scan_refresh_interval": ("1m", 60.0),
    "queue_scan_selection_count": ("40", 40),
    "queue_scan_worker_pool_max": ("8", 8),
    "queue_scan_dirty_percent": ("0.5", 0.5),
    "msg_timeout": ("90s", 90.0),
    "max_msg_timeout": ("30m", 1800.0),
    "max_msg_size": ("2048", 2048),
    "max_body_size": ("4096", 4096),
    "max_req_timeout": ("2h", 7200.0),
    "client_timeout": ("45s", 45.0),
    "max_heartbeat_interval": ("2m", 120.0),
    "max_rdy_count": ("100", 100),
    "max_output_buffer_size": ("1000", 1000),
    "max_output_buffer_timeout": ("10s", 10.0),
    "min_output_buffer_timeout": ("5ms", 0.005),
    "output_buffer_timeout": ("100ms", 0.1),
    "max_channel_consumers": ("3", 3),
    "max_connections": ("100", 100),
    "max_body_memory": ("67108864", 64 * 1024 * 1024),
    "statsd_address": ("127.0.0.1:8125", "127.0.0.1:8125"),
    "statsd_prefix": ("p.%s", "p.%s"),
    "statsd_interval": ("10s", 10.0),
    "statsd_mem_stats": ("false", False),
    "statsd_udp_packet_size": ("1400", 1400),
    "statsd_exclude_ephemeral": ("true", True),
    "e2e_processing_latency_window_time": ("1m", 60.0),
    "e2e_processing_latency_percentiles": ("0.99", [0.99]),
    "tls_cert": ("c.pem", "c.pem"),
    "tls_key": ("k.pem", "k.pem"),
    "tls_client_auth_policy": ("require", "require"),
    "tls_root_ca_file": ("ca.pem", "ca.pem"),
    "tls_required": ("tcp-https", TLS_REQUIRED_EXCEPT_HTTP),
    "tls_min_version": ("tls1.2", 0x0303),
    "deflate": ("false", False),
    "max_deflate_level": ("9", 9),
    "snappy": ("false", False),
    "log_level": ("DEBUG", "debug"),
    "log_prefix": ("[x] ", "[x] "),
    "log_format": ("json", "json"),
    "topic_max_messages": ("100", 100),
    "shutdown_grace": ("1500ms", 1.5),
    "overflow_policy": ("drop-oldest", "drop-oldest"),
    "channel_max_bytes": ("1048576", 1048576),
    "max_disk_bytes": ("1000000000", 1000000000),
    "max_attempts": ("5", 5),
    "dead_letter_suffix": ("-dlq", "-dlq"),
    "message_ttl": ("10m", 600.0),
    "declare": ("orders:billing", ["orders:billing"]),
    "channel_max_messages": ("50", 50),
    "amqp_address": ("0.0.0.0:5673", "0.0.0.0:5673"),
    "amqps_address": ("0.0.0.0:5671", "0.0.0.0:5671"),
}

# Flags whose names are not the field name in kebab case (nsqd's singular
# names for repeatable flags).
RENAMED_FLAGS = {
    "enable_experiments": "--enable-experiment",
    "auth_http_addresses": "--auth-http-address",
    "lookupd_tcp_addresses": "--lookupd-tcp-address",
    "e2e_processing_latency_percentiles": "--e2e-processing-latency-percentile",
}


def test_every_field_has_exactly_one_flag():
    flags_by_dest = {
        action.dest: action.option_strings
        for action in cli.build_parser()._actions
        if action.dest not in ("help", "version") and not action.dest.startswith("_deprecated")
    }
    assert set(flags_by_dest) == set(FIELDS)
    for name in FIELDS:
        expected = RENAMED_FLAGS.get(name, "--" + name.replace("_", "-"))
        assert flags_by_dest[name] == [expected]


@pytest.mark.parametrize("name", FIELDS)
def test_flag_sets_its_field_only(name):
    text, expected = FLAG_SAMPLES[name]
    assert getattr(Options(), name) != expected
    flag = "--" + OPTION_SPECS[name].flag
    parsed = cli.build_parser().parse_args([f"{flag}={text}"])
    assert vars(parsed) == {name: expected}


def test_samples_cover_every_field():
    assert set(FLAG_SAMPLES) == set(FIELDS)


def test_go_style_flag_syntax():
    options = cli.parse_args(
        [
            "-mem-queue-size=7",
            "-msg-timeout",
            "90s",
            "--snappy=false",
            "--deflate",
            "-statsd-mem-stats=0",
            "--lookupd-tcp-address=a:1",
            "--lookupd-tcp-address",
            "b:2",
            "--e2e-processing-latency-percentile=0.5,1.0",
            "--e2e-processing-latency-percentile=0.99",
        ]
    )
    assert options.mem_queue_size == 7
    assert options.msg_timeout == 90.0
    assert options.snappy is False
    assert options.deflate is True
    assert options.statsd_mem_stats is False
    assert options.lookupd_tcp_addresses == ["a:1", "b:2"]
    # nsqd keeps percentiles sorted from highest to lowest
    assert options.e2e_processing_latency_percentiles == [1.0, 0.99, 0.5]


def test_a_flag_that_takes_a_value_takes_the_next_argument_whatever_it_looks_like():
    # Go's flag package: "-log-prefix -x-" sets the prefix; argparse alone would see a flag
    options = cli.parse_args(["-tcp-address", "127.0.0.1:0", "--log-prefix", "-x- ", "-lookupd-tcp-address=a:1",
                              "--http-address", "", "-broadcast-address", "-host"])
    assert (options.tcp_address, options.log_prefix, options.lookupd_tcp_addresses) == ("127.0.0.1:0", "-x- ", ["a:1"])
    assert (options.http_address, options.broadcast_address) == ("", "-host")


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["--tls-required"], TLS_REQUIRED),
        (["--tls-required=true"], TLS_REQUIRED),
        (["--tls-required=tcp-https"], TLS_REQUIRED_EXCEPT_HTTP),
        (["--tls-required=false"], 0),
    ],
)
def test_tls_required_flag_forms(argv, expected):
    options = cli.parse_args([*argv, "--tls-cert=c.pem", "--tls-key=k.pem"])
    assert options.tls_required == expected


def test_client_auth_policy_implies_tls_required():
    assert Options(tls_client_auth_policy="require").tls_required == TLS_REQUIRED


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--msg-timeout=60"], "argument --msg-timeout: invalid duration '60': missing unit"),
        (["--mem-queue-size=lots"], "argument --mem-queue-size: invalid int value: 'lots'"),
        (["--snappy=yes"], "argument --snappy: invalid boolean 'yes'"),
        (["--log-level=loud"], "argument --log-level: invalid log level 'loud'"),
        (["--tls-min-version=ssl3.0"], "argument --tls-min-version: invalid TLS version 'ssl3.0'"),
        (["--e2e-processing-latency-percentile=x"], "invalid percentile list 'x'"),
        (["--mem-queue-size=-1"], "--mem-queue-size must be >= 0"),
        (["--max-deflate-level=10"], "--max-deflate-level must be [1,9]"),
        (["--tcp-address=4150"], "--tcp-address: invalid address '4150'"),
        (["--no-such-flag=1"], "unrecognized arguments: --no-such-flag=1"),
        (["--mem-queue"], "unrecognized arguments: --mem-queue"),  # no abbreviations
    ],
)
def test_bad_flags_exit_2_with_message(capsys, argv, message):
    err = exit_error(capsys, argv)
    assert message in err
    assert err.startswith("usage: nsqd")


def test_version(capsys):
    with pytest.raises(SystemExit) as exc_info:
        cli.parse_args(["--version"])
    assert exc_info.value.code == 0
    out = capsys.readouterr().out
    major, minor = sys.version_info[:2]
    assert re.fullmatch(rf"nsqd v1\.3\.0 \(built w/nsqd-trio0\.1\.0-python{major}\.{minor}\.\d+\)\n", out)


def test_help_states_every_default(capsys):
    with pytest.raises(SystemExit):
        cli.parse_args(["--help"])
    out = " ".join(capsys.readouterr().out.split())
    for expected in (
        "(default 1m0s)",
        "(default 10000)",
        '(default "127.0.0.1:4150")',
        "(default true)",
        '(default "nsq.%s")',
    ):
        assert expected in out
    assert out.count("(default ") == len(FIELDS)


# --- durations ---------------------------------------------------------------

NS = 1
US = 1_000
MS = 1_000_000
S = 1_000_000_000


@pytest.mark.parametrize(
    ("text", "ns"),
    [
        ("0", 0),
        ("2s", 2 * S),
        ("100ms", 100 * MS),
        ("15m", 900 * S),
        ("1h30m", 5400 * S),
        ("1.5s", 1500 * MS),
        ("500us", 500 * US),
        ("500\u00b5s", 500 * US),
        ("500\u03bcs", 500 * US),
        ("10ns", 10 * NS),
        (".5s", 500 * MS),
        ("1.s", S),
        ("+5s", 5 * S),
        ("-1.5h", -5400 * S),
        ("1h1m1s1ms1us1ns", 3661 * S + MS + US + NS),
        ("0.000000001s", NS),
        ("9223372036854775807ns", 2**63 - 1),
        ("-9223372036854775808ns", -(2**63)),
    ],
)
def test_parse_duration(text, ns):
    assert parse_duration(text) == ns / 1e9


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("", "invalid duration ''"),
        ("10", "missing unit"),
        ("1.5", "missing unit"),
        ("1s2", "missing unit"),
        ("s", "invalid duration 's'"),
        (".", "invalid duration '.'"),
        ("-", "invalid duration '-'"),
        ("-.s", "invalid duration '-.s'"),
        ("1x", "unknown unit 'x'"),
        ("1 s", "unknown unit ' s'"),
        ("1e3s", "unknown unit 'e'"),
        ("\u0661s", "invalid duration"),  # Arabic-Indic digit
        ("9223372036854775808ns", "out of range"),
    ],
)
def test_parse_duration_errors(text, message):
    with pytest.raises(OptionsError, match=re.escape(message)):
        parse_duration(text)


@pytest.mark.parametrize(
    ("ns", "text"),
    [
        (0, "0s"),
        (1, "1ns"),
        (1100 * NS, "1.1\u00b5s"),
        (2200 * US, "2.2ms"),
        (250 * MS, "250ms"),
        (2 * S, "2s"),
        (3300 * MS, "3.3s"),
        (60 * S, "1m0s"),
        (245 * S, "4m5s"),
        (245001 * MS, "4m5.001s"),
        (3600 * S, "1h0m0s"),
        (18367001 * MS, "5h6m7.001s"),
        (480 * S + 1, "8m0.000000001s"),
        (-1500 * MS, "-1.5s"),
        (-1, "-1ns"),
    ],
)
def test_format_duration(ns, text):
    assert format_duration(ns / 1e9) == text


@given(st.integers(min_value=-(10**15), max_value=10**15))
def test_duration_round_trip(ns):
    assert round(parse_duration(format_duration(ns / 1e9)) * 1e9) == ns


# --- addresses ---------------------------------------------------------------


@pytest.mark.parametrize(
    ("address", "expected"),
    [
        ("127.0.0.1:4150", ("127.0.0.1", 4150)),
        ("[::1]:4150", ("::1", 4150)),
        (":4150", ("", 4150)),
        ("localhost:0", ("localhost", 0)),
    ],
)
def test_split_host_port(address, expected):
    assert split_host_port(address) == expected


@pytest.mark.parametrize(
    "address", ["", "4150", "::1:4150", "[::1]", "host:", "host:http", "host:65536", "[a]b:1", "h:+1"]
)
def test_split_host_port_errors(address):
    with pytest.raises(OptionsError, match="want host:port"):
        split_host_port(address)


# --- config file -------------------------------------------------------------


def test_config_file_precedence(tmp_path):
    path = write_config(
        tmp_path,
        """
        mem_queue_size = 123
        max_rdy_count = 77
        msg_timeout = "30s"
        nsqlookupd_tcp_addresses = ["a:4160", "b:4160"]
        snappy = false
        """,
    )
    options = cli.parse_args(["--config", path, "--mem-queue-size=5", "--lookupd-tcp-address=c:4160"])
    assert options.config == path
    assert options.mem_queue_size == 5  # flag beats file
    assert options.lookupd_tcp_addresses == ["c:4160"]  # a flag replaces the file's list
    assert options.max_rdy_count == 77  # file beats default
    assert options.msg_timeout == 30.0
    assert options.snappy is False
    assert options.max_msg_size == 1048576  # default


def test_config_file_in_nsqd_style(tmp_path):
    """Keys, value types and coercions as Go nsqd's own config files use them."""
    path = write_config(
        tmp_path,
        """
        id = 42
        log_level = "debug"
        tcp_address = "0.0.0.0:4150"
        http_client_connect_timeout = "2s"
        sync_timeout = 1500                 # integer durations are milliseconds
        max_req_timeout = "1h"
        auth_http_addresses = "a:1,b:2"     # strings split on commas
        e2e_processing_latency_percentiles = [1.0, 0.99, 0.95]
        e2e_processing_latency_window_time = "10m"
        tls_required = false
        tls_min_version = ""
        enable_experiment = ["topology-aware-consumption"]
        statsd_prefix = "nsq.%s"
        deflate = true
        """,
    )
    options = cli.parse_args(["--config", path])
    assert options.node_id == 42
    assert options.log_level == "debug"
    assert options.tcp_address == "0.0.0.0:4150"
    assert options.http_client_connect_timeout == 2.0
    assert options.sync_timeout == 1.5
    assert options.max_req_timeout == 3600.0
    assert options.auth_http_addresses == ["a:1", "b:2"]
    assert options.e2e_processing_latency_percentiles == [1.0, 0.99, 0.95]
    assert options.e2e_processing_latency_window_time == 600.0
    assert options.tls_required == 0
    assert options.tls_min_version == 0x0301
    assert options.enable_experiments == ["topology-aware-consumption"]


def test_config_file_accepts_field_names(tmp_path):
    path = write_config(tmp_path, 'node_id = 9\nlookupd_tcp_addresses = ["x:1"]\nenable_experiments = []\n')
    assert load_config(path) == {"node_id": 9, "lookupd_tcp_addresses": ["x:1"], "enable_experiments": []}


def test_config_file_tls_values(tmp_path):
    path = write_config(tmp_path, 'tls_required = "tcp-https"\ntls_min_version = "tls1.3"\n')
    assert load_config(path) == {"tls_required": TLS_REQUIRED_EXCEPT_HTTP, "tls_min_version": 0x0304}
    path = write_config(tmp_path, "tls_required = true\n")
    assert load_config(path) == {"tls_required": TLS_REQUIRED}


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("mem_queue_sise = 1\n", "unknown option 'mem_queue_sise'"),
        ("config = 'other.toml'\n", "unknown option 'config'"),
        ("id = 1\nnode_id = 2\n", "'node_id' repeats another key"),
        ('mem_queue_size = "lots"\n', "'mem_queue_size': wrong type str, expected an integer"),
        ("msg_timeout = 1.5\n", "'msg_timeout': wrong type float, expected a duration"),
        ('msg_timeout = "60"\n', "'msg_timeout': invalid duration '60': missing unit"),
        ("snappy = 1\n", "'snappy': wrong type int, expected a boolean"),
        ("tcp_address = 4150\n", "'tcp_address': wrong type int, expected a string"),
        ("nsqlookupd_tcp_addresses = [1]\n", "'nsqlookupd_tcp_addresses': wrong type int, expected a string"),
        ('log_level = "loud"\n', "'log_level': invalid log level 'loud'"),
        ("mem_queue_size = \n", "failed to load config file"),
    ],
)
def test_config_file_errors(tmp_path, capsys, text, message):
    path = write_config(tmp_path, text)
    with pytest.raises(OptionsError, match=re.escape(message)):
        load_config(path)
    assert message in exit_error(capsys, ["--config", path])


def test_missing_config_file(tmp_path, capsys):
    err = exit_error(capsys, ["--config", str(tmp_path / "absent.toml")])
    assert "failed to load config file" in err


def test_config_file_values_are_validated(tmp_path, capsys):
    path = write_config(tmp_path, "mem_queue_size = -5\n")
    assert "--mem-queue-size must be >= 0" in exit_error(capsys, ["--config", path])


# --- validate ----------------------------------------------------------------


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"node_id": 1024}, "--node-id must be [0,1024)"),
        ({"node_id": -1}, "--node-id must be [0,1024)"),
        ({"tcp_address": ""}, "--tcp-address: invalid address"),
        ({"http_address": "localhost"}, "--http-address: invalid address"),
        ({"https_address": "::1:443"}, "--https-address: invalid address"),
        ({"statsd_address": "statsd"}, "--statsd-address: invalid address"),
        ({"amqp_address": "5672"}, "--amqp-address: invalid address"),
        ({"amqps_address": "5671"}, "--amqps-address: invalid address"),
        ({"amqps_address": "127.0.0.1:5671"}, "--amqps-address needs --tls-cert and --tls-key"),
        ({"amqps_address": "127.0.0.1:5671", "tls_cert": "c.pem"}, "--amqps-address needs --tls-cert and --tls-key"),
        ({"lookupd_tcp_addresses": ["a:1", "b"]}, "--lookupd-tcp-address: invalid address 'b'"),
        ({"broadcast_address": ""}, "--broadcast-address must not be empty"),
        ({"broadcast_tcp_port": 65536}, "--broadcast-tcp-port must be [0,65535]"),
        ({"broadcast_http_port": -1}, "--broadcast-http-port must be [0,65535]"),
        ({"enable_experiments": ["warp-drive"]}, "--enable-experiment: unknown experiment 'warp-drive'"),
        ({"auth_http_addresses": [""]}, "--auth-http-address must not be empty"),
        ({"auth_http_request_method": "put"}, "--auth-http-request-method must be post or get"),
        ({"mem_queue_size": -1}, "--mem-queue-size must be >= 0"),
        ({"max_bytes_per_file": 0}, "--max-bytes-per-file must be > 0"),
        ({"sync_every": 0}, "--sync-every must be > 0"),
        ({"sync_timeout": 0.0}, "--sync-timeout must be > 0"),
        ({"http_client_connect_timeout": -1.0}, "--http-client-connect-timeout must be > 0"),
        ({"http_client_request_timeout": 0.0}, "--http-client-request-timeout must be > 0"),
        ({"queue_scan_interval": 0.0}, "--queue-scan-interval must be > 0"),
        ({"queue_scan_refresh_interval": 0.0}, "--queue-scan-refresh-interval must be > 0"),
        ({"queue_scan_selection_count": 0}, "--queue-scan-selection-count must be >= 1"),
        ({"queue_scan_worker_pool_max": 0}, "--queue-scan-worker-pool-max must be >= 1"),
        ({"queue_scan_dirty_percent": 0.0}, "--queue-scan-dirty-percent must be in (0,1]"),
        ({"queue_scan_dirty_percent": 1.01}, "--queue-scan-dirty-percent must be in (0,1]"),
        ({"queue_scan_dirty_percent": float("nan")}, "--queue-scan-dirty-percent must be in (0,1]"),
        ({"msg_timeout": 0.0}, "--msg-timeout must be > 0"),
        ({"msg_timeout": 901.0}, "--max-msg-timeout must be >= --msg-timeout"),
        ({"max_req_timeout": -1.0}, "--max-req-timeout must be >= 0"),
        ({"client_timeout": 0.0}, "--client-timeout must be > 0"),
        ({"max_heartbeat_interval": 0.0}, "--max-heartbeat-interval must be > 0"),
        ({"max_msg_size": 0}, "--max-msg-size must be > 0"),
        ({"max_body_size": 0}, "--max-body-size must be > 0"),
        ({"max_rdy_count": 0}, "--max-rdy-count must be > 0"),
        ({"max_output_buffer_size": 0}, "--max-output-buffer-size must be > 0"),
        ({"max_output_buffer_timeout": 0.0}, "--max-output-buffer-timeout must be > 0"),
        ({"min_output_buffer_timeout": -0.001}, "--min-output-buffer-timeout must be >= 0"),
        (
            {"min_output_buffer_timeout": 31.0},
            "--max-output-buffer-timeout must be >= --min-output-buffer-timeout",
        ),
        ({"output_buffer_timeout": 0.0}, "--output-buffer-timeout must be > 0"),
        ({"max_channel_consumers": -1}, "--max-channel-consumers must be >= 0"),
        ({"max_connections": -1}, "--max-connections must be >= 0"),
        ({"max_body_memory": -1}, "--max-body-memory must be >= 0"),
        ({"statsd_interval": 0.0}, "--statsd-interval must be > 0"),
        ({"statsd_udp_packet_size": 0}, "--statsd-udp-packet-size must be > 0"),
        ({"e2e_processing_latency_window_time": 0.0}, "--e2e-processing-latency-window-time must be > 0"),
        (
            {"e2e_processing_latency_percentiles": [0.5, 1.5]},
            "--e2e-processing-latency-percentile must be in (0,1], got 1.5",
        ),
        (
            {"e2e_processing_latency_percentiles": [0.0]},
            "--e2e-processing-latency-percentile must be in (0,1], got 0.0",
        ),
        ({"tls_required": 3}, "--tls-required must be true, false or tcp-https"),
        ({"tls_min_version": 0x0300}, "--tls-min-version must be one of tls1.0"),
        (
            {"tls_client_auth_policy": "maybe", "tls_cert": "c", "tls_key": "k"},
            "--tls-client-auth-policy must be require or require-verify",
        ),
        ({"tls_cert": "c.pem"}, "--tls-cert and --tls-key must be given together"),
        ({"tls_key": "k.pem"}, "--tls-cert and --tls-key must be given together"),
        (
            {"tls_required": TLS_REQUIRED},
            "--tls-required (or --tls-client-auth-policy) needs --tls-cert and --tls-key",
        ),
        (
            {"tls_client_auth_policy": "require"},
            "--tls-required (or --tls-client-auth-policy) needs --tls-cert",
        ),
        ({"max_deflate_level": 0}, "--max-deflate-level must be [1,9]"),
        ({"log_level": "trace"}, "--log-level must be one of debug, info, warn, error, fatal"),
        ({"log_format": "xml"}, "--log-format must be console or json"),
        ({"lookupd_tcp_addresses": [f"10.0.0.{i}:4160" for i in range(65)]},
         "--lookupd-tcp-address may be given at most 64 times"),
    ],
)
def test_validate_names_the_flag(changes, message):
    options = dataclasses.replace(Options(), **changes)
    with pytest.raises(OptionsError, match=re.escape(message)):
        options.validate()
    assert issubclass(OptionsError, ValueError)


@pytest.mark.parametrize(
    "changes",
    [
        {"node_id": 0},
        {"node_id": 1023},
        {"queue_scan_dirty_percent": 1.0},
        {"http_address": "", "amqp_address": "", "statsd_address": ""},
        {"tcp_address": "[::1]:0"},
        {"mem_queue_size": 0, "max_req_timeout": 0.0, "min_output_buffer_timeout": 0.0},
        {"msg_timeout": 900.0},
        {"e2e_processing_latency_percentiles": [1.0, 0.5]},
        {"tls_required": TLS_REQUIRED, "tls_cert": "c.pem", "tls_key": "k.pem"},
        {"amqps_address": "127.0.0.1:5671", "tls_cert": "c.pem", "tls_key": "k.pem"},
        {"max_msg_size": 10 * 1024 * 1024},  # Go nsqd does not tie it to max_body_size
        {"lookupd_tcp_addresses": [f"10.0.0.{i}:4160" for i in range(64)] * 2},  # repeats count once
    ],
)
def test_validate_accepts_edges(changes):
    dataclasses.replace(Options(), **changes).validate()


# --- GET /config/:opt --------------------------------------------------------

# Go nsqd v1.3.0 answers /config/<name> for every option with a flag tag, under
# its cfg name; everything else (later nsqd's topology, experiment and auth
# method flags too) is INVALID_OPTION.
GO_CONFIG_NAMES = {
    "id", "log_level", "log_prefix", "tcp_address", "http_address",
    "https_address", "broadcast_address", "broadcast_tcp_port",
    "broadcast_http_port", "nsqlookupd_tcp_addresses", "auth_http_addresses",
    "http_client_connect_timeout", "http_client_request_timeout",
    "data_path", "mem_queue_size", "max_bytes_per_file", "sync_every",
    "sync_timeout", "queue_scan_selection_count", "queue_scan_worker_pool_max",
    "msg_timeout", "max_msg_timeout", "max_msg_size", "max_body_size",
    "max_req_timeout", "max_heartbeat_interval", "max_rdy_count",
    "max_output_buffer_size", "max_output_buffer_timeout",
    "min_output_buffer_timeout", "output_buffer_timeout",
    "max_channel_consumers", "statsd_address", "statsd_prefix",
    "statsd_interval", "statsd_mem_stats", "statsd_udp_packet_size",
    "statsd_exclude_ephemeral", "e2e_processing_latency_window_time",
    "e2e_processing_latency_percentiles", "tls_cert", "tls_key",
    "tls_client_auth_policy", "tls_root_ca_file", "tls_required",
    "tls_min_version", "deflate", "max_deflate_level", "snappy",
}  # fmt: skip


def test_config_exposes_exactly_nsqds_names():
    options = Options()
    for name in GO_CONFIG_NAMES:
        assert options.config_json(name) is not None, name
    for name in [
        "node_id",
        "lookupd_tcp_addresses",
        "enable_experiments",
        "enable_experiment",
        "topology_region",
        "topology_zone",
        "auth_http_request_method",
        "client_timeout",
        "queue_scan_interval",
        "queue_scan_refresh_interval",
        "queue_scan_dirty_percent",
        "amqp_address",
        "amqps_address",
        "topic_max_messages",
        "channel_max_messages",
        "shutdown_grace",
        "max_body_memory",
        "max_connections",
        "durable",
        "overflow_policy",
        "channel_max_bytes",
        "max_disk_bytes",
        "max_attempts",
        "dead_letter_suffix",
        "message_ttl",
        "declare",
        "log_format",
        "config",
        "bogus",
    ]:
        assert options.config_json(name) is None, name
        with pytest.raises(KeyError):
            options.config_value(name)


@pytest.mark.parametrize(
    ("changes", "name", "body"),
    [
        ({}, "msg_timeout", b"60000000000"),
        ({}, "min_output_buffer_timeout", b"25000000"),
        ({}, "e2e_processing_latency_window_time", b"600000000000"),
        ({"sync_timeout": 1.5}, "sync_timeout", b"1500000000"),
        ({}, "mem_queue_size", b"10000"),
        ({"node_id": 77}, "id", b"77"),
        ({}, "log_level", b"2"),
        ({"log_level": "debug"}, "log_level", b"1"),
        ({"log_level": "fatal"}, "log_level", b"5"),
        ({}, "snappy", b"true"),
        ({}, "statsd_exclude_ephemeral", b"false"),
        ({}, "tls_min_version", b"769"),
        ({"tls_required": TLS_REQUIRED_EXCEPT_HTTP}, "tls_required", b"1"),
        ({}, "nsqlookupd_tcp_addresses", b"[]"),
        ({"lookupd_tcp_addresses": ["a:4160", "b:4160"]}, "nsqlookupd_tcp_addresses", b'["a:4160","b:4160"]'),
        (
            {"auth_http_addresses": ["http://a/?x=1&y=<2>"]},
            "auth_http_addresses",
            b'["http://a/?x=1\\u0026y=\\u003c2\\u003e"]',
        ),
        ({}, "e2e_processing_latency_percentiles", b"[]"),
        (
            {"e2e_processing_latency_percentiles": [1.0, 0.99, 0.5]},
            "e2e_processing_latency_percentiles",
            b"[1,0.99,0.5]",
        ),
        ({"e2e_processing_latency_percentiles": [1e-7]}, "e2e_processing_latency_percentiles", b"[1e-7]"),
        (
            {"e2e_processing_latency_percentiles": [0.00001]},
            "e2e_processing_latency_percentiles",
            b"[0.00001]",
        ),
        # nsqd writes string values raw, not as JSON strings
        ({}, "tcp_address", b"127.0.0.1:4150"),
        ({}, "statsd_prefix", b"nsq.%s"),
        ({}, "https_address", b"0.0.0.0:4152"),
        ({"https_address": ""}, "https_address", b""),
        ({"broadcast_address": "h\u00e9"}, "broadcast_address", "h\u00e9".encode()),
    ],
)
def test_config_json_as_go_encodes(changes, name, body):
    assert dataclasses.replace(Options(), **changes).config_json(name) == body


def test_config_value_types():
    options = Options(lookupd_tcp_addresses=["a:1"])
    assert options.config_value("max_req_timeout") == 3_600_000_000_000
    assert type(options.config_value("max_req_timeout")) is int
    listed = options.config_value("nsqlookupd_tcp_addresses")
    listed.append("b:2")
    assert options.lookupd_tcp_addresses == ["a:1"]


# --- logging and main --------------------------------------------------------


@pytest.fixture
def restore_structlog():
    yield
    structlog.reset_defaults()


def test_json_logging(capsys, restore_structlog):
    cli.configure_logging(Options(log_format="json", log_level="info"))
    structlog.get_logger("nsqd.tcp").info("client connected", remote="1.2.3.4:5")
    structlog.get_logger("nsqd.tcp").debug("filtered out")
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 1
    record = json.loads(lines[0])
    assert record["event"] == "client connected"
    assert record["remote"] == "1.2.3.4:5"
    assert record["level"] == "info"
    assert record["logger"] == "nsqd.tcp"
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d+Z", record["timestamp"])


GO_LINE = re.compile(r"(?P<prefix>\[\w+\] )(?P<stamp>\d{4}/\d\d/\d\d \d\d:\d\d:\d\d\.\d{6}) "
                     r"(?P<level>DEBUG|INFO|WARNING|ERROR|FATAL): (?P<message>.*)")


def test_console_logging_and_level_change(capsys, restore_structlog):
    log = structlog.get_logger("nsqd.http")
    cli.configure_logging(Options(log_level="warn"))
    log.info("hidden")
    log.warning("shown")
    cli.configure_logging(Options(log_level="debug", log_prefix="[test] "))
    log.debug("now shown")
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 2
    first, second = (GO_LINE.fullmatch(line) for line in lines)
    assert (first["prefix"], first["level"], first["message"]) == ("[nsqd] ", "WARNING", "HTTP: shown")
    assert (second["prefix"], second["level"], second["message"]) == ("[test] ", "DEBUG", "HTTP: now shown")


def test_console_lines_are_go_nsqds(capsys, restore_structlog):
    """Go's log prefix, local date and time with microseconds, Go's level names, then the message."""
    import datetime

    cli.configure_logging(Options(log_level="debug"))
    before = datetime.datetime.now().replace(microsecond=0)
    structlog.get_logger("nsqd").info("TCP: listening on 127.0.0.1:4150")
    structlog.get_logger("nsqd.lookup").warning("lookupd connection failed", lookupd="a:1", error="timed out")
    structlog.get_logger("nsqd.tcp").error("TCP: accept failed", attempts=3)
    structlog.get_logger("amqp_gateway.server").critical("cannot go on", reason="")
    try:
        raise ValueError("boom")
    except ValueError:
        structlog.get_logger("nsqd.channel").exception("scan failed")
    lines = capsys.readouterr().err.splitlines()
    matches = [GO_LINE.fullmatch(line) for line in lines[:5]]
    assert all(matches), lines
    assert [(m["level"], m["message"]) for m in matches] == [
        ("INFO", "TCP: listening on 127.0.0.1:4150"),
        ("WARNING", 'LOOKUP: lookupd connection failed lookupd=a:1 error="timed out"'),
        ("ERROR", "TCP: accept failed attempts=3"),   # the component is not repeated
        ("FATAL", 'AMQP: cannot go on reason=""'),
        ("ERROR", "CHANNEL: scan failed"),
    ]
    stamp = datetime.datetime.strptime(matches[0]["stamp"], "%Y/%m/%d %H:%M:%S.%f")
    assert before <= stamp <= datetime.datetime.now()  # local time, as Go's log writes it
    assert lines[5] == "Traceback (most recent call last):" and lines[-1] == "ValueError: boom"


def test_main_runs_the_daemon(monkeypatch, restore_structlog):
    received = []

    def run(options):
        received.append(options)
        return 3

    monkeypatch.setitem(sys.modules, "nsqd.nsqd", types.SimpleNamespace(run=run))
    with pytest.raises(SystemExit) as exc_info:
        cli.main(["--mem-queue-size=11", "--log-format=json"])
    assert exc_info.value.code == 3
    assert [options.mem_queue_size for options in received] == [11]


def test_docs_list_every_flag_and_key():
    text = DOCS.read_text()
    for name, spec in OPTION_SPECS.items():
        assert f"`--{spec.flag}`" in text, spec.flag
        if name != "config":
            assert f"`{spec.cfg}`" in text, spec.cfg


def test_deprecated_go_flags_are_accepted_and_ignored():
    from nsqd.cli import parse_args

    options = parse_args(["--verbose", "--worker-id=3", "-verbose=false"])
    assert options == parse_args([])
