"""Fingerprints that tie stored chunk KV to the model, tokenizer and RoPE that produced it."""
from __future__ import annotations

import hashlib
import json

import torch

from .architecture import layer_fingerprint

_SAMPLE = 4096  # elements hashed per parameter: cheap, yet any re-trained or other weights differ


def _weights_digest(state) -> str:
    """Hash of every (name, tensor) of a state dict: its name, shape and a strided sample of
    values rounded to bf16, so the same checkpoint loaded in fp32 or bf16 gives the same digest.
    ``state`` may come in any order (a model loaded by shares reads its whole tensors one module
    at a time): each sample is kept, then hashed in name order."""
    samples = {}
    for name, p in state:
        flat = p.detach().reshape(-1)
        step = max(1, flat.numel() // _SAMPLE)
        sample = flat[::step][:_SAMPLE].to(torch.bfloat16).view(torch.int16).cpu().numpy()
        samples[name] = str(tuple(p.shape)).encode() + sample.tobytes()
    h = hashlib.sha256()
    for name, sample in sorted(samples.items()):
        h.update(name.encode())
        h.update(sample)
    return h.hexdigest()[:16]


def _tokenizer_digest(tokenizer) -> str:
    h = hashlib.sha256()
    vocab = sorted(tokenizer.get_vocab().items())
    h.update(json.dumps(vocab, ensure_ascii=False).encode())
    h.update(json.dumps(sorted(str(t) for t in tokenizer.all_special_tokens)).encode())
    h.update((getattr(tokenizer, "chat_template", None) or "").encode() if isinstance(
        getattr(tokenizer, "chat_template", None), (str, type(None))) else b"")
    return h.hexdigest()[:16]


def model_fingerprint(model, tokenizer, rope) -> dict:
    """The fingerprint of the whole model, also of one loaded as a tensor-parallel rank's share
    (``engine/shard_loading``): its whole weights are read again from where it was loaded."""
    c = model.config
    share = getattr(model, "rank_share", None)
    fp = {
        "model_type": c.model_type,
        "weights": _weights_digest(model.state_dict().items() if share is None else share.whole_state()),
        "tokenizer": _tokenizer_digest(tokenizer),
        "rope": rope.fingerprint(),
    }
    key = f"{fp['model_type']}|{fp['weights']}|{fp['tokenizer']}|{fp['rope']}"
    # config values outside the weights that change the KV (granite's multipliers): stored KV of one
    # setting is not another's. Families without any keep their ids as they were.
    layer = layer_fingerprint(c)
    if layer is not None:
        fp["layer"] = layer
        key += f"|{layer}"
    fp["id"] = hashlib.sha256(key.encode()).hexdigest()[:16]
    return fp
