"""Tenants: who a request comes from, by its API key. Each tenant has its own cache salt (the
documents it sends are cached where only its own requests find them, so no tenant can see, or
time, another's) and its own limits (``TenantLimits``; unset ones take the server's defaults).

Keys come from a JSON file (`lazy-rag serve --api-keys FILE`)::

    {"tenants": {
        "team-a": {"keys": ["sk-team-a-1"], "max_in_flight": 8, "tokens_per_minute": 200000},
        "team-b": {"keys": ["sk-team-b-1", "sk-team-b-2"], "max_document_bytes": 1000000}}}

or from the environment (``LAZY_RAG_API_KEYS="team-a=sk-team-a-1,team-b=sk-team-b-1"``), or a
single key (``--api-key``: one tenant, "default"). A server without keys has one anonymous tenant
whose clients cannot be told apart, so they share one cache.
"""
from __future__ import annotations

import hashlib
import hmac
import json
import re
from dataclasses import dataclass, field, fields
from pathlib import Path

from ..errors import LazyRagError

KEYS_ENV = "LAZY_RAG_API_KEYS"
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")


@dataclass(frozen=True)
class TenantLimits:
    """A tenant's own limits; None takes the server's default (``ServerSettings.tenant_*``).
    ``max_in_flight``: its requests admitted and not finished (more: 429). ``tokens_per_minute``:
    prompt plus completion tokens, a bucket refilled continuously (a request reserves its prompt
    and ``max_tokens`` and gets back what it did not generate; empty: 429 with the seconds until
    it refills). ``max_document_bytes``: the UTF-8 bytes of one request's ``documents`` (more: 413)."""

    max_in_flight: int | None = None
    tokens_per_minute: int | None = None
    max_document_bytes: int | None = None

    def __post_init__(self):
        for f in fields(self):
            v = getattr(self, f.name)
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
                raise LazyRagError(f"The tenant limit {f.name} must be a positive integer, got {v!r}.")

    def over(self, defaults: "TenantLimits") -> "TenantLimits":
        """These limits, each unset one taken from ``defaults``."""
        return TenantLimits(**{f.name: getattr(defaults, f.name) if getattr(self, f.name) is None
                               else getattr(self, f.name) for f in fields(self)})


@dataclass(frozen=True)
class Tenant:
    name: str
    limits: TenantLimits = field(default_factory=TenantLimits)
    isolated: bool = True  # False: the anonymous tenant of a server without keys (one shared cache)

    @property
    def cache_salt(self) -> str:
        """The salt of this tenant's documents in the engine's cache keys. It needs no secret:
        the server sets it from the authenticated key, a client never chooses it."""
        if not self.isolated:
            return ""
        return hashlib.sha256(b"lazy-rag tenant cache\0" + self.name.encode()).hexdigest()[:32]


ANONYMOUS = Tenant("anonymous", isolated=False)


