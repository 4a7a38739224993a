"""Read a chunk's stored KV (from the page cache or the disk), or encode the chunk again:
whichever is faster here.

Reusing KV that must come from a disk is often slower than recomputing it (SIFT, arXiv
2606.09441): an 8B model's KV is 128 KB per token, so at the ~1 GB/s of a cloud disk 5 chunks of
2048 tokens take ~1.3 s to read, while an H100 encodes them in ~0.3 s. Even the page cache is not
free: a read there is a copy and a CRC32 pass on one CPU core (~1.8 GB/s on the H100 machine), so
an 8B chunk of 256 tokens (32 MB) takes ~20 ms to read and ~3 ms to encode in a lazy request's
own prefill forward (``kv_planner``). KV in the host tier or the pool is always used. For a
record in the store, the engine asks whether it is in the page cache (a one-byte RWF_NOWAIT
read), compares the estimates below and encodes the chunk if that is faster; the record is left
as it is (it is valid), and the request's stats count the chunk as ``recomputed``.

All rates are measured on this machine as the engine runs: every read from the disk and from the
page cache (bytes / seconds), and chunk encodes (a fixed cost per forward plus a cost per token,
fitted from timed probes at first use; an encode in a request's prefill pays no fixed cost, so
it refreshes nothing), each an exponentially weighted average. Until the first reads are measured
the disk is assumed at ``DEFAULT_DISK_BPS`` (the H100 device machine's disk read 0.8-1.4 GB/s
cold) and the page cache at ``DEFAULT_PAGE_CACHE_BPS``.

The encode fit is kept per machine and model shape in a small JSON file (``calibration_path``,
for a day): a `lazy-rag query` is one short process, and its probes (~1.8 s for SmolLM2 on a
2-core CPU) would otherwise be most of its time. The rates measured later still refresh it.
"""
from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import time
from pathlib import Path

DEFAULT_DISK_BPS = 1.0e9
# a read from the page cache: a copy and a CRC32 pass on one CPU core (~1.8 GB/s measured on the
# H100 device machine, 2026-11-24), not memory bandwidth
DEFAULT_PAGE_CACHE_BPS = 2.0e9
ALPHA = 0.3  # weight of the newest measurement
# where the encode fit is kept: LAZY_RAG_CALIBRATION=<file>, or "off" (measure in every process);
# default <LAZY_RAG_CACHE or ~/.cache/lazy-rag>/calibration.json
CALIBRATION_ENV = "LAZY_RAG_CALIBRATION"
CALIBRATION_MAX_AGE_S = 24 * 3600
log = logging.getLogger(__name__)


def calibration_path() -> Path | None:
    value = os.environ.get(CALIBRATION_ENV)
    if value == "off":
        return None
    if value:
        return Path(value)
    return Path(os.environ.get("LAZY_RAG_CACHE", Path.home() / ".cache" / "lazy-rag")) / "calibration.json"


def load_calibration(key: str, now: float | None = None) -> tuple[float, float] | None:
    """(fixed seconds per encode forward, seconds per token) kept for ``key`` within the last
    day, else None (no file, an unreadable one, another machine or model)."""
    path = calibration_path()
    if path is None:
        return None
    try:
        entry = json.loads(path.read_text()).get(key)
        if entry is None or (now or time.time()) - float(entry["measured_at"]) > CALIBRATION_MAX_AGE_S:
            return None
        forward_s, token_s = float(entry["forward_s"]), float(entry["token_s"])
    except (OSError, ValueError, TypeError, KeyError, AttributeError):
        return None
    return (forward_s, token_s) if forward_s >= 0 and token_s > 0 else None


def save_calibration(key: str, forward_s: float, token_s: float) -> None:
    """Keep a fit for ``key`` (other keys kept: a lock file serialises processes that save at
    once, and the file is replaced atomically). A cache that cannot be written (a read-only home)
    only costs the next process its probes."""
    path = calibration_path()
    if path is None:
        return
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path.with_name(path.name + ".lock"), "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            try:
                data = json.loads(path.read_text())
                data = data if isinstance(data, dict) else {}
            except (OSError, ValueError):
                data = {}
            data[key] = {"forward_s": forward_s, "token_s": token_s, "measured_at": time.time()}
            tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
            tmp.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")
            os.replace(tmp, path)
    except OSError as err:
        log.warning("could not keep the encode calibration in %s (%s); the next process measures again", path, err)


