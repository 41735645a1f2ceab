"""API keys and the tenants they name, kept only as SHA-256 digests: the server's notion of who a client is."""

from __future__ import annotations

import hashlib
import hmac
import re
import threading
from pathlib import Path

from specdec.errors import ConfigError

_LINE = re.compile(r"^(?P<tenant>[A-Za-z0-9_.@-]{1,64})\s+(?:sha256:)?(?P<digest>[0-9a-fA-F]{64})$")


def key_digest(key: bytes | str) -> bytes:
    return hashlib.sha256(key.encode() if isinstance(key, str) else key).digest()


class TenantKeys:
    """Which tenant an API key names. A keys file holds one `TENANT SHA256HEX` per line (`#` comments; the hex is
    `printf %s KEY | sha256sum`), so the keys themselves are never at rest; reload() reads it again (SIGHUP)."""

    def __init__(self, digests: dict[bytes, str], path: Path | None = None):
        self._digests = dict(digests)
        self.path = path
        self._lock = threading.Lock()

    @classmethod
    def single(cls, key: str, tenant: str = "default") -> "TenantKeys":
        """One key, one tenant (`--api-key`)."""
        return cls({key_digest(key): tenant})

    @classmethod
    def from_file(cls, path: str | Path) -> "TenantKeys":
        path = Path(path)
        return cls(_read(path), path)

    @property
    def tenants(self) -> set[str]:
        return set(self._digests.values())

    def reload(self) -> None:
        """Read the keys file again; a file that no longer parses keeps the keys in force (and says why)."""
        if self.path is not None:
            digests = _read(self.path)
            with self._lock:
                self._digests = digests

    def tenant_of_header(self, authorization: bytes) -> str | None:
        """The tenant of an `Authorization: Bearer <key>` header's value; None: no bearer key, or no such key."""
        scheme, _, token = authorization.strip().partition(b" ")
        return self.tenant_of(token.strip()) if scheme.lower() == b"bearer" else None

    def tenant_of(self, token: bytes) -> str | None:
        """The tenant of a presented key, compared in constant time against every digest; None: no such key."""
        digest = key_digest(token)
        found = None
        with self._lock:
            entries = list(self._digests.items())
        for known, tenant in entries:
            if hmac.compare_digest(known, digest):
                found = tenant
        return found


def _read(path: Path) -> dict[bytes, str]:
    try:
        lines = path.read_text().splitlines()
    except OSError as exc:
        raise ConfigError(f"cannot read the API keys file {path}: {exc.strerror or exc}") from exc
    digests: dict[bytes, str] = {}
    for number, raw in enumerate(lines, 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        match = _LINE.match(line)
        if match is None:
            raise ConfigError(f"{path}:{number}: expected 'TENANT SHA256HEX' (the hex digest of the key, "
                              "printf %s KEY | sha256sum), got something else")
        digest = bytes.fromhex(match["digest"])
        if digest in digests:
            raise ConfigError(f"{path}:{number}: this key's digest is listed twice")
        digests[digest] = match["tenant"]
    if not digests:
        raise ConfigError(f"the API keys file {path} lists no keys")
    return digests