class Tenants:
    """API key -> tenant. ``required``: every /v1 request must carry a known key."""

    def __init__(self, by_key: dict[str, Tenant]):
        self._by_key = dict(by_key)
        self.tenants = {t.name: t for t in by_key.values()}

    @property
    def required(self) -> bool:
        return bool(self._by_key)

    def __len__(self) -> int:
        return len(self.tenants)

    def find(self, key: str) -> Tenant | None:
        """The tenant of ``key``, compared in constant time against every key (the time taken
        says nothing about how much of a key was right, nor which tenant's it nearly was)."""
        found = None
        given = key.encode()
        for k, tenant in self._by_key.items():
            if hmac.compare_digest(given, k.encode()):
                found = tenant
        return found

    # -- where keys come from -------------------------------------------------------------------
    @classmethod
    def open(cls) -> "Tenants":
        """No keys: every request is the anonymous tenant's."""
        return cls({})

    @classmethod
    def single(cls, key: str) -> "Tenants":
        _check_key(key, "--api-key")
        return cls({key: Tenant("default")})

    @classmethod
    def from_file(cls, path: str | Path) -> "Tenants":
        p = Path(path).expanduser()
        try:
            data = json.loads(p.read_text(encoding="utf-8"))
        except OSError as e:
            raise LazyRagError(f"Cannot read the API keys file {p}: {e.strerror or e}.") from None
        except (UnicodeDecodeError, ValueError) as e:
            raise LazyRagError(f"The API keys file {p} is not UTF-8 JSON ({e}); it holds "
                               '{"tenants": {"NAME": {"keys": ["KEY", ...]}, ...}}.') from None
        tenants = data.get("tenants") if isinstance(data, dict) else None
        if not isinstance(tenants, dict) or not tenants:
            raise LazyRagError(f'The API keys file {p} must hold {{"tenants": {{"NAME": {{"keys": ["KEY", ...]}}, '
                               '...}}} with at least one tenant.')
        by_key: dict[str, Tenant] = {}
        allowed = {"keys"} | {f.name for f in fields(TenantLimits)}
        for name, spec in tenants.items():
            where = f"{p}, tenant {name!r}"
            _check_name(name, where)
            if not isinstance(spec, dict) or not isinstance(spec.get("keys"), list) or not spec["keys"]:
                raise LazyRagError(f'{where}: give its keys as {{"keys": ["KEY", ...]}}.')
            unknown = set(spec) - allowed
            if unknown:
                raise LazyRagError(f"{where}: unknown field(s) {', '.join(sorted(unknown))}; a tenant has "
                                   f"{', '.join(sorted(allowed))}.")
            try:
                limits = TenantLimits(**{k: v for k, v in spec.items() if k != "keys"})
            except LazyRagError as e:
                raise LazyRagError(f"{where}: {e}") from None
            tenant = Tenant(name, limits)
            for key in spec["keys"]:
                _add_key(by_key, key, tenant, where)
        return cls(by_key)

    @classmethod
    def from_env(cls, value: str) -> "Tenants":
        """``NAME=KEY`` pairs separated by commas or white space (a name given twice has two keys)."""
        by_key: dict[str, Tenant] = {}
        made: dict[str, Tenant] = {}
        for pair in re.split(r"[,\s]+", value.strip()):
            if not pair:
                continue
            name, eq, key = pair.partition("=")
            if not eq:
                raise LazyRagError(f"{KEYS_ENV} holds NAME=KEY pairs separated by commas; {pair[:12]!r}... has no '='.")
            _check_name(name, KEYS_ENV)
            _add_key(by_key, key, made.setdefault(name, Tenant(name)), KEYS_ENV)
        if not by_key:
            raise LazyRagError(f"{KEYS_ENV} is set but holds no NAME=KEY pair.")
        return cls(by_key)

    @classmethod
    def configured(cls, keys_file: str | Path | None = None, api_key: str | None = None,
                   environ: dict | None = None) -> "Tenants":
        """What `lazy-rag serve` uses: ``--api-keys FILE``, else ``$LAZY_RAG_API_KEYS``, else
        ``--api-key`` (one tenant), else no keys."""
        if keys_file is not None and api_key:
            raise LazyRagError("Give either --api-key (one key) or --api-keys FILE (tenants), not both.")
        if keys_file is not None:
            return cls.from_file(keys_file)
        env = (environ or {}).get(KEYS_ENV, "")
        if env.strip():
            if api_key:
                raise LazyRagError(f"Both {KEYS_ENV} and --api-key (or LAZY_RAG_API_KEY) are set; keep one.")
            return cls.from_env(env)
        return cls.single(api_key) if api_key else cls.open()


def _check_name(name, where: str) -> None:
    if not isinstance(name, str) or not _NAME.match(name):
        raise LazyRagError(f"{where}: a tenant name is 1-64 letters, digits, '.', '_' or '-' (it labels metrics "
                           f"and logs), got {name!r}.")


def _check_key(key, where: str) -> None:
    if not isinstance(key, str) or not key or any(c.isspace() for c in key):
        raise LazyRagError(f"{where}: an API key is a non-empty string without white space.")


def _add_key(by_key: dict, key, tenant: Tenant, where: str) -> None:
    _check_key(key, where)
    if key in by_key:
        raise LazyRagError(f"{where}: a key is given twice (to {by_key[key].name!r} and {tenant.name!r}); every key "
                           "names one tenant.")
    by_key[key] = tenant
