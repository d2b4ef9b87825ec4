"""Topic and channel name rules, as nsqd enforces them, and text taken from clients' JSON."""

import re

#: ``\Z``, not ``$``: Python's ``$`` also matches before a final newline, Go's only at the end
_VALID = re.compile(r"[.a-zA-Z0-9_-]+(#ephemeral)?\Z")


def is_valid_name(name: str) -> bool:
    return 1 <= len(name) <= 64 and _VALID.match(name) is not None


is_valid_topic_name = is_valid_name
is_valid_channel_name = is_valid_name


#: a surrogate that a ``\\ud800``-style JSON escape left without its partner
_LONE_SURROGATE = re.compile("[\ud800-\udfff]")


def go_json_text(text: str) -> str:
    """A decoded JSON string as Go's decoder reads it: a lone surrogate escape becomes U+FFFD.

    Python keeps the lone surrogate, which cannot be encoded: a log line or a
    /stats answer carrying it would fail.
    """
    return _LONE_SURROGATE.sub("\ufffd", text) if _LONE_SURROGATE.search(text) else text
