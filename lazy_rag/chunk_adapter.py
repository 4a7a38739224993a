"""Chunk adapters: low-rank weight deltas applied only while a chunk is being encoded.

A chunk wrapper's soft vectors (wrapper.py) have little capacity: on Qwen2.5-0.5B they recover
about a third of the lazy-vs-full gap. Block-Attention recovers it by fine-tuning the whole model,
which changes every answer, ``full`` ones included. A chunk adapter sits in between: LoRA deltas
(``B @ A``, rank r) on the model's linear layers that are *gated per token*, on for the tokens of
a chunk being encoded (its wrapper slots included) and off for everything else: the shared
prefix, the question, recomputed tokens and generated ones. So:

- the adapter's effect lives only in the chunks' stored KV, like the wrapper's: nothing changes
  at query time, and a query costs what plain ``lazy`` costs;
- ``full`` and ``prefix`` are the unmodified checkpoint;
- the adapter travels inside the wrapper file and its bytes are in the wrapper's digest, so KV
  encoded with another adapter (or none) is never reused.

(Per-token activation of a LoRA is the idea of IBM's "activated LoRA", which keeps a base
model's KV cache valid across adapters; here it keeps the base model intact for the query.)

The deltas are forward hooks on the checkpoint's own ``nn.Linear`` modules, not replacement
modules: the model's ``state_dict``, and with it the model fingerprint, stays that of the
checkpoint, and every forward (the engine's layer loop, the oracle's and the trainer's HF
forwards) goes through the same hook, registered only for the forwards that encode chunks.
peft is not used because it gates adapters per sample,
never per token, and the engine packs chunk encodes and query tokens into one forward.

The gate is set around a forward (``ChunkAdapters.gated``): a tensor [..., adapters] in the
model's dtype whose leading dims match the linear layers' inputs ([n] in the engine's packed
forward, [batch, length] in an HF forward). Outside it no hook is registered: query
steps and captured decode graphs hold no adapter work.
"""
from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass, field

import torch

DEFAULT_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclass
class ChunkAdapter:
    """LoRA factors per adapted linear layer: ``weights[module name] = (A [r, in], B [out, r])``;
    the delta added to the layer's output is ``scale * (x @ A.T) @ B.T``, scale = alpha / r."""
    rank: int
    alpha: float
    targets: tuple[str, ...]
    weights: dict[str, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)

    @property
    def scale(self) -> float:
        return self.alpha / self.rank

    def describe(self) -> dict:
        return {"rank": self.rank, "alpha": self.alpha, "targets": list(self.targets)}

    def tensors(self) -> dict[str, torch.Tensor]:
        """Flat name -> tensor map for a safetensors file (``adapter.<module>.A`` / ``.B``)."""
        out = {}
        for name, (a, b) in sorted(self.weights.items()):
            out[f"adapter.{name}.A"], out[f"adapter.{name}.B"] = a, b
        return out

    @classmethod
    def from_tensors(cls, meta: dict, tensors: dict[str, torch.Tensor]) -> "ChunkAdapter":
        weights: dict[str, list] = {}
        for key, t in tensors.items():
            name, part = key[len("adapter."):].rsplit(".", 1)
            weights.setdefault(name, [None, None])["AB".index(part)] = t
        if any(a is None or b is None for a, b in weights.values()):
            raise ValueError("an adapter layer lacks its A or B factor")
        return cls(int(meta["rank"]), float(meta["alpha"]), tuple(meta["targets"]),
                   {n: (a, b) for n, (a, b) in weights.items()})

    def check_model(self, modules: dict[str, torch.nn.Module]) -> None:
        """ValueError unless every adapted layer exists in the model (``modules``: its
        ``named_modules()``) with the factors' shapes."""
        for name, (a, b) in self.weights.items():
            m = modules.get(name)
            if not isinstance(m, torch.nn.Linear):
                raise ValueError(f"the adapter adapts {name!r}, which is not a linear layer of this model")
            if a.shape != (self.rank, m.in_features) or b.shape != (m.out_features, self.rank):
                raise ValueError(f"the adapter's factors for {name} are {list(a.shape)} and {list(b.shape)}, the layer is "
                                 f"{m.in_features} -> {m.out_features} (rank {self.rank})")


