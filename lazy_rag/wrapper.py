"""Chunk wrappers: a few trained soft input vectors encoded with every chunk (KV Packet, 2026).

A wrapper is H header and T trailer vectors of the model's hidden size. Each chunk is encoded
alone as ``[header][chunk tokens][trailer]``, so the wrapper's effect lives in the chunk's stored
KV and nothing is recomputed at query time; the model itself stays frozen. The vectors are
trained by self-distillation (``lazy_rag.tune``).

Inside a prompt layout the wrapper's slots are *virtual token ids*: ids at and above the
model's embedding rows, which ``ModelParts.embed_ids`` looks up in the host's table of
registered wrappers (``WrapperTable``) instead of the embedding matrix. Everything that handles
token ids (positions, chunk keys, recompute, the oracle) therefore handles wrapped chunks
unchanged. The virtual ids of one wrapper are fixed for the life of a host, not across
processes: stored KV is tied to a wrapper by its digest (in the index's fingerprint), never by
these ids.

A wrapper may carry a chunk adapter (chunk_adapter.py, ``lazy-rag tune --method lora``): LoRA
deltas applied only while its chunks are encoded. Its bytes are in the wrapper's digest.

The file: safetensors with one tensor ``vectors`` [H + T, hidden] (fp32), the adapter's factors
(``adapter.<module>.A`` / ``.B``, bf16) if it has one, and metadata (format, H, T, the model
fingerprint it was trained for, the training recipe as JSON, the adapter's rank, alpha and
targets as JSON).
"""
from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass, field
from pathlib import Path

import torch

from .chunk_adapter import ChunkAdapter, ChunkAdapters
from .errors import LazyRagError
from .tempfiles import atomic_write_bytes

FORMAT = "lazy-rag-wrapper/1"
BUNDLED_DIR = Path(__file__).parent / "wrappers"
NONE_NAMES = ("none", "off", "")


class WrapperError(LazyRagError):
    """A wrapper file is missing, damaged, or was trained for another model."""


