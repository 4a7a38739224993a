"""One chunk's KV on disk: the record format, with its one encoder (``pack``) and decoder
(``unpack``, ``verify``, ``read_body``). The index's segments (``store.ChunkStore``) append records
one after another; the replicas' shared folder (``server.scaleout.shared_store``) keeps one record
a file. A format change is made here and nowhere else.

A record is a 16-byte header (``LRKV``, the CRC32 of the body, the body's length) and a body that
is a safetensors blob: ``k`` (unrotated) and ``v`` of shape [layers, tokens, kv_heads, head_dim],
plus ``k_scale``/``v_scale`` for quantised (fp8) KV, or for int4 KV uint8 codes (two a byte)
with ``k_scale``/``v_scale``/``k_zero``/``v_zero`` (``kv_int4``'s layout; the metadata's
``int4_groups`` names its group sizes), with metadata: the chunk id, the CRC32 of every tensor, a key of the token ids (``tokens_key``: the store's hash of them), the dtype and the
fingerprint of the model/tokenizer/RoPE/shared prefix/wrapper that computed it. Records describe
themselves (``--repair`` finds KV by scanning the segments) and load without unpickling
(safetensors' bytes and a JSON header).
"""
from __future__ import annotations

import json
import math
import os
import struct
import zlib
from dataclasses import dataclass

import torch
from safetensors.torch import load as load_safetensors

from .chunk_kv import NOT_IN_MEMORY, ChunkKV
from .errors import LazyIndexError

# the dtypes a record's KV may have, by the name the index's settings and the CLI use
# int4 has no torch dtype of its own: INT4 (torch's packed 4-bit dtype, never a tensor's here) stands
# for it wherever a stored KV dtype is a torch dtype (``ChunkStore.kv_dtype``); its name is "int4"
INT4 = torch.quint4x2
KV_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
             # e4m3 with one fp16 scale per (layer, token, KV head): half the bytes (kernels.kv_quant)
             "float8_e4m3fn": torch.float8_e4m3fn,
             # 4-bit codes with fp16 scales and zeros per group (kv_int4): ~0.27 of 16-bit KV's bytes
             "int4": INT4}
# the short names `--kv-dtype` also accepts (a benchmark run with "bf16" was refused)
KV_DTYPE_NAMES = {"fp8": "float8_e4m3fn", "bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}


def kv_dtype_named(name: str, model_dtype: torch.dtype) -> torch.dtype | None:
    """The torch dtype a stored KV dtype's name means (a short name, ``KV_DTYPE_NAMES``, a dtype's
    own, or auto: ``model_dtype``); None for a name that is none of these (callers name the fix)."""
    if name == "auto":
        return model_dtype
    return KV_DTYPES.get(KV_DTYPE_NAMES.get(name, name))


def quantized_format(dtype: torch.dtype | None) -> str | None:
    """"fp8" or "int4" for a quantised stored KV dtype (``ChunkKV.format``'s names), None for
    16/32-bit KV: an index of quantised KV answers from its stored KV (``engine.chunk_tiers``)."""
    return "int4" if dtype == INT4 else "fp8" if dtype == torch.float8_e4m3fn else None


def quantized_kv_dtype(name) -> bool:
    """Whether a stored KV dtype's name means quantised KV (``quantized_format``)."""
    return quantized_format(kv_dtype_named(name, None)) is not None


def kv_dtype_name(dtype: torch.dtype) -> str:
    """The name an index's settings and a record's metadata give a stored KV dtype."""
    return "int4" if dtype == INT4 else str(dtype).removeprefix("torch.")


def check_kv_dtype(name) -> None:
    """Refuse a stored KV dtype's name that means none (before a build makes a folder, takes a
    lock or loads a model, and before a dry run's estimate)."""
    if name != "auto" and kv_dtype_named(name, None) is None:
        raise LazyIndexError(f"Unknown KV dtype {name!r}; choose auto, {', '.join(KV_DTYPE_NAMES)}, or "
                             f"{', '.join(KV_DTYPES)}.")


RECORD_MAGIC = b"LRKV"
RECORD_HEADER = struct.Struct("<4sIQ")  # magic, CRC32 of the body, body length
TENSOR_NAMES = ("k", "v", "k_scale", "v_scale", "k_zero", "v_zero")
_ST_DTYPES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16", torch.float8_e4m3fn: "F8_E4M3",
              torch.uint8: "U8"}
