"""Loading one tensor-parallel rank's share of a model, and no other rank's.

Tensor parallelism exists to serve a model larger than one device, so no process may need the
whole model: each rank builds the model's skeleton on the meta device (no memory) and gives it
values one module at a time, keeping of each decoder layer's split tensors only its own rows or
columns (``tensor_parallel.layer_shares``: q/k/v/o, gate/up/down, phi3's fused qkv and gate_up,
OLMo 2's q/k norms) and the rest whole (embeddings, norms, LM head, RoPE buffers). The most a
rank holds beyond its share is one module's whole tensors, while it slices them.

A model's ``ModelSource`` says where its values come from, and travels to the worker ranks in
place of the weights (``tp_engine``): a folder of safetensors (``CheckpointSource``: the model
cache GGUF conversion writes, or any transformers folder; each share read with ``get_slice``), or
random weights (``RandomSource``: ``random_models``; each module drawn from its own seed, so a
rank draws the modules it holds and no other, and every rank and the single process draw the
same values). A model given in memory has no source: it is shared whole with the workers, each
slicing its share (``tensor_parallel.shard_layer``).

A model loaded as a share carries ``rank_share`` (``RankShare``): what ``ShardedParts`` and
``check_shardable`` read, and what the host's fingerprint reads the whole weights through
(``RankShare.whole_state``: one module at a time), so that stored KV is the whole model's at any
tensor-parallel size.
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import torch
from torch import nn

from ..architecture import check_supported
from .tensor_parallel import Share, check_split, fit_linear_sizes, layer_shares


@dataclass(frozen=True)
class RankShare:
    """Rank ``rank`` of ``size``'s share of ``source``'s model, on ``device`` (which a CUDA rank
    would set to its own GPU)."""
    source: "ModelSource"
    rank: int
    size: int
    device: torch.device

    def load(self) -> nn.Module:
        return self.source.load_share(self.rank, self.size, self.device)

    def whole_state(self) -> Iterator[tuple[str, torch.Tensor]]:
        """(name, whole tensor) of every entry of the whole model's state dict, one module at a
        time (the fingerprint's weights)."""
        return self.source.whole_state(self.device)


class ModelSource:
    """Where a model's values come from. ``dtype``: the dtype its tensors are loaded in.
    Subclasses say how a module's own parameters get their values (``read``, ``seed_module``)."""

    dtype: torch.dtype

    def config(self):
        raise NotImplementedError

    def read(self, name: str, like: torch.Tensor, share: Share | None, device) -> torch.Tensor | None:
        """Parameter ``name``'s values (``share`` of them, or whole), or None where the module's
        initialisation makes them (``like``: its meta tensor)."""
        raise NotImplementedError

    def seed_module(self, name: str) -> None:
        """Set the random generators before module ``name`` is initialised."""

    def skeleton(self) -> nn.Module:
        """The model with every tensor on the meta device."""
        from transformers import AutoModelForCausalLM

        config = self.config()
        check_supported(config)
        with torch.device("meta"):
            return AutoModelForCausalLM.from_config(config, dtype=self.dtype)

    def load_share(self, rank: int, size: int, device) -> nn.Module:
        """The model holding rank ``rank`` of ``size``'s share of every decoder layer (the whole
        model when ``size`` is 1), on ``device``."""
        device = torch.device(device)
        model = self.skeleton()
        shares = {}
        if size > 1:
            layers = model.model.layers
            check_split(model.config, layers, size)
            names = {id(m): n for n, m in model.named_modules()}
            shares = {f"{names[id(layer)]}.{k}": s for layer in layers
                      for k, s in layer_shares(model.config, layer, rank, size).items()}
        for _ in self._materialise(model, shares, device):
            pass
        fit_linear_sizes(model)
        if size > 1:
            model.rank_share = RankShare(self, rank, size, device)
        return model.eval()

    def whole_state(self, device) -> Iterator[tuple[str, torch.Tensor]]:
        model = self.skeleton()
        persistent = set(model.state_dict())
        for name, module in self._materialise(model, {}, torch.device(device), keep=False):
            prefix = f"{name}." if name else ""
            for key, t in [*module.named_parameters(recurse=False), *module.named_buffers(recurse=False)]:
                if prefix + key in persistent:
                    yield prefix + key, t

    def _materialise(self, model: nn.Module, shares: dict[str, Share], device: torch.device,
                     keep: bool = True) -> Iterator[tuple[str, nn.Module]]:
        """Give every module of the meta ``model`` its values, in transformers' initialisation
        order, yielding each module once its own tensors have them (its split parameters cut to
        ``shares``). ``keep=False``: each module's tensors go back to the meta device after it is
        yielded (but tied ones, which a later module takes again), so that reading the whole
        model holds one module at a time."""
        from transformers import initialization

        # a parameter that several modules hold (tied embeddings) gets its values once, from the
        # first module that initialises it; the others take the same tensor
        seen, tied = set(), set()
        for _, p in model.named_parameters(remove_duplicate=False):
            (tied if id(p) in seen else seen).add(id(p))
        done: dict[int, nn.Parameter] = {}
        devices = [device] if device.type == "cuda" else []
        with torch.no_grad(), initialization.guard_torch_init_functions(), torch.random.fork_rng(devices):
            for name, module, initialise in _init_order(model):
                prefix = f"{name}." if name else ""
                for key, b in list(module.named_buffers(recurse=False)):
                    module._buffers[key] = torch.empty_like(b, device=device)
                cut = {}
                for key, p in list(module.named_parameters(recurse=False)):
                    if id(p) in done:
                        module._parameters[key] = done[id(p)]
                        continue
                    share = shares.get(prefix + key)
                    values = self.read(prefix + key, p, share, device)
                    read = values is not None
                    if not read:   # the module's initialisation draws them, whole
                        values = torch.empty_like(p, device=device)
                        cut[key] = share
                    module._parameters[key] = nn.Parameter(values, requires_grad=False)
                    module._parameters[key]._is_hf_initialized = read   # (transformers' init leaves it alone)
                    if id(p) in tied:
                        done[id(p)] = module._parameters[key]
                self.seed_module(name)
                initialise(module, False)
                for key, share in cut.items():
                    if share is not None:
                        module._parameters[key] = nn.Parameter(share.of(module._parameters[key]), requires_grad=False)
                for p in module.parameters(recurse=False):
                    p._is_hf_initialized = True   # (a tied parameter is not drawn again)
                yield name, module
                if not keep:
                    for key, p in module.named_parameters(recurse=False):
                        if not any(p is t for t in done.values()):
                            module._parameters[key] = nn.Parameter(torch.empty_like(p, device="meta"),
                                                                   requires_grad=False)
                    for key, b in module.named_buffers(recurse=False):
                        module._buffers[key] = torch.empty_like(b, device="meta")


def _init_order(model: nn.Module):
    """(name, module, its init function) in the order transformers initialises a new model
    (``PreTrainedModel.initialize_weights``: children before their parent, a sub-model with its
    own ``_initialize_weights``)."""
    from transformers import PreTrainedModel

    def walk(name, module, initialise):
        for child_name, child in module.named_children():
            sub = child._initialize_weights if isinstance(child, PreTrainedModel) else initialise
            yield from walk(f"{name}.{child_name}" if name else child_name, child, sub)
        yield name, module, initialise

    return walk("", model, model._initialize_weights)


class CheckpointSource(ModelSource):
    """A transformers folder of safetensors (one file, or shards named by
    ``model.safetensors.index.json``), read in ``dtype``: each rank reads only its share of
    every split tensor (``safe_open(...).get_slice``)."""

    def __init__(self, path: str | Path, dtype: torch.dtype):
        self.path, self.dtype = str(path), dtype
        self.files = _weight_files(Path(path))   # tensor name -> file

    @classmethod
    def of(cls, path: str | Path, dtype: torch.dtype) -> "CheckpointSource | None":
        """The source of a local folder whose safetensors hold every tensor of the model its
        config describes, under the model's own names; None for any other (a hub id, .bin
        weights, a checkpoint whose names transformers renames on load): that one is loaded
        whole."""
        path = Path(path)
        if not (path / "config.json").is_file():
            return None
        source = cls(path, dtype)
        if not source.files:
            return None
        model = source.skeleton()
        seen = set()
        for name, p in model.named_parameters():   # (a tied parameter once, under its first name)
            if id(p) not in seen and name not in source.files:
                return None
            seen.add(id(p))
        return source

    def config(self):
        from transformers import AutoConfig

        return AutoConfig.from_pretrained(self.path)

    def read(self, name, like, share, device):
        from safetensors import safe_open

        with safe_open(str(Path(self.path) / self.files[name]), framework="pt") as f:
            tensor = f.get_slice(name)
            if share is None:
                values = tensor[:]
            else:
                head = (slice(None),) * share.dim
                values = torch.cat([tensor[(*head, s)] for s in share.slices], share.dim)
        return values.to(device=device, dtype=like.dtype).contiguous()

    def __getstate__(self):   # (what travels to the workers: the folder and dtype; they list it again)
        return {"path": self.path, "dtype": self.dtype}

    def __setstate__(self, state):
        self.__init__(state["path"], state["dtype"])


def _weight_files(path: Path) -> dict[str, str]:
    index = path / "model.safetensors.index.json"
    if index.is_file():
        return dict(json.loads(index.read_text())["weight_map"])
    single = path / "model.safetensors"
    if not single.is_file():
        return {}
    from safetensors import safe_open

    with safe_open(str(single), framework="pt") as f:
        return {k: single.name for k in f.keys()}


class RandomSource(ModelSource):
    """Random weights of ``config``'s architecture (transformers' initialisation of each module),
    each module drawn from its own seed, derived from ``seed`` and the module's name: a rank
    draws the modules it holds and no other, and every rank, like the single process, gets the
    same values for the same seed on the same kind of device."""

    def __init__(self, config, seed: int, dtype: torch.dtype):
        self._config, self.seed, self.dtype = config, seed, dtype

    def config(self):
        return self._config

    def read(self, name, like, share, device):
        return None

    def seed_module(self, name: str) -> None:
        digest = hashlib.sha256(f"{self.seed}/{name}".encode()).digest()
        torch.manual_seed(int.from_bytes(digest[:8], "little") & ((1 << 63) - 1))
