"""Configurations ``MODE[+suffix...]``: a KV reuse mode and options that buy quality back.

Each suffix is one row of ``SUFFIXES``: a pattern and what it sets, either options of the index
the chunks are encoded into (a distinct set of index options gets its own cached index) or
a part of the engine's ``Recovery`` (its short names: ``epic16``, ``prophet20``, ``cacheblend15``,
``ape0.8s1.2``; joined with ``+`` into one request option). A list of configurations is
comma-separated; a comma followed by a digit belongs to a suffix's parameters.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Callable

from ..errors import LazyRagError
from ..engine.recovery import METHODS, Recovery
from .runner import MODES, REUSE_MODES


@dataclass(frozen=True)
class Suffix:
    pattern: str                                   # full match; groups are the parameters
    help: str
    index: Callable[[re.Match], dict] = field(default=lambda m: {})
    recovery: str | None = None                    # the Recovery field it sets: the suffix is a recovery part


SUFFIXES: dict[str, Suffix] = {
    "sink": Suffix(r"sink", "chunks encoded after the prompt's fixed head (shared prefix, an attention sink)",
                   index=lambda m: {"shared_prefix": True}),
    "wrapper": Suffix(r"wrapper(?::.+)?", "chunks encoded inside a chunk wrapper: the model's bundled one, or "
                      "+wrapper:NAME_OR_PATH (a file from `lazy-rag tune`)",
                      index=lambda m: {"wrapper": m.group(0).partition(":")[2] or "auto"}),
    "fp8": Suffix(r"fp8", "chunk KV stored in fp8 (e4m3, one scale per token and KV head; `lazy-rag index "
                  "--kv-dtype fp8`)", index=lambda m: {"kv_dtype": "fp8"}),
    "int4": Suffix(r"int4", "chunk KV stored in int4 (grouped asymmetric, keys per channel, values per token; "
                   "`lazy-rag index --kv-dtype int4`)", index=lambda m: {"kv_dtype": "int4"}),
    # the engine's recovery methods, each a part of its Recovery (engine.recovery.METHODS)
    **{name: Suffix(m.pattern, m.help, recovery=m.part) for name, m in METHODS.items()},
}


@dataclass(frozen=True)
class Config:
    name: str
    mode: str
    index_items: tuple[tuple[str, Any], ...] = ()
    recovery: str = ""                             # the engine's Recovery short name ("" for none)

    @property
    def index_options(self) -> dict:
        return dict(self.index_items)

    @property
    def generate_options(self) -> dict:
        return {"recovery": self.recovery} if self.recovery else {}

    @classmethod
    def parse(cls, name: str) -> "Config":
        mode, *extras = name.strip().split("+")
        if mode not in MODES:
            raise LazyRagError(f"Unknown mode {mode!r} in {name!r}; modes: {', '.join(MODES)}.")
        index: dict = {}
        recovery: dict[str, str] = {}   # Recovery field -> the part that sets it
        for extra in extras:
            row = next((r for r in SUFFIXES.values() if re.fullmatch(r.pattern, extra)), None)
            if row is None:
                raise LazyRagError(f"Unknown option +{extra} in {name!r}; options: "
                                   + "; ".join(f"+{r.pattern}: {r.help}" for r in SUFFIXES.values()) + ".")
            if mode not in REUSE_MODES:
                raise LazyRagError(f"{name!r}: +{extra} changes how cached chunks are used; it applies to the "
                                   f"chunk reuse modes ({', '.join(REUSE_MODES)}) only.")
            new = row.index(re.fullmatch(row.pattern, extra))
            twice = set(index) & set(new) | ({row.recovery} & set(recovery))
            if twice:
                raise LazyRagError(f"{name!r} sets {', '.join(sorted(twice))} twice; keep one of them.")
            index.update(new)
            if row.recovery:
                recovery[row.recovery] = extra
        spec = "+".join(recovery.values())
        Recovery.parse(spec)  # the engine's own check of the values (a ratio over 100%, ...)
        return cls(name.strip(), mode, tuple(sorted(index.items())), spec)


def split_config_list(text: str) -> list[str]:
    """Names from a comma-separated list; a comma before a digit continues a suffix's parameters."""
    return [c.strip() for c in re.split(r",(?=\s*[A-Za-z])", text) if c.strip()]


def parse_configs(names) -> list[Config]:
    """Parsed configurations, ``full`` first (the reference every other one is paired with)."""
    configs = [Config.parse(n) for n in (split_config_list(names) if isinstance(names, str) else names)]
    seen = [c.name for c in configs]
    dup = {n for n in seen if seen.count(n) > 1}
    if dup:
        raise LazyRagError(f"Configuration(s) {', '.join(sorted(dup))} listed twice.")
    full = [c for c in configs if c.name == "full"] or [Config.parse("full")]
    return full + [c for c in configs if c.name != "full"]
