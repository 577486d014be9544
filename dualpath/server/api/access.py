"""Who may ask what of the HTTP API: the server's API keys (and which one a request presents),
the modes a request may choose, and the cache salt it gets.
"""

from __future__ import annotations

import hashlib
import hmac

from fastapi import Request

from dualpath.config_file import ServeConfig
from dualpath.server.api.schema import APIError
from dualpath.vocab import Mode


class Keys:
    """The server's API keys (none: an open server) and which one a request presents."""

    def __init__(self, settings: ServeConfig) -> None:
        keys = (settings.api_key, *settings.api_keys) if settings.api_key else settings.api_keys
        self.keys = tuple(k.encode() for k in keys)

    @property
    def open(self) -> bool:
        """True when the server has no key."""
        return not self.keys

    def match(self, request: Request) -> bytes | None:
        """The key in ``Authorization: Bearer KEY``, if it is one of the server's; compared in
        constant time against every key (a timing difference tells no prefix)."""
        auth = request.headers.get("authorization", "")
        token = auth.removeprefix("Bearer ").encode("latin-1") if auth.startswith(
            "Bearer ") else b""  # headers arrive as latin-1: these are the bytes sent
        found = None
        for key in self.keys:
            if hmac.compare_digest(token, key):
                found = key
        return found


class Policy:
    """What a request may ask of the cluster: a mode the operator allows, a salt of its own."""

    def __init__(self, settings: ServeConfig, cluster_mode: str) -> None:
        self.modes = settings.allowed_modes or tuple(dict.fromkeys((Mode.DUALPATH,
                                                                    Mode(cluster_mode))))
        self.salt_by_key = settings.salt_by_api_key
        self.default_max_tokens = settings.default_max_tokens

    def mode(self, mode: Mode | None) -> str | None:
        """``mode`` if the server allows it (None: the cluster's own); else a 400."""
        if mode is not None and mode not in self.modes:
            raise APIError(400, f"the mode {str(mode)!r} is not allowed on this server; "
                           f"allowed: {', '.join(self.modes)}", param="dualpath.mode",
                           code="mode_not_allowed")
        return mode and str(mode)

    def salt(self, cache_salt: str | None, key: bytes | None) -> str:
        """The request's cache salt: the client's, behind one derived from its API key when
        ``salt_by_api_key`` (an HMAC: the key itself never reaches the engines or the store)."""
        if not (self.salt_by_key and key):
            return cache_salt or ""
        tenant = hmac.new(key, b"dualpath cache salt", hashlib.sha256).hexdigest()[:32]
        return f"{tenant}:{cache_salt or ''}"