_ST_TO_TORCH = {v: k for k, v in _ST_DTYPES.items()}


def tensor_crc(t: torch.Tensor) -> str:
    """The CRC32 of a tensor's bytes as a record's metadata holds it (8 hex digits)."""
    flat = t.contiguous().view(torch.uint8) if t.dtype != torch.uint8 else t.contiguous()
    return format(zlib.crc32(flat.numpy().data), "08x")


# -- writing ---------------------------------------------------------------------------------------

@dataclass(frozen=True)
class PackedRecord:
    """One record ready to write: its body as buffers (uncopied tensor bytes) and the body's CRC32."""

    body: list
    crc: int

    @property
    def length(self) -> int:
        return sum(memoryview(p).nbytes for p in self.body)

    @property
    def span(self) -> int:
        """Bytes the whole record takes, header included."""
        return RECORD_HEADER.size + self.length

    def parts(self) -> list:
        """The whole record as buffers: the header, then the body."""
        return [RECORD_HEADER.pack(RECORD_MAGIC, self.crc, self.length), *self.body]

    def body_bytes(self) -> bytes:
        return b"".join(bytes(memoryview(p).cast("B")) for p in self.body)


def pack(kv: ChunkKV, *, chunk_id: str, tokens_key: str, fingerprint: str,
         dtype: torch.dtype | None = None) -> PackedRecord:
    """One chunk's record: the KV's tensors (cast to ``dtype`` unless fp8: fp8 values mean
    nothing without their scales' dtype; an fp8 ``dtype`` quantises unquantised KV per row, an
    int4 one (``INT4``) any other KV in groups, ``kv_int4``; int4 KV for another dtype is
    dequantised first) and their metadata. The costly part of a write (copies and CRCs, which
    release the GIL): a build runs it for several chunks at once on a thread pool."""
    if kv.int4 and dtype != INT4:
        kv = ChunkKV(*kv.dequantized(torch.float32 if dtype in (None, torch.float8_e4m3fn) else dtype))
    if dtype == torch.float8_e4m3fn and not kv.quantized:
        from .kernels.kv_quant import quantize_rows

        (k8, ks), (v8, vs) = quantize_rows(kv.k.detach()), quantize_rows(kv.v.detach())
        kv = ChunkKV(k8, v8, ks, vs)
    if dtype == INT4 and not kv.int4:
        from .kernels.kv_quant import dequantize_rows
        from .kv_int4 import KEY_GROUP, VALUE_GROUP, quantize_kv

        k, v = kv.k.detach(), kv.v.detach()
        if kv.quantized:
            k, v = dequantize_rows(k, kv.k_scale), dequantize_rows(v, kv.v_scale)
        kv = ChunkKV.from_tensors(quantize_kv(k.to("cpu"), v.to("cpu")), (KEY_GROUP, VALUE_GROUP))
    tensors = {}
    for name, t in kv.tensors().items():
        t = t.detach().to("cpu")
        if kv.format is None and dtype is not None:
            t = t.to(dtype)
        tensors[name] = t.contiguous()
    meta = {"format": "2", "chunk": chunk_id, "tokens": tokens_key, "fingerprint": fingerprint,
            "dtype": "int4" if kv.int4 else str(tensors["k"].dtype).removeprefix("torch.")}
    if kv.int4:
        meta["int4_groups"] = ",".join(map(str, kv.groups))
    meta.update({f"{name}_crc32": tensor_crc(t) for name, t in tensors.items()})
    body = safetensors_parts(tensors, meta)
    crc = 0
    for p in body:
        crc = zlib.crc32(p, crc)
    return PackedRecord(body, crc)


