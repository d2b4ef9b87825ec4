"""Topic and channel name rules, as nsqd enforces them."""

import re

#: ``\Z``, not ``$``: Python's ``$`` also matches before a final newline, Go's only at the end
_VALID = re.compile(r"[.a-zA-Z0-9_-]+(#ephemeral)?\Z")


def is_valid_name(name: str) -> bool:
    return 1 <= len(name) <= 64 and _VALID.match(name) is not None


is_valid_topic_name = is_valid_name
is_valid_channel_name = is_valid_name
