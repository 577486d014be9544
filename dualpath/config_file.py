"""The configuration file of ``dualpath serve``: TOML plus ``a.b=c`` overrides.

Top-level keys are :class:`ClusterConfig`'s (``mode``, ``num_decode``, ``host_pool_blocks``, …)
with ``[engine]``, ``[storage]`` and ``[traffic]`` tables; ``[serve]`` holds the HTTP server's
:class:`ServeConfig`. Every key is checked against the dataclasses: an unknown key or a value of
the wrong type is a :class:`ConfigError` naming it (``storage.read_cap_mb_s``). An override's
value is read as a TOML value (``200``, ``true``, ``"de"``, ``[["high", 99]]``), else as a string.
"""

from __future__ import annotations

import json
import os
import re
import stat
import sys
import tomllib
import types
import typing
from dataclasses import asdict, dataclass, field, fields, is_dataclass, replace
from enum import StrEnum
from pathlib import Path
from typing import Any

from dualpath.config import ClusterConfig
from dualpath.errors import DualPathError
from dualpath.vocab import Launcher, Mode


class ConfigError(DualPathError):
    """A configuration file or override is malformed, names an unknown key or a bad value."""


@dataclass(frozen=True)
class ServeConfig:
    """The OpenAI-compatible HTTP server in front of the cluster."""

    host: str = "127.0.0.1"
    port: int = 8000
    model: str | None = None  # a HF folder; None: the default model (SmolLM2-135M-Instruct)
    model_name: str | None = None  # the name clients use; None: the model folder's name
    # When set, every /v1 call, /metrics and the docs need "Authorization: Bearer KEY". Keys
    # can come from a file instead (api_key_file: one key a line, the first is api_key, the
    # others join api_keys) or from $DUALPATH_API_KEY (``with_api_keys``); config.json
    # written beside the logs shows every key as "<redacted>".
    api_key: str | None = None
    api_key_file: str | None = None
    max_body_bytes: int = 1 << 20  # larger request bodies get 413
    max_concurrent_requests: int = 256  # more generations at once get 429
    default_max_tokens: int = 256  # when a request names none (and the context allows)
    api_keys: tuple[str, ...] = ()  # more accepted keys beside api_key (e.g. one per tenant)
    # With a key: each request's cache salt is derived from the key it presented (and any
    # cache_salt it sends), so clients of different keys never hit each other's prefixes.
    salt_by_api_key: bool = False
    # The modes a request may name ("dualpath": {"mode": ...}); None: "dualpath" and the
    # cluster's own mode. "oracle" answers from KV it never computed (a benchmark mode) and
    # "recompute" ignores the cache: a client could get garbage or multiply the cost.
    allowed_modes: tuple[str, ...] | None = None
    # A request still running this long is aborted on the engines and answered 504 (a stream:
    # an error event), so a hung engine cannot hold concurrency slots for ever.
    request_timeout_s: float = 600.0
    # Who places the engines: "local" (child processes), "ray" (Ray actors on the nodes whose
    # custom resources name them) or "none" (engines join with `dualpath engine --router`).
    launcher: Launcher = Launcher.LOCAL
    ray_address: str | None = None  # an existing Ray cluster ("auto", "ray://..."); None: local
    # The run folders (logs, resolved config) kept under <cache>/serve: older ones go at start,
    # except one whose serve process still runs.
    keep_runs: int = 10
    # The fs store's capacity when storage.capacity_gb is unset: this fraction of what the
    # store's file system has free at start plus what the store already holds (0: uncapped).
    store_capacity_fraction: float = 0.5

    def __post_init__(self) -> None:
        if self.api_key == "" or any(not isinstance(k, str) or not k for k in self.api_keys):
            raise ValueError("serve.api_key and serve.api_keys must be non-empty strings")
        if self.api_key is not None and self.api_key_file:
            raise ValueError("give serve.api_key or serve.api_key_file, not both")
        if self.allowed_modes is not None:
            modes = [str(m) for m in Mode]
            if not self.allowed_modes or not set(self.allowed_modes) <= set(modes):
                raise ValueError(f"serve.allowed_modes takes some of {', '.join(modes)}, got "
                                 f"{list(self.allowed_modes)}")
        if not self.request_timeout_s > 0:
            raise ValueError(f"serve.request_timeout_s must be > 0, got "
                             f"{self.request_timeout_s}")
        if self.launcher not in tuple(Launcher):
            raise ValueError(f"serve.launcher must be local, ray or none, got {self.launcher!r}")
        object.__setattr__(self, "launcher", Launcher(self.launcher))
        if not 0 <= self.port < 65536:
            raise ValueError(f"serve.port must be in 0..65535, got {self.port}")
        if min(self.max_body_bytes, self.max_concurrent_requests, self.default_max_tokens) < 1:
            raise ValueError("serve limits must be >= 1")
        if self.keep_runs < 1:
            raise ValueError(f"serve.keep_runs must be >= 1, got {self.keep_runs}")
        if not 0 <= self.store_capacity_fraction < 1:
            raise ValueError("serve.store_capacity_fraction must be in [0, 1), got "
                             f"{self.store_capacity_fraction}")