def safetensors_parts(tensors: dict[str, torch.Tensor], metadata: dict) -> list:
    """A safetensors blob as buffers: its header, then each (contiguous, CPU) tensor's own bytes,
    uncopied (``safetensors.torch.save`` copies every tensor into one bytes object, at ~0.6 GB/s on
    a 2-core machine: the build's writer thread was bound by it). ``safetensors.torch.load`` of the
    joined buffers gives the tensors back."""
    header, off, datas = {}, 0, []
    for name, t in tensors.items():
        data = t.reshape(-1).view(torch.uint8).numpy()
        header[name] = {"dtype": _ST_DTYPES[t.dtype], "shape": list(t.shape), "data_offsets": [off, off + data.nbytes]}
        off += data.nbytes
        datas.append(data)
    header["__metadata__"] = metadata
    head = json.dumps(header, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)  # the data starts 8-aligned, as safetensors writes it
    return [struct.pack("<Q", len(head)) + head, *datas]


# -- reading ---------------------------------------------------------------------------------------

def read_header(head: bytes) -> tuple[int, int] | None:
    """(body CRC32, body length) of a record's header bytes, or None: not a record's header."""
    if len(head) < RECORD_HEADER.size:
        return None
    magic, crc, length = RECORD_HEADER.unpack(head[:RECORD_HEADER.size])
    return (crc, length) if magic == RECORD_MAGIC else None


def first_byte_cached(fd: int, off: int) -> bool | None:
    """Whether the byte at ``off`` of ``fd`` is in the page cache (a one-byte RWF_NOWAIT read);
    None where the kernel or file system cannot tell."""
    try:
        os.preadv(fd, [bytearray(1)], off, os.RWF_NOWAIT)
    except BlockingIOError:
        return False
    except (OSError, AttributeError):
        return None
    return True


def verify(body, crc: int) -> str | None:
    """Why a record body (bytes, or a buffer) does not match its header's CRC32; None when it does."""
    return None if zlib.crc32(body) == crc else "checksum mismatch (corrupt)"


def read_body(fd: int, off: int, length: int, crc: int, *, pin: bool = False,
              flags: int = 0) -> tuple[torch.Tensor | None, str | None]:
    """The record body of ``length`` bytes at ``off`` of ``fd`` as a uint8 tensor (``pin``:
    page-locked), checked against ``crc``; or (None, why). One copy, from the page cache into the
    tensor (``bytes`` from ``os.pread`` and then a safetensors load and a pin made four: an 8B
    model's 32 MB chunk took ~130 ms to read from the page cache, slower than encoding it again).
    ``flags``: ``os.RWF_NOWAIT`` reads only what is cached (else ``NOT_IN_MEMORY``)."""
    buf = torch.empty(length, dtype=torch.uint8, pin_memory=pin)
    view = memoryview(buf.numpy())
    got = 0
    try:
        while got < length:
            n = os.preadv(fd, [view[got:]], off + got, flags)
            if n <= 0:
                break
            got += n
    except BlockingIOError:
        return None, NOT_IN_MEMORY
    except OSError as e:
        return None, f"unreadable ({e.strerror})"
    if got < length:
        return None, NOT_IN_MEMORY if flags else "unreadable (truncated)"
    why = verify(view, crc)
    return (None, why) if why else (buf, None)


def record_metadata(body) -> dict:
    """The metadata of a record body (a safetensors blob), from its JSON header alone."""
    if isinstance(body, torch.Tensor):  # a uint8 buffer (read_body): no copy
        body = memoryview(body.numpy())
    if len(body) < 8:
        raise ValueError("shorter than a safetensors header")
    (n,) = struct.unpack("<Q", bytes(body[:8]))
    if n > min(len(body) - 8, 100 << 20):
        raise ValueError("header length past the record")
    header = json.loads(bytes(body[8:8 + n]))
    meta = header.get("__metadata__") if isinstance(header, dict) else None
    if not isinstance(meta, dict):
        raise ValueError("no metadata")
    return meta


