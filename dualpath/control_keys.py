"""The control plane's keys: ZeroMQ CURVE key pairs for the router and for each engine.

Every router↔engine connection is authenticated and encrypted with CURVE (libzmq's own): the
router holds a server key pair and knows each engine's public key under the engine's name; an
engine holds its own key pair and the router's public key. A peer whose key the router does not
know — or that presents one engine's key under another engine's name — is refused during the
handshake, before any of its frames is read (``control_socket.ZapHandler``).

Where keys come from:

- a local or Ray cluster: the launcher makes them for the engines it starts
  (``ClusterKeys.generate``) and hands each engine its own in the environment variable
  ``DUALPATH_ENGINE_KEY`` (never on a command line, which other users can read);
- engines on other hosts: ``dualpath keys DIR --engines pe0,de1,...`` writes ``DIR/router.json``
  (the router's pair, for ``control_keys = "DIR"``) and ``DIR/engines/NAME.json`` (one engine's
  pair and the router's public key: copy it to that engine's host only, pass ``--key FILE``).
  Files are written owner-only (0600, folders 0700).
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import zmq
from zmq.utils import z85

from dualpath.errors import DualPathError
from dualpath.protocol import check_engine

ENGINE_KEY_ENV = "DUALPATH_ENGINE_KEY"  # an engine's key (EngineKey JSON) from its launcher
Z85_KEY_CHARS = 40


class ControlKeyError(DualPathError):
    """A key file or key text is missing, malformed or for another engine."""


@dataclass(frozen=True)
class KeyPair:
    """A CURVE key pair, Z85 text (40 characters each)."""

    public: str
    secret: str

    def __post_init__(self) -> None:
        _z85(self.public)
        _z85(self.secret)

    @staticmethod
    def new() -> KeyPair:
        """A fresh key pair."""
        public, secret = zmq.curve_keypair()
        return KeyPair(public.decode(), secret.decode())


@dataclass(frozen=True)
class EngineKey:
    """What one engine needs to reach its router: its name, its pair, the router's public key."""

    name: str
    keys: KeyPair
    router_public: str

    def to_json(self) -> str:
        """The key as JSON text (what a key file and ``DUALPATH_ENGINE_KEY`` hold)."""
        return json.dumps({"name": self.name, "public": self.keys.public,
                           "secret": self.keys.secret, "router_public": self.router_public})

    @staticmethod
    def from_json(text: str) -> EngineKey:
        """Parse ``to_json``'s text; ``ControlKeyError`` naming what is wrong."""
        try:
            data = json.loads(text)
            check_engine(data["name"])
            return EngineKey(data["name"], KeyPair(data["public"], data["secret"]),
                             _z85(data["router_public"]))
        except (ValueError, KeyError, TypeError) as exc:
            raise ControlKeyError(f"not an engine key: {exc}") from exc


@dataclass(frozen=True)
class ClusterKeys:
    """The router's key pair and the pair of every engine allowed to join."""

    router: KeyPair
    engines: dict[str, KeyPair]

    @staticmethod
    def generate(names: Iterable[str]) -> ClusterKeys:
        """Fresh keys for a router and the engines named."""
        return ClusterKeys(KeyPair.new(), {name: KeyPair.new() for name in names})

    def engine_key(self, name: str) -> EngineKey:
        """Engine ``name``'s key (``ControlKeyError`` for an engine this cluster does not know)."""
        if name not in self.engines:
            raise ControlKeyError(f"no key for engine {name!r}; keys exist for "
                            f"{', '.join(sorted(self.engines)) or 'no engine'}")
        return EngineKey(name, self.engines[name], self.router.public)

    def allowed(self) -> dict[bytes, str]:
        """Engine name by public key (raw 32 bytes, as the ZAP handshake presents it)."""
        return {z85.decode(pair.public): name for name, pair in self.engines.items()}

    def write(self, folder: str | Path) -> Path:
        """Write ``router.json`` and ``engines/NAME.json`` under ``folder`` (owner-only)."""
        root = Path(folder)
        (root / "engines").mkdir(parents=True, exist_ok=True, mode=0o700)
        os.chmod(root, 0o700)
        _write_private(root / "router.json", json.dumps(
            {"public": self.router.public, "secret": self.router.secret}))
        for name in self.engines:
            _write_private(root / "engines" / f"{name}.json", self.engine_key(name).to_json())
        return root

    @staticmethod
    def load(folder: str | Path) -> ClusterKeys:
        """Read what ``write`` wrote; ``ControlKeyError`` naming a missing or malformed file."""
        root = Path(folder)
        try:
            data = json.loads((root / "router.json").read_text())
            router = KeyPair(data["public"], data["secret"])
            engines = {}
            for path in sorted((root / "engines").glob("*.json")):
                key = EngineKey.from_json(path.read_text())
                engines[key.name] = key.keys
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise ControlKeyError(f"cannot read the control keys in {root}: {exc} (make them with "
                            "`dualpath keys DIR --engines NAMES`)") from exc
        return ClusterKeys(router, engines)


def engine_key_from(path: str | None, name: str | None) -> EngineKey:
    """An engine's key: the file ``path``, else ``DUALPATH_ENGINE_KEY``; it must be ``name``'s
    (when given). ``ControlKeyError`` says where to get one."""
    if path:
        try:
            key = EngineKey.from_json(Path(path).read_text())
        except OSError as exc:
            raise ControlKeyError(f"cannot read the engine key {path}: {exc}") from exc
    elif os.environ.get(ENGINE_KEY_ENV):
        key = EngineKey.from_json(os.environ[ENGINE_KEY_ENV])
    else:
        raise ControlKeyError("no engine key: pass --key FILE (made by `dualpath keys`, or written "
                        f"by `dualpath serve --launcher none`), or set {ENGINE_KEY_ENV}")
    if name is not None and key.name != name:
        raise ControlKeyError(f"the key is for engine {key.name!r}, not {name!r}")
    return key


def _z85(key: object) -> str:
    """``key`` if it is a CURVE key in Z85 text, else ``ControlKeyError``."""
    if not isinstance(key, str) or len(key) != Z85_KEY_CHARS:
        raise ControlKeyError(f"a CURVE key is {Z85_KEY_CHARS} Z85 characters")
    try:
        z85.decode(key)
    except (ValueError, KeyError) as exc:
        raise ControlKeyError(f"not a Z85 key: {exc}") from exc
    return key


def _write_private(path: Path, text: str) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.chmod(path, 0o600)
