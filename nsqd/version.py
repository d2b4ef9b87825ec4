"""Version strings: ours, and the nsqd protocol version we report to clients and tools."""

__version__ = "0.1.0"
#: nsqd release whose wire protocol and HTTP API we implement; tools such as
#: nsqadmin choose endpoints by this version, so it must be nsqd's semver.
NSQD_VERSION = "1.3.0"
