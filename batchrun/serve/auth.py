"""API keys: ``--api-key-file`` (one key a line; blank lines and ``#`` comments skipped).

A request names its key in ``Authorization: Bearer KEY``; what it creates belongs to that key's
owner id (a hash of the key: the state database never holds a key). Without a key file the
server listens on loopback only and every request is the one local owner's.
"""

from __future__ import annotations

import hashlib
import hmac
from pathlib import Path

LOCAL_OWNER = "local"


class KeyFileError(ValueError):
    pass


def owner_id(key: str) -> str:
    return "key-" + hashlib.sha256(key.encode()).hexdigest()[:16]


class Keys:
    def __init__(self, keys: tuple[str, ...]):
        self._keys = {owner_id(k): k.encode() for k in keys}

    @classmethod
    def from_file(cls, path: str | None) -> Keys | None:
        """None without a file (loopback only, no keys)."""
        if path is None:
            return None
        try:
            lines = Path(path).read_text(encoding="utf-8").splitlines()
        except (OSError, UnicodeDecodeError) as e:
            raise KeyFileError(f"--api-key-file {path}: cannot read it: {e}") from e
        keys = tuple(s for s in (line.strip() for line in lines) if s and not s.startswith("#"))
        if not keys:
            raise KeyFileError(f"--api-key-file {path} holds no key (one key a line)")
        if any(len(k) < 16 or any(c.isspace() for c in k) for k in keys):
            raise KeyFileError(
                f"--api-key-file {path}: a key has fewer than 16 characters or holds a space"
            )
        return cls(keys)

    def owner(self, given: str | None) -> str | None:
        """The owner of the key `given`, None when it is no key of ours."""
        if not given:
            return None
        owner = owner_id(given)
        known = self._keys.get(owner)
        return owner if known is not None and hmac.compare_digest(known, given.encode()) else None


def bearer(header: str | None) -> str | None:
    if header and header.startswith("Bearer "):
        return header[len("Bearer ") :].strip()
    return None