@dataclass
class ChunkWrapper:
    vectors: torch.Tensor            # [header + trailer, hidden] fp32
    header: int
    trailer: int
    model_fingerprint: str = ""      # the fingerprint id(s) of the model it was trained for (matches())
    recipe: dict = field(default_factory=dict)
    name: str = ""                   # a bundled name or the file it came from
    adapter: ChunkAdapter | None = None  # LoRA deltas applied while its chunks are encoded

    def __post_init__(self):
        if self.header < 0 or self.trailer < 0 or self.header + self.trailer == 0:
            raise WrapperError(f"A wrapper needs header + trailer > 0 slots (got {self.header} + {self.trailer}).")
        if self.vectors.dim() != 2 or self.vectors.shape[0] != self.header + self.trailer:
            raise WrapperError(f"Wrapper vectors must be [header + trailer, hidden] = [{self.header + self.trailer}, "
                               f"hidden], got {list(self.vectors.shape)}.")

    @property
    def slots(self) -> int:
        return self.header + self.trailer

    @property
    def hidden_size(self) -> int:
        return int(self.vectors.shape[1])

    @property
    def digest(self) -> str:
        """What stored KV depends on: the vectors' bytes and the split into header and trailer
        (and the adapter's). Every request's cache keys read it, and hashing an adapter (MBs,
        from the GPU) took ~20 ms: it is kept until a tensor changes (a trainer's in-place step
        bumps its version; a new tensor has a new id)."""
        tensors = [self.vectors] + ([t for _, t in sorted(self.adapter.tensors().items())] if self.adapter else [])
        if any(t.is_inference() for t in tensors):   # no version counter: nothing tells a change
            return self._compute_digest()
        state = (self.header, self.trailer, self.adapter.describe() if self.adapter else None,
                 [t._version for t in tensors])
        kept = getattr(self, "_digest", None)
        # (the state's versions are one per tensor: equal states have as many tensors)
        if kept is None or kept[0] != state or any(a is not b for a, b in zip(kept[1], tensors)):
            kept = self._digest = (state, tensors, self._compute_digest())
        return kept[2]

    def _compute_digest(self) -> str:
        h = hashlib.sha256(f"{self.header}|{self.trailer}|".encode())
        h.update(self.vectors.detach().to("cpu", torch.float32).contiguous().numpy().tobytes())
        if self.adapter is not None:
            h.update(json.dumps(self.adapter.describe(), sort_keys=True).encode())
            for key, t in self.adapter.tensors().items():
                h.update(key.encode())
                h.update(t.detach().to("cpu", torch.bfloat16).contiguous().view(torch.int16).numpy().tobytes())
        return h.hexdigest()[:16]

    def describe(self) -> dict:
        """What an index manifest records about its wrapper."""
        return {"name": self.name, "digest": self.digest, "header": self.header, "trailer": self.trailer,
                "model_fingerprint": self.model_fingerprint,
                "adapter": self.adapter.describe() if self.adapter is not None else None}

    def matches(self, fingerprint_id: str) -> bool:
        """Trained for the model with this fingerprint id. ``model_fingerprint`` may list several,
        comma-separated: the same checkpoint file loaded by different library versions (a bundled
        wrapper trained on the GPU machine and served on a CPU), "" for any model."""
        return not self.model_fingerprint or fingerprint_id in self.model_fingerprint.split(",")

    def check_model(self, fingerprint: dict, model_name: str | None = None) -> None:
        """A WrapperError unless the wrapper was trained for this model (same fingerprint id)."""
        want = fingerprint["id"]
        if not self.matches(want):
            raise WrapperError(
                f"The chunk wrapper {self.name or '(unnamed)'} (digest {self.digest}) was trained for the model with "
                f"fingerprint {self.model_fingerprint}, but the model loaded{f' ({model_name})' if model_name else ''} "
                f"has fingerprint {want}. Use --wrapper none, the model it was trained for, or train one for this "
                "model with `lazy-rag tune`.")

    # -- files ------------------------------------------------------------------------------------
    def save(self, path: str | os.PathLike) -> Path:
        """Write atomically (a temp file in the same folder, then a rename)."""
        from safetensors.torch import save

        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        meta = {"format": FORMAT, "header": str(self.header), "trailer": str(self.trailer),
                "model_fingerprint": self.model_fingerprint, "recipe": json.dumps(self.recipe, sort_keys=True),
                "digest": self.digest}
        tensors = {"vectors": self.vectors.detach().to("cpu", torch.float32).contiguous()}
        if self.adapter is not None:
            # bf16 on disk (the digest hashes bf16 values, so a loaded adapter has the same digest)
            meta["adapter"] = json.dumps(self.adapter.describe())
            tensors.update({k: t.detach().to("cpu", torch.bfloat16).contiguous() for k, t in self.adapter.tensors().items()})
        # serialised in memory and written through our own temp file: safetensors' save_file makes
        # its file 0600, which an index served by another user could not read (tempfiles.py)
        atomic_write_bytes(path, save(tensors, metadata=meta))
        return path

    @classmethod
    def load(cls, path: str | os.PathLike, name: str | None = None) -> "ChunkWrapper":
        from safetensors import safe_open

        path = Path(path).expanduser()
        if not path.is_file():
            raise WrapperError(f"No chunk wrapper file at {path}; give a bundled name ({', '.join(bundled_names()) or 'none'}), "
                               "a .safetensors file written by `lazy-rag tune`, or none.")
        try:
            with safe_open(str(path), framework="pt") as f:
                meta = f.metadata() or {}
                vectors = f.get_tensor("vectors").to(torch.float32).clone()
                factors = {k: f.get_tensor(k) for k in f.keys() if k.startswith("adapter.")}
        except Exception as e:  # truncated, garbled or not safetensors
            raise WrapperError(f"{path} is not a readable chunk wrapper ({type(e).__name__}: {e}); train it again "
                               "with `lazy-rag tune`.") from e
        if meta.get("format") != FORMAT:
            raise WrapperError(f"{path} is not a lazy-rag chunk wrapper (format {meta.get('format')!r}, want {FORMAT!r}).")
        try:
            adapter = ChunkAdapter.from_tensors(json.loads(meta["adapter"]), factors) if meta.get("adapter") else None
            wrapper = cls(vectors, int(meta["header"]), int(meta["trailer"]), meta.get("model_fingerprint", ""),
                          json.loads(meta.get("recipe") or "{}"), name or str(path), adapter)
        except (KeyError, ValueError, TypeError) as e:
            raise WrapperError(f"{path} has damaged metadata ({e}); train it again with `lazy-rag tune`.") from e
        if meta.get("digest") and meta["digest"] != wrapper.digest:
            raise WrapperError(f"{path} is damaged: its vectors do not match the digest in its metadata "
                               f"({wrapper.digest} != {meta['digest']}).")
        if not torch.isfinite(vectors).all() or not all(torch.isfinite(t).all() for t in factors.values()):
            raise WrapperError(f"{path} holds non-finite values; train it again with `lazy-rag tune`.")
        return wrapper