@dataclass(frozen=True)
class AppConfig:
    """Everything ``dualpath serve`` runs: the cluster and the server."""

    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    serve: ServeConfig = field(default_factory=ServeConfig)


def load_config(path: str | Path | None = None, overrides: list[str] | None = None,
                base: dict[str, Any] | None = None) -> AppConfig:
    """The file's settings (defaults where absent), then ``base``, then each ``key=value``."""
    data: dict[str, Any] = {}
    if path is not None:
        try:
            data = tomllib.loads(Path(path).read_text())
        except (OSError, tomllib.TOMLDecodeError) as exc:
            raise ConfigError(f"cannot read config file {path}: {exc}") from exc
    for key, value in (base or {}).items():
        _assign(data, key, value)
    _apply_overrides(data, overrides or [])
    serve = data.pop("serve", {})
    if not isinstance(serve, dict):
        raise ConfigError("[serve] must be a table")
    return AppConfig(_build(ClusterConfig, data, ""), _build(ServeConfig, serve, "serve."))


def override_cluster_config(config: ClusterConfig, overrides: list[str]) -> ClusterConfig:
    """``config`` with each ``key=value`` applied (an engine's host-local settings)."""
    if not overrides:
        return config
    data = asdict(config)
    _apply_overrides(data, overrides)
    return _build(ClusterConfig, data, "")


def _apply_overrides(data: dict[str, Any], overrides: list[str]) -> None:
    for item in overrides:
        key, sep, raw = item.partition("=")
        if not sep or not key.strip():
            raise ConfigError(f"an override is key=value, got {item!r}")
        _assign(data, key.strip(), _toml_value(raw.strip()))


def config_to_json(config: AppConfig) -> str:
    """The resolved configuration, as written beside the server's logs: every secret
    (``redacted``) shown as ``"<redacted>"``."""
    return json.dumps(redacted(asdict(config)), indent=2)


REDACTED = "<redacted>"
# A setting holds a secret when its name says so: api_key(s), *secret*, *password*, *token
# (singular: "max_tokens" counts tokens), *_key(s) that are credentials (not "key_prefix").
SECRET_NAME = re.compile(r"(^|_)(api_keys?|secrets?|passwords?|passphrase|token|"
                         r"credentials?|private_keys?|access_keys?|auth_keys?)$|secret|password")
# In a list of command-line arguments (vllm.extra_args): the value after such a flag.
SECRET_FLAG = re.compile(r"--[\w-]*(key|secret|password|token)[\w-]*", re.IGNORECASE)


def redacted(value: Any, name: str = "") -> Any:
    """``value`` (``asdict`` output) with every string under a secret's name (``SECRET_NAME``)
    replaced by ``REDACTED``, and in argument lists the value of a secret flag
    (``--api-key K`` or ``--api-key=K``). Other values (``salt_by_api_key = true``, a null
    key) stay as they are."""
    if isinstance(value, dict):
        return {key: redacted(item, key) for key, item in value.items()}
    secret = bool(SECRET_NAME.search(name))
    if isinstance(value, list | tuple):
        if secret:
            return [REDACTED if isinstance(item, str) else item for item in value]
        return _redacted_args(list(value))
    return REDACTED if secret and isinstance(value, str) else value


def _redacted_args(items: list[Any]) -> list[Any]:
    """An argument list with the values of secret flags redacted."""
    out: list[Any] = []
    for i, item in enumerate(items):
        if not isinstance(item, str):
            out.append(redacted(item))
        elif i > 0 and isinstance(items[i - 1], str) and SECRET_FLAG.fullmatch(items[i - 1]):
            out.append(REDACTED)
        elif "=" in item and SECRET_FLAG.fullmatch(item.partition("=")[0]):
            out.append(f"{item.partition('=')[0]}={REDACTED}")
        else:
            out.append(item)
    return out