class ReadOrEncode:
    def __init__(self, disk_bps: float = DEFAULT_DISK_BPS, alpha: float = ALPHA,
                 page_cache_bps: float = DEFAULT_PAGE_CACHE_BPS):
        self.disk_bps = float(disk_bps)
        self.page_cache_bps = float(page_cache_bps)
        self.page_cache_measured = 0
        self.alpha = alpha
        self.disk_measured = 0            # cold reads measured so far
        self.forward_s: float | None = None   # fixed cost of one encode forward
        self.token_s: float | None = None     # cost per encoded token
        self.encodes_measured = 0
        self.calibration = None           # where the encode fit came from: "measured" / "kept"
        self.forced: bool | None = None   # set by ``forcing``: the choice made whatever the costs

    # -- estimates ------------------------------------------------------------------------------
    @property
    def calibrated(self) -> bool:
        return self.token_s is not None

    def read_seconds(self, nbytes: int, cached: bool = False) -> float:
        return nbytes / (self.page_cache_bps if cached else self.disk_bps)

    def should_encode(self, nbytes: int, tokens: int, batch_tokens: int = 0, cached: bool = False) -> bool:
        """Encode a chunk of ``tokens`` rather than read its ``nbytes`` of stored KV from the disk
        (``cached``: from the page cache)? ``batch_tokens``: tokens already in the forward that
        would encode it (its fixed cost is paid already, so this chunk adds only its tokens)."""
        if self.forced is not None:
            return self.forced
        if not self.calibrated:
            return False
        extra = tokens * self.token_s + (0.0 if batch_tokens else (self.forward_s or 0.0))
        return extra < self.read_seconds(nbytes, cached)

    @contextlib.contextmanager
    def forcing(self, encode: bool):
        """Inside the block every stored chunk is encoded (``encode``) or read, whatever the
        estimates say: ``lazy-rag compile`` runs both paths' kernels this way."""
        before, self.forced = self.forced, bool(encode)
        try:
            yield self
        finally:
            self.forced = before

    # -- measurements ---------------------------------------------------------------------------
    def observe_read(self, nbytes: int, seconds: float, cached: bool = False) -> None:
        """A read that went to the disk (the page cache missed it), or (``cached``) one from the
        page cache."""
        if nbytes <= 0 or seconds <= 0:
            return
        rate = nbytes / seconds
        if cached:
            n, old = self.page_cache_measured, self.page_cache_bps
            self.page_cache_bps = rate if n == 0 else (1 - self.alpha) * old + self.alpha * rate
            self.page_cache_measured += 1
            return
        self.disk_bps = rate if self.disk_measured == 0 else (1 - self.alpha) * self.disk_bps + self.alpha * rate
        self.disk_measured += 1

    def observe_encode(self, tokens: int, seconds: float) -> None:
        """One encode forward of ``tokens`` tokens took ``seconds`` (synchronised)."""
        if tokens <= 0 or seconds <= 0 or self.forward_s is None:
            return
        per_token = max(seconds - self.forward_s, 0.0) / tokens
        self.token_s = (1 - self.alpha) * self.token_s + self.alpha * per_token
        self.encodes_measured += 1

    def calibrate(self, encode, small: int = 32, large: int = 512, repeats: int = 2, linear: bool = False) -> None:
        """Fit the fixed and per-token encode costs from timed probes: ``encode(n)`` encodes one
        chunk of ``n`` tokens and returns when it is done (after a warm-up of each size); each
        size timed ``repeats`` times, the fastest kept (a probe delayed by other work is not the
        rate). A fit that finds the long probe no slower than the short one (noise: a busy
        machine) takes the long probe's average per token, so that an encode never looks free;
        so does ``linear`` (a device whose forward costs about the same per token at any size, a
        CPU), where the average is a floor on the per-token cost."""
        times = {}
        for n in (small, large):
            encode(n)
            runs = []
            for _ in range(repeats):
                t0 = time.perf_counter()
                encode(n)
                runs.append(time.perf_counter() - t0)
            times[n] = min(runs)
        slope = (times[large] - times[small]) / (large - small)
        average = times[large] / large
        self.token_s = max(slope, average) if linear or slope <= 0 else slope
        self.token_s = max(self.token_s, 1e-9)
        self.forward_s = max(times[small] - small * self.token_s, 0.0)
        self.calibration = "measured"

    def calibrate_kept(self, key: str, encode, **probes) -> None:
        """``calibrate``, unless a fit for ``key`` (this machine and model shape) was kept within
        the last day; a fresh fit is kept for the next process."""
        kept = load_calibration(key)
        if kept is not None:
            self.forward_s, self.token_s = kept
            self.calibration = "kept"
            return
        self.calibrate(encode, **probes)
        save_calibration(key, self.forward_s, self.token_s)

    def as_dict(self) -> dict:
        return {"disk_gbps": round(self.disk_bps / 1e9, 3), "disk_reads_measured": self.disk_measured,
                "page_cache_gbps": round(self.page_cache_bps / 1e9, 3),
                "page_cache_reads_measured": self.page_cache_measured,
                "encode_forward_ms": None if self.forward_s is None else round(self.forward_s * 1e3, 3),
                "encode_tokens_per_s": None if not self.token_s else round(1 / self.token_s, 1),
                "encodes_measured": self.encodes_measured, "calibration": self.calibration}


class ReadAlways(ReadOrEncode):
    """Stored KV is always read, never encoded instead: the choice of tensor-parallel ranks,
    which must all make the same one, and the timings the estimates rest on differ from process
    to process (a rank that encodes a chunk its peers read leaves lockstep)."""

    calibrated = True   # (nothing to measure: the probe encodes would be timed per process)

    def __init__(self):
        super().__init__()
        self.calibration = "read always (tensor parallel)"

    def should_encode(self, nbytes: int, tokens: int, batch_tokens: int = 0, cached: bool = False) -> bool:
        return False
