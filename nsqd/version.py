"""Version strings: ours, and the nsqd protocol version we report to clients and tools.

``--version``, the first log line and the text ``/stats`` carry Go nsqd's
shape, ``nsqd v1.3.0 (built w/TOOLCHAIN)``: harnesses match it with patterns
such as ``[a-z]+ v[0-9]+\\.[0-9]+\\.[0-9]+(-[a-z]+)? \\(built w/[a-z0-9.-]+\\)``
and compare the X.Y.Z against features ("HTTPS since 0.2.28"). So X.Y.Z is
the nsqd release we implement, with no pre-release suffix (semver would rank
``1.3.0-x`` below 1.3.0), and our own version goes where Go names its
compiler: ``nsqd v1.3.0 (built w/nsqd-trio0.1.0-python3.11.7)``.
"""

import platform
import re

__version__ = "0.1.0"
#: nsqd release whose wire protocol and HTTP API we implement; tools such as
#: nsqadmin choose endpoints by this version, so it must be nsqd's semver.
NSQD_VERSION = "1.3.0"


def toolchain() -> str:
    """Our name and version and the Python it runs on, one token as Go's ``go1.21.5``."""
    python = re.sub(r"[^a-z0-9.]+", "-", platform.python_version().lower())
    return f"nsqd-trio{__version__}-python{python}"


def version_string(app: str = "nsqd") -> str:
    """``<app> v<nsqd version> (built w/<toolchain>)``, as Go's internal/version.String."""
    return f"{app} v{NSQD_VERSION} (built w/{toolchain()})"