# -- bundled wrappers and how a name resolves ------------------------------------------------------
def bundled_names() -> list[str]:
    return sorted(p.stem for p in BUNDLED_DIR.glob("*.safetensors")) if BUNDLED_DIR.exists() else []


def bundled_path(model_name: str | None) -> Path | None:
    """The bundled wrapper file for a bundled model name (aliases resolved), or None."""
    if not model_name:
        return None
    from .models import ALIASES

    name = ALIASES.get(str(model_name).lower(), str(model_name).lower())
    path = BUNDLED_DIR / f"{name}.safetensors"
    return path if path.is_file() else None


def resolve_wrapper(spec: "str | os.PathLike | ChunkWrapper | None", model_name: str | None,
                    fingerprint: dict) -> ChunkWrapper | None:
    """The wrapper a build or a model uses.

    ``"auto"`` (the default): the bundled wrapper trained for exactly these weights (found by the
    model's name, else by its fingerprint, so a bundled model loaded from its file path gets it
    too), else none. ``"none"``/None: no wrapper. A bundled name
    (``lazy-rag models`` lists them) or a file path: that wrapper, which must match the model."""
    if isinstance(spec, ChunkWrapper):
        spec.check_model(fingerprint, model_name)
        return spec
    if spec is None or str(spec).lower() in NONE_NAMES:
        return None
    if str(spec).lower() == "auto":
        # by name first; then by fingerprint, so the same weights loaded from a path (a .gguf, a
        # folder) get their bundled wrapper too
        path = bundled_path(model_name)
        others = sorted(p for p in BUNDLED_DIR.glob("*.safetensors") if p != path) if BUNDLED_DIR.exists() else []
        for candidate in ([path] if path is not None else []) + others:
            wrapper = ChunkWrapper.load(candidate, name=candidate.stem)
            if wrapper.model_fingerprint and wrapper.matches(fingerprint["id"]):
                return wrapper
        return None
    text = str(spec)
    path = BUNDLED_DIR / f"{text}.safetensors"
    if not path.is_file():
        path = Path(text)
    wrapper = ChunkWrapper.load(path, name=text)
    wrapper.check_model(fingerprint, model_name)
    return wrapper


class WrapperTable:
    """The wrappers a host serves, each given a fixed block of virtual token ids.

    ``rows`` [slots of all registered wrappers, hidden] (model dtype, on the model's device) is
    what ``ModelParts.embed_ids`` reads for ids >= ``vocab_rows``. Registering replaces the tensor,
    so it happens outside any captured CUDA graph (decode steps never read it)."""

    def __init__(self, parts):
        self.parts = parts
        self.vocab_rows = parts.vocab_rows
        self._base: dict[str, int] = {}
        self._vectors: list[torch.Tensor] = []

    def ids(self, wrapper: ChunkWrapper) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """(header ids, trailer ids) of ``wrapper`` in this host, registering it on first use."""
        if wrapper.hidden_size != self.parts.shape.hidden_size:
            raise WrapperError(f"The chunk wrapper {wrapper.name or wrapper.digest} has vectors of size "
                               f"{wrapper.hidden_size}, the model's hidden size is {self.parts.shape.hidden_size}.")
        key = wrapper.digest
        if key not in self._base:
            base = sum(v.shape[0] for v in self._vectors)
            if wrapper.adapter is not None:
                adapters = ChunkAdapters.of(self.parts.model)
                try:
                    column = adapters.add(wrapper.adapter, key)
                except ValueError as e:
                    raise WrapperError(f"The chunk wrapper {wrapper.name or key} carries an adapter that does not fit "
                                       f"this model: {e}.") from e
                adapters.claim_slots(self.vocab_rows + base, self.vocab_rows + base + wrapper.slots, column)
            self._base[key] = base
            self._vectors.append(wrapper.vectors.detach().to(self.parts.device, self.parts.dtype))
            self.parts.virtual_rows = torch.cat(self._vectors)
        first = self.vocab_rows + self._base[key]
        header = tuple(range(first, first + wrapper.header))
        return header, tuple(range(first + wrapper.header, first + wrapper.slots))
