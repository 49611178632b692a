"""ServerConfig: what `refengine serve` bounds and guards (validated at construction)."""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass, field

from refengine.errors import UnsupportedConfigError

LOOPBACK_NAMES = ("localhost", "127.0.0.1", "::1")
OPEN_PATHS = ("/health", "/metrics", "/version")  # answered without --api-key (probes, scrapers)


def is_loopback(host: str) -> bool:
    """A bind address only this machine reaches ("localhost", 127.0.0.0/8, ::1)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


@dataclass(frozen=True)
class ServerConfig:
    """Limits and guards of the HTTP layer.

    max_request_bytes: a larger body is a 413 before it is read (Content-Length) or as soon as it is.
    max_waiting: requests admitted beyond the engine's running batch (max_num_seqs); past that a new one is a
        429 with Retry-After (each prompt and choice of a request counts).
    max_prompts: prompts in one /v1/completions request; also the most choices (prompts x n) one request makes.
    max_stop_strings / max_stop_chars: stop strings per request and the length of each (a stop string of
        length L holds back up to L-1 streamed characters).
    api_key: when set, every path but OPEN_PATHS needs `Authorization: Bearer <key>` (401 otherwise).
    allowed_hosts: Host header names accepted (any port); None: the loopback names when the bind is a loopback
        address (a DNS-rebinding guard), anything otherwise. A Host outside it is a 403.
    shutdown_timeout: seconds SIGTERM waits for running requests before aborting them (then exit 0).
    prep_threads: worker threads that parse, validate and tokenize request bodies off the event loop."""

    model_name: str
    host: str = "127.0.0.1"
    max_request_bytes: int = 8 << 20
    max_waiting: int = 256
    max_prompts: int = 64
    max_stop_strings: int = 16
    max_stop_chars: int = 256
    api_key: str | None = None
    allowed_hosts: tuple[str, ...] | None = None
    shutdown_timeout: float = 30.0
    prep_threads: int = 2
    host_names: tuple[str, ...] = field(init=False)

    def __post_init__(self) -> None:
        if not self.model_name:
            raise UnsupportedConfigError("model_name must not be empty")
        for name in ("max_request_bytes", "max_prompts", "max_stop_strings", "max_stop_chars", "prep_threads"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise UnsupportedConfigError(f"{name}={v!r} must be an int >= 1")
        if isinstance(self.max_waiting, bool) or not isinstance(self.max_waiting, int) or self.max_waiting < 0:
            raise UnsupportedConfigError(f"max_waiting={self.max_waiting!r} must be an int >= 0")
        if not isinstance(self.shutdown_timeout, (int, float)) or not 0 <= self.shutdown_timeout <= 3600:
            raise UnsupportedConfigError(f"shutdown_timeout={self.shutdown_timeout!r} must be in 0..3600 seconds")
        if self.api_key is not None and (not self.api_key or any(c.isspace() for c in self.api_key)):
            raise UnsupportedConfigError("api_key must be non-empty without whitespace")
        hosts = self.allowed_hosts
        if hosts is None and is_loopback(self.host):
            hosts = LOOPBACK_NAMES
        names = tuple(h.lower().strip("[]") for h in hosts) if hosts else ()
        if hosts is not None and not all(names):
            raise UnsupportedConfigError(f"allowed_hosts={hosts!r}: empty host name")
        object.__setattr__(self, "host_names", names)

    @property
    def bind_warning(self) -> str | None:
        """What to print when the server is reachable from other machines without a key."""
        if self.api_key is None and not is_loopback(self.host):
            return (
                f"refengine serve: WARNING: binding {self.host} (not a loopback address) without --api-key: "
                "anyone who reaches this port can use the server"
            )
        return None
