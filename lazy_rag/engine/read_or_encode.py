"""Read a chunk's stored KV from the disk, or encode the chunk again: whichever is faster here.

Reusing KV that must come from a disk is often slower than recomputing it (SIFT, arXiv
2606.09441): an 8B model's KV is 128 KB per token, so at the ~1 GB/s of a cloud disk 5 chunks of
2048 tokens take ~1.3 s to read, while an H100 encodes them in ~0.3 s. KV already in the page
cache (or the host tier, or the pool) is always read: that is memory bandwidth. So when the
store says a chunk's record is not in memory (a read that would wait for the disk), the engine
compares the two estimates below and encodes the chunk if that is faster; the record on disk is
left as it is (it is valid), and the request's stats count the chunk as ``recomputed``.

Both rates are measured on this machine as the engine runs: every disk read that missed the page
cache (bytes / seconds) and every chunk encode (one forward for a batch of chunks: a fixed cost
per forward plus a cost per token, fitted from a probe at first use and refreshed by each encode),
each an exponentially weighted average. Until the first cold read is measured the disk is
assumed at ``DEFAULT_DISK_BPS`` (the H100 device machine's disk read 0.8-1.4 GB/s cold).
"""
from __future__ import annotations

import time

DEFAULT_DISK_BPS = 1.0e9
ALPHA = 0.3  # weight of the newest measurement


class ReadOrEncode:
    def __init__(self, disk_bps: float = DEFAULT_DISK_BPS, alpha: float = ALPHA):
        self.disk_bps = float(disk_bps)
        self.alpha = alpha
        self.disk_measured = 0            # cold reads measured so far
        self.forward_s: float | None = None   # fixed cost of one encode forward
        self.token_s: float | None = None     # cost per encoded token
        self.encodes_measured = 0

    # -- estimates ------------------------------------------------------------------------------
    @property
    def calibrated(self) -> bool:
        return self.token_s is not None

    def read_seconds(self, nbytes: int) -> float:
        return nbytes / self.disk_bps

    def encode_seconds(self, tokens: int) -> float:
        return (self.forward_s or 0.0) + tokens * (self.token_s or 0.0)

    def should_encode(self, nbytes: int, tokens: int, batch_tokens: int = 0) -> bool:
        """Encode a chunk of ``tokens`` (``nbytes`` of stored KV not in memory) rather than read it?
        ``batch_tokens``: tokens already chosen for encoding in this forward (their fixed cost is
        paid already, so this chunk adds only its tokens)."""
        if not self.calibrated:
            return False
        extra = tokens * self.token_s + (0.0 if batch_tokens else (self.forward_s or 0.0))
        return extra < self.read_seconds(nbytes)

    # -- measurements ---------------------------------------------------------------------------
    def observe_read(self, nbytes: int, seconds: float) -> None:
        """A read that went to the disk (the page cache missed it)."""
        if nbytes <= 0 or seconds <= 0:
            return
        rate = nbytes / seconds
        self.disk_bps = rate if self.disk_measured == 0 else (1 - self.alpha) * self.disk_bps + self.alpha * rate
        self.disk_measured += 1

    def observe_encode(self, tokens: int, seconds: float) -> None:
        """One encode forward of ``tokens`` tokens took ``seconds`` (synchronised)."""
        if tokens <= 0 or seconds <= 0 or self.forward_s is None:
            return
        per_token = max(seconds - self.forward_s, 0.0) / tokens
        self.token_s = (1 - self.alpha) * self.token_s + self.alpha * per_token
        self.encodes_measured += 1

    def calibrate(self, encode, small: int = 32, large: int = 512) -> None:
        """Fit the fixed and per-token encode costs from timed probes: ``encode(n)`` encodes one
        chunk of ``n`` tokens and returns when it is done (after a warm-up of each size)."""
        times = {}
        for n in (small, large):
            encode(n)
            t0 = time.perf_counter()
            encode(n)
            times[n] = time.perf_counter() - t0
        per_token = max(times[large] - times[small], 0.0) / (large - small)
        self.token_s = max(per_token, 1e-9)
        self.forward_s = max(times[small] - small * self.token_s, 0.0)

    def as_dict(self) -> dict:
        return {"disk_gbps": round(self.disk_bps / 1e9, 3), "disk_reads_measured": self.disk_measured,
                "encode_forward_ms": None if self.forward_s is None else round(self.forward_s * 1e3, 3),
                "encode_tokens_per_s": None if not self.token_s else round(1 / self.token_s, 1),
                "encodes_measured": self.encodes_measured}
