"""Command line: nsqd's flags and config-file precedence; then logging and the daemon."""

from __future__ import annotations

import argparse
import resource
import sys
from collections.abc import Sequence
from typing import NoReturn


from nsqd.options import (
    OPTION_SPECS,
    STRING_PARSERS,
    TLS_REQUIRED,
    TLS_VERSIONS,
    Options,
    OptionsError,
    format_duration,
    load_config,
)
from nsqd.logs import configure_logging
from nsqd.version import version_string


_METAVARS = {
    "int": "INT",
    "float": "FLOAT",
    "bool": "BOOL",
    "duration": "DURATION",
    "floats": "FLOAT[,FLOAT...]",
    "log_level": "LEVEL",
    "tls_required": "BOOL|tcp-https",
    "tls_min_version": "VERSION",
}


# kinds whose flag may stand alone (``--snappy`` means true), as Go's boolean flags
_OPTIONAL_VALUE = ("bool", "tls_required")


def _arg_type(kind: str):
    """The kind's parser, with our messages passed through argparse intact."""
    parse = STRING_PARSERS[kind]

    def convert(text: str) -> object:
        try:
            return parse(text)
        except OptionsError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    convert.__name__ = kind  # argparse names it in "invalid int value" errors
    return convert


def _show_default(kind: str, value: object) -> str:
    """A default as a user would type it."""
    if kind == "duration":
        return format_duration(value)
    if kind == "bool":
        return str(value).lower()
    if kind == "tls_required":
        return {0: "false", 1: "tcp-https", 2: "true"}[value]
    if kind == "tls_min_version":
        return next(name for name, number in TLS_VERSIONS.items() if number == value)
    if isinstance(value, list):
        return ",".join(map(str, value)) or "none"
    if isinstance(value, str):
        return f'"{value}"'
    return str(value)


class _PercentilesAction(argparse.Action):
    """Accumulates repeated and comma separated values, highest first as nsqd keeps them."""

    def __call__(self, parser, namespace, values, option_string=None):
        collected = [*getattr(namespace, self.dest, []), *values]
        setattr(namespace, self.dest, sorted(collected, reverse=True))


def build_parser() -> argparse.ArgumentParser:
    """One flag per Options field; flags not given stay out of the namespace."""
    defaults = Options()
    parser = argparse.ArgumentParser(
        prog="nsqd",
        usage="%(prog)s [--flag=value ...]",
        description="A realtime distributed messaging daemon speaking the NSQ protocol.",
        argument_default=argparse.SUPPRESS,
        allow_abbrev=False,
    )
    parser.add_argument("--version", action="version", version=version_string())
    for name, spec in OPTION_SPECS.items():
        shown = _show_default(spec.kind, getattr(defaults, name))
        kwargs = {
            "dest": name,
            "type": _arg_type(spec.kind),
            "metavar": _METAVARS.get(spec.kind, "VALUE"),
            "help": f"{spec.help} (default {shown})".replace("%", "%%"),
        }
        if spec.kind == "bool":
            kwargs.update(nargs="?", const=True)
        elif spec.kind == "tls_required":
            kwargs.update(nargs="?", const=TLS_REQUIRED)
        elif spec.kind == "strs":
            kwargs.update(action="append")
        elif spec.kind == "floats":
            kwargs.update(action=_PercentilesAction)
        parser.add_argument("--" + spec.flag, **kwargs)
    # Go nsqd still accepts these deprecated flags and ignores them; scripts pass them
    deprecated = parser.add_argument_group("deprecated (accepted, no effect)")
    deprecated.add_argument("--verbose", nargs="?", const=True, dest="_deprecated_verbose",
                            help="[deprecated] has no effect, use --log-level")
    deprecated.add_argument("--worker-id", dest="_deprecated_worker_id",
                            help="[deprecated] has no effect, use --node-id")
    return parser


def _go_syntax(argv: Sequence[str]) -> list[str]:
    """Go's flag syntax in the form argparse reads.

    ``-name`` is ``--name``, and a flag that takes a value takes the next
    argument whatever it looks like, as Go's flag package does
    (``-log-prefix -x-`` or ``--tcp-address 127.0.0.1:0``): the pair is
    passed on as ``--name=value``.
    """
    takes_value = {"--" + spec.flag for spec in OPTION_SPECS.values() if spec.kind not in _OPTIONAL_VALUE}
    out: list[str] = []
    args = iter(argv)
    for arg in args:
        if arg == "--":
            return out + [arg, *args]
        if len(arg) > 2 and arg[0] == "-" and arg[1].isalpha():
            arg = "-" + arg
        if arg in takes_value:
            value = next(args, None)
            if value is not None:
                arg = f"{arg}={value}"
        out.append(arg)
    return out


def parse_args(argv: Sequence[str]) -> Options:
    """Flags beat the config file, which beats the defaults; exits 2 on bad input."""
    parser = build_parser()
    given = {k: v for k, v in vars(parser.parse_args(_go_syntax(argv))).items() if not k.startswith("_deprecated")}
    try:
        from_file = load_config(given["config"]) if given.get("config") else {}
        options = Options(**(from_file | given))
        options.validate()
    except OptionsError as exc:
        parser.error(str(exc))
    return options


def raise_open_file_limit() -> None:
    """Raise the soft open-file limit to the hard one, as every Go program (nsqd too) does at start.

    Each topic and channel keeps descriptors open (its disk queue's lock,
    segment and checkpoint files), so a soft limit of 1,024, common by
    default, runs out at a few hundred of them, where Go nsqd would go on.
    Runs before the options, whose ``--max-connections`` default follows the limit.
    """
    try:
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        if soft != hard:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    except (ValueError, OSError):  # refused (an infinite hard limit above fs.nr_open): keep the soft one
        pass


def main(argv: Sequence[str] | None = None) -> NoReturn:
    raise_open_file_limit()
    options = parse_args(sys.argv[1:] if argv is None else argv)
    configure_logging(options)
    from nsqd.nsqd import run  # late: parsing flags must not need the daemon

    sys.exit(run(options))