def record_tensors(body) -> dict[str, torch.Tensor]:
    """The tensors of a safetensors record body: views of ``body`` when it is a uint8 tensor (the
    data starts 8-aligned, ``safetensors_parts``), else a safetensors load (copies)."""
    if not isinstance(body, torch.Tensor):
        return load_safetensors(body)
    (n,) = struct.unpack("<Q", body[:8].numpy().tobytes())
    header = json.loads(body[8:8 + n].numpy().tobytes())
    header.pop("__metadata__", None)
    data = body[8 + n:]
    out = {}
    for name, spec in header.items():
        dtype = _ST_TO_TORCH[spec["dtype"]]
        a, b = spec["data_offsets"]
        shape = [int(x) for x in spec["shape"]]
        if not 0 <= a <= b <= data.numel() or (b - a) != math.prod(shape) * dtype.itemsize or a % dtype.itemsize:
            raise ValueError(f"tensor {name} does not fit the record")
        out[name] = data[a:b].view(dtype).view(shape)
    return out


def unpack(body, *, chunk_id: str, tokens_key: str, fingerprint: str,
           tensor_crcs: bool = True) -> tuple[ChunkKV | None, str | None]:
    """The KV of a record body (bytes, or a uint8 tensor whose views the tensors become), if it
    holds ``chunk_id``'s KV for these tokens and this fingerprint; else (None, why).
    ``tensor_crcs``: each tensor's own CRC32 is checked too (a second pass over the bytes: an
    index check wants it, the engine's reads, which ``verify`` the body, do not)."""
    try:
        meta = record_metadata(body)
    except ValueError as e:
        return None, f"unreadable ({e})"
    if meta.get("fingerprint") != fingerprint:
        return None, "computed by another model/tokenizer/prefix/wrapper"
    if meta.get("chunk") != chunk_id:
        return None, "the record holds another chunk's KV"
    if meta.get("tokens") != tokens_key:
        return None, "token ids differ"
    try:
        tensors = record_tensors(body)
    except Exception as e:  # a garbled blob (the CRC matched a forged one)  # noqa: BLE001
        return None, f"unreadable ({type(e).__name__})"
    if not {"k", "v"} <= set(tensors) <= set(TENSOR_NAMES):
        return None, f"unreadable (tensors {sorted(tensors)})"
    groups = None
    if meta.get("dtype") == "int4" or "k_zero" in tensors:
        groups, why = int4_groups(meta, tensors)
        if why:
            return None, f"unreadable ({why})"
    if tensor_crcs:
        for name, t in tensors.items():
            if meta.get(f"{name}_crc32") != tensor_crc(t):
                return None, "checksum mismatch (corrupt)"
    return ChunkKV.from_tensors(tensors, groups), None


def int4_groups(meta: dict, tensors: dict[str, torch.Tensor]) -> tuple[tuple[int, int] | None, str | None]:
    """An int4 record's (key group, value group), checked against its tensors' shapes
    (``kv_int4``'s layout); or (None, what does not fit)."""
    try:
        gk, gv = (int(x) for x in meta["int4_groups"].split(","))
        assert gk > 0 and gv > 0
    except (KeyError, ValueError, AttributeError, AssertionError):
        return None, "int4 record without its group sizes"
    if set(tensors) != set(TENSOR_NAMES) or meta.get("dtype") != "int4":
        return None, f"int4 tensors {sorted(tensors)}"
    k, v = tensors["k"], tensors["v"]
    if k.dim() != 4 or k.dtype != torch.uint8 or v.shape != k.shape or v.dtype != torch.uint8:
        return None, "int4 codes of another shape"
    layers, n, heads, half = k.shape
    d = tensors["k_scale"].shape[-1] if tensors["k_scale"].dim() == 4 else -1
    want_k = (layers, -(-n // gk), heads, d)
    want_v = (layers, n, heads, -(-d // gv))
    stats = [(tensors[f"{x}_{s}"], want) for s in ("scale", "zero") for x, want in (("k", want_k), ("v", want_v))]
    if (d + 1) // 2 != half or any(tuple(t.shape) != want or t.dtype != torch.float16 for t, want in stats):
        return None, "int4 scales of another shape"
    return (gk, gv), None