def target_modules(model, targets=DEFAULT_TARGETS) -> dict[str, torch.nn.Linear]:
    """The decoder layers' linear modules whose last name is in ``targets``."""
    found = {name: m for name, m in model.named_modules()
             if isinstance(m, torch.nn.Linear) and name.rsplit(".", 1)[-1] in targets and ".layers." in f".{name}"}
    if not found:
        raise ValueError(f"no linear layer named {', '.join(targets)} in the model's decoder layers")
    return found


def new_adapter(model, rank: int = 8, alpha: float = 16.0, targets=DEFAULT_TARGETS, seed: int = 0) -> ChunkAdapter:
    """A trainable adapter that starts as no change: A Kaiming-uniform (as LoRA), B zero; fp32
    parameters on the model's device."""
    g = torch.Generator().manual_seed(seed)
    dev = next(model.parameters()).device
    weights = {}
    for name, m in target_modules(model, targets).items():
        bound = 1.0 / math.sqrt(m.in_features)
        a = (torch.rand(rank, m.in_features, generator=g) * 2 - 1) * bound
        weights[name] = (torch.nn.Parameter(a.to(dev)), torch.nn.Parameter(torch.zeros(m.out_features, rank, device=dev)))
    return ChunkAdapter(rank, float(alpha), tuple(targets), weights)