API_KEY_ENV = "DUALPATH_API_KEY"


def read_api_key_file(path: str | Path) -> tuple[str, ...]:
    """The keys in ``path``, one a line (blank lines and surrounding spaces dropped);
    ``ConfigError`` when it cannot be read or holds none. A file others may read is used, with
    a warning on stderr (a mounted secret may be 0644), naming the fix."""
    try:
        text = Path(path).read_text()
        mode = os.stat(path).st_mode
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"cannot read the API key file {path}: {exc}") from exc
    keys = tuple(line.strip() for line in text.splitlines() if line.strip())
    if not keys:
        raise ConfigError(f"the API key file {path} holds no key")
    if mode & 0o077:
        print(f"dualpath: warning: the API key file {path} is open to other users "
              f"(mode {stat.filemode(mode)}): chmod 600 {path}", file=sys.stderr, flush=True)
    return keys


def with_api_keys(config: ServeConfig,
                  environ: typing.Mapping[str, str] | None = None) -> ServeConfig:
    """``config`` with its keys resolved: those of ``api_key_file`` (the first becomes
    ``api_key``, the others join ``api_keys``; ``api_key_file`` is then cleared), else
    ``$DUALPATH_API_KEY`` when no key is set at all. Idempotent."""
    environ = os.environ if environ is None else environ
    if config.api_key_file:
        first, *more = read_api_key_file(config.api_key_file)
        return replace(config, api_key=first, api_keys=(*more, *config.api_keys),
                       api_key_file=None)
    if config.api_key is None and environ.get(API_KEY_ENV):
        return replace(config, api_key=environ[API_KEY_ENV].strip())
    return config


def _assign(data: dict[str, Any], dotted: str, value: Any) -> None:
    node = data
    *parents, leaf = dotted.split(".")
    for part in parents:
        node = node.setdefault(part, {})
        if not isinstance(node, dict):
            raise ConfigError(f"{dotted}: {part!r} is not a table")
    node[leaf] = value


def _toml_value(raw: str) -> Any:
    try:
        return tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        return raw  # a bare word: a string


def _build(cls: type, data: dict[str, Any], where: str) -> Any:
    hints = typing.get_type_hints(cls)
    known = {f.name for f in fields(cls)}
    unknown = sorted(set(data) - known)
    if unknown:
        raise ConfigError(f"unknown config key {where}{unknown[0]!r} "
                          f"(known: {', '.join(sorted(known))})")
    kwargs = {}
    for name, value in data.items():
        hint = hints[name]
        if is_dataclass(hint):
            if not isinstance(value, dict):
                raise ConfigError(f"{where}{name} must be a table")
            kwargs[name] = _build(hint, value, f"{where}{name}.")
        else:
            kwargs[name] = _checked(_tuples(value), hint, f"{where}{name}")
    try:
        return cls(**kwargs)
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"{where or 'config'}: {exc}") from exc


def _tuples(value: Any) -> Any:
    return tuple(_tuples(v) for v in value) if isinstance(value, list) else value


def _checked(value: Any, hint: Any, key: str) -> Any:
    """``value`` if it fits ``hint`` (ints are accepted for floats), else ConfigError."""
    if _fits(value, hint):
        if _is_str_enum(hint):
            return hint(value)
        return float(value) if hint is float and isinstance(value, int) else value
    raise ConfigError(f"{key} must be {_name(hint)}, got {value!r}")


def _fits(value: Any, hint: Any) -> bool:
    origin = typing.get_origin(hint)
    if origin in (types.UnionType, typing.Union):
        return any(_fits(value, h) for h in typing.get_args(hint))
    if hint is type(None):
        return value is None
    if hint is float:
        return isinstance(value, int | float) and not isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if origin is tuple:
        return isinstance(value, tuple)
    if _is_str_enum(hint):
        return isinstance(value, str) and value in tuple(hint)
    return isinstance(value, hint)


def _is_str_enum(hint: Any) -> bool:
    return isinstance(hint, type) and issubclass(hint, StrEnum)


def _name(hint: Any) -> str:
    if _is_str_enum(hint):
        return "one of " + ", ".join(hint)
    return getattr(hint, "__name__", None) or str(hint).replace("NoneType", "None")