class ChunkAdapters:
    """The adapters installed on one model, each with a gate column; one per model
    (``ChunkAdapters.of(model)``), shared by the host that serves it and any trainer."""

    def __init__(self, model):
        self.model = model
        self.adapters: list[ChunkAdapter] = []
        self._keys: dict[str, int] = {}
        self._per_module: dict[str, list[tuple[int, torch.Tensor, torch.Tensor, float]]] = {}
        self._hooks: dict[str, torch.utils.hooks.RemovableHandle] = {}
        self._slots: list[tuple[int, int, int]] = []  # (first, end) virtual ids of a wrapper -> its column
        self.gate: torch.Tensor | None = None
        self.columns: set[int] = set()   # the gate's columns that are on for some token
        self._modules: dict | None = None

    @classmethod
    def of(cls, model) -> "ChunkAdapters":
        found = getattr(model, "_lazy_rag_chunk_adapters", None)
        if found is None:
            found = cls(model)
            object.__setattr__(model, "_lazy_rag_chunk_adapters", found)  # not a submodule, not in state_dict
        return found

    @classmethod
    def find(cls, model) -> "ChunkAdapters | None":
        """The model's adapters, or None when it has none."""
        found = getattr(model, "_lazy_rag_chunk_adapters", None)
        return found if found is not None and found.adapters else None

    def add(self, adapter: ChunkAdapter, key: str, trainable: bool = False) -> int:
        """Install ``adapter`` (once per ``key``, a wrapper digest); returns its gate column.
        Inference adapters are copied to the model's device and dtype with the scale folded into
        B; a ``trainable`` one is used as given (fp32 parameters, cast in the forward)."""
        if key in self._keys:
            return self._keys[key]
        modules = self._named_modules()
        adapter.check_model(modules)
        index = len(self.adapters)
        for name, (a, b) in adapter.weights.items():
            m = modules[name]
            if trainable:
                entry = (index, a, b, adapter.scale)
            else:
                w = m.weight
                entry = (index, a.detach().to(w.device, w.dtype), (b.detach().float() * adapter.scale).to(w.device, w.dtype), 1.0)
            self._per_module.setdefault(name, []).append(entry)
        self.adapters.append(adapter)
        self._keys[key] = index
        return index

    def remove(self, key: str) -> None:
        """Uninstall one adapter (a trainer's, when it is done); the others keep their columns."""
        index = self._keys.pop(key, None)
        if index is None:
            return
        for name in list(self._per_module):
            self._per_module[name] = [e for e in self._per_module[name] if e[0] != index]
            if not self._per_module[name]:
                del self._per_module[name]
        self.adapters[index] = None  # columns stay stable for the rest
        if all(a is None for a in self.adapters):
            self.adapters.clear()

    def claim_slots(self, first: int, end: int, column: int) -> None:
        """Virtual token ids [first, end) are the slots of the wrapper whose adapter is ``column``:
        a chunk holding them is encoded with that adapter."""
        self._slots.append((first, end, column))

    def column_of(self, token_ids) -> int | None:
        """The adapter column of a wrapped chunk's ids (by its wrapper slots), None if it has none."""
        if not self._slots:
            return None
        low = min(first for first, _, _ in self._slots)
        for t in [t for t in token_ids if t >= low]:
            for first, end, column in self._slots:
                if first <= t < end:
                    return column
        return None

    def gate_for(self, spans, length: int | tuple, device) -> tuple[torch.Tensor | None, set[int]]:
        """(a gate [*length, width] with ones on each (start, end, token ids) span's own column,
        chunks without an adapter staying off, and the columns it turns on); (None, empty) when no
        span has one. A tuple ``length`` addresses [batch, length] forwards: spans then carry their
        row first."""
        shape = (length,) if isinstance(length, int) else tuple(length)
        gate, columns = None, set()
        for span in spans:
            *row, start, end, ids = span
            column = self.column_of(ids)
            if column is None:
                continue
            if gate is None:
                gate = torch.zeros(*shape, self.width)
            gate[(*row, slice(start, end), column)] = 1.0
            columns.add(column)
        return (None if gate is None else gate.to(device=device, dtype=self._dtype())), columns

    def _dtype(self) -> torch.dtype:
        return next(self.model.parameters()).dtype

    def _named_modules(self) -> dict[str, torch.nn.Module]:
        if self._modules is None:
            self._modules = dict(self.model.named_modules())
        return self._modules

    def _hook(self, name: str):
        def hook(module, inputs, output):
            gate = self.gate
            if gate is None:
                return None
            x = inputs[0]
            for index, a, b, scale in self._per_module.get(name, ()):
                if index not in self.columns:   # off for every token: no work (and no autograd
                    continue                    # through another adapter's inference tensors)
                low = torch.nn.functional.linear(x, a.to(x.dtype)) * gate[..., index:index + 1].to(x.dtype)
                delta = torch.nn.functional.linear(low, b.to(x.dtype))
                output = output + (delta * scale if scale != 1.0 else delta)
            return output
        return hook

    @contextlib.contextmanager
    def gated(self, gate: torch.Tensor | None, columns: set[int]):
        """Apply the adapters to the tokens ``gate`` selects ([..., adapters]) for one forward;
        ``columns``: the adapters it turns on for some token (the others are skipped). The hooks
        exist only inside this context (a hooked module takes nn.Module's slow call path: ~3x the
        eager launch time of a small model's query step if they stayed on)."""
        if gate is None:
            yield
            return
        previous, self.gate = (self.gate, self.columns), gate
        self.columns = set(columns)
        outer = not self._hooks
        if outer:
            modules = self._named_modules()
            self._hooks = {name: modules[name].register_forward_hook(self._hook(name)) for name in self._per_module}
        try:
            yield
        finally:
            self.gate, self.columns = previous
            if outer:
                for handle in self._hooks.values():
                    handle.remove()
                self._hooks = {}

    @property
    def width(self) -> int:
        return len(self.adapters)


def encoding_chunks(model, spans, length: int | tuple, device):
    """The context of a forward that encodes chunks: each (row..., start, end, token ids) span on
    for its wrapper's adapter (``ChunkAdapters.gate_for``); nothing when the model has no adapter
    or no span has one. The engine's encode steps and the oracle both enter it."""
    adapters = ChunkAdapters.find(model)
    if adapters is None:
        return contextlib.nullcontext()
    return adapters.gated(*adapters.gate_for(spans, length, device))
