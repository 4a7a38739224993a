"""An index build's GPU kernels compiled from the model's config, in a process of their own, while
this process loads the model's weights.

A machine's first build compiles its encode kernel (``kernels.prefill_runs``, ~2.5 s of Triton
compile and ~1 s of Triton's one-time setup on an H100) and the kernels of its encode calibration
(~2 s more) while the disk waits: on the 8B shape that kept most first builds under 70% of the
disk's write bandwidth, against 74-106% for a machine's second build, whose kernels Triton's cache
on disk already held (BENCHMARKS.md, sessions 28-29). ``EncodeWarmup`` can only start once the
model is loaded, and inside one process a compile holds the GIL against the load.

A Triton kernel's compiled variant depends on the attention's shape and dtypes (heads, KV heads,
head dim, the KV dtype, the page size), never on the number of layers or the weights. So a child
process builds a one-layer model of the same config with random weights, runs the build's encode
warm-up and calibration probes on it, and exits; the compiled kernels land in Triton's cache on
disk, where the build's own warm-up finds them. ``EncodeWarmup`` waits for a child still running
(``wait_in_flight``) rather than compiling the same kernel beside it, and stops one still
starting (``BuildPrecompile``).

It runs on CUDA only; ``LAZY_RAG_PRECOMPILE=off`` turns it off. A child that fails is logged and
changes nothing: the build compiles as it did without it.
"""
from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

log = logging.getLogger(__name__)

ENV = "LAZY_RAG_PRECOMPILE"
# the most a build waits for a child: past it the child is stopped and the build compiles itself
# (an H100's child took ~10 s, most of it importing torch and transformers)
WAIT_S = 120.0
_in_flight: list["BuildPrecompile"] = []
_in_flight_lock = threading.Lock()


class BuildPrecompile:
    """A child process compiling a build's kernels (module docstring). ``spec``: the config as a
    dict, the model's dtype, the build's KV dtype, the shared prefix's length, the engine's
    keyword arguments.

    The child names its phase in a file: ``starting`` (importing torch and transformers, creating
    its model: seconds that compile nothing), ``warmup`` (the encode kernel), ``calibration``.
    A build that needs a kernel waits for a child already compiling it, which then has less left
    to do than a compile started anew; a child still starting is stopped instead, and the build
    compiles as it would have without it (a machine whose kernels are cached, with a model that
    loads faster than the child starts, loses nothing)."""

    PHASES = ("starting", "warmup", "calibration", "done")

    def __init__(self, spec: dict, argv: list[str] | None = None):
        self.started = time.perf_counter()
        self.ended: float | None = None
        self.ok: bool | None = None
        self.stopped_in: str | None = None  # the phase it was stopped in, if it was
        self._finish_lock = threading.Lock()
        self._dir = Path(tempfile.mkdtemp(prefix="lazy-rag-precompile-"))
        (self._dir / "spec.json").write_text(json.dumps(spec))
        self._log = open(self._dir / "child.log", "wb")
        # the calibration file keeps fits per model shape: the child's one-layer fit is no one's
        env = {**os.environ, "LAZY_RAG_CALIBRATION": "off", ENV: "off"}
        argv = argv or [sys.executable, "-m", "lazy_rag.precompile_child"]  # (tests: a stand-in child)
        self.proc = subprocess.Popen([*argv, str(self._dir)],
                                     stdout=self._log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env)
        with _in_flight_lock:
            _in_flight.append(self)

    @classmethod
    def start(cls, config, *, dtype, kv_dtype, device, prefix_tokens: int = 0,
              engine_kwargs: dict | None = None) -> "BuildPrecompile | None":
        """A child compiling the kernels a build with this model config will run, or None where it
        would not help: not CUDA, or turned off (``LAZY_RAG_PRECOMPILE=off``)."""
        import torch

        if os.environ.get(ENV, "").lower() in ("0", "off", "false", "no"):
            return None
        if torch.device(device).type != "cuda" or not torch.cuda.is_available():
            return None
        spec = {"config": config.to_dict(), "dtype": str(dtype).removeprefix("torch."),
                "kv_dtype": str(kv_dtype).removeprefix("torch."), "device": str(device),
                "prefix_tokens": int(prefix_tokens), "engine": dict(engine_kwargs or {})}
        try:
            return cls(spec)
        except OSError as e:  # no temp dir, no fork: the build compiles as it would have
            log.warning("Could not start compiling the build's kernels in a child process (%s); the build "
                        "compiles them itself.", e)
            return None

    @property
    def seconds(self) -> float | None:
        return None if self.ended is None else self.ended - self.started

    def phase(self) -> str:
        if self.ended is not None:
            return "done"
        try:
            return (self._dir / "phase").read_text() or "starting"
        except OSError:
            return "starting"

    def wait(self, until: str = "calibration", timeout: float = WAIT_S, stop_if_starting: bool = True) -> float:
        """Waits until the child is past phase ``until`` ("warmup": the encode kernel compiled;
        "calibration": all of it), or stops it if it is still starting; the seconds waited. A
        child past ``timeout`` s is stopped too."""
        t0 = time.perf_counter()
        after = self.PHASES.index(until) + 1
        while self.ended is None:
            phase = self.phase()
            if phase == "starting" and stop_if_starting:
                self.stopped_in = phase
                self.close()
                break
            if self.PHASES.index(phase) >= after:
                break
            code = self.proc.poll()
            if code is not None:
                self._finish(code)
                break
            if time.perf_counter() - t0 > timeout:
                log.warning("Compiling the build's kernels in a child process took over %.0f s; stopped it, the "
                            "build compiles them itself.", timeout)
                self.stopped_in = phase
                self.close()
                break
            time.sleep(0.005)
        return time.perf_counter() - t0

    def close(self) -> None:
        """Stops a child still running (the build has no use for it any more)."""
        if self.ended is None:
            self.proc.kill()
            self._finish(self.proc.wait())

    def _finish(self, code: int) -> None:
        with self._finish_lock:  # the warm-up's thread and the build's clean-up may both end it
            if self.ended is not None:
                return
            self._end(code)

    def _end(self, code: int) -> None:
        self.ended = time.perf_counter()
        self.ok = code == 0
        self._log.close()
        if code not in (0, -signal.SIGKILL):
            tail = (self._dir / "child.log").read_text(errors="replace")[-1500:]
            log.warning("Compiling the build's kernels in a child process failed (exit %s); the build compiles "
                        "them itself. Its output ended:\n%s", code, tail)
        shutil.rmtree(self._dir, ignore_errors=True)
        with _in_flight_lock:
            if self in _in_flight:
                _in_flight.remove(self)


def start_for_pretrained(name_or_path: str, *, device="auto", kv_dtype="auto", prefix_ids=None,
                         engine_kwargs: dict | None = None) -> BuildPrecompile | None:
    """``BuildPrecompile.start`` for the model ``LazyLLM.from_pretrained(name_or_path, device)``
    is about to load; ``kv_dtype`` a store's name for it (``store.KV_DTYPE_NAMES``' values, or
    auto); ``prefix_ids(tokenizer)`` the shared prefix's token ids, if the build has one. None if
    the config cannot be read here: the load that follows says why."""
    from transformers import AutoConfig

    from .architecture import check_supported
    from .models import load_tokenizer, resolve_device, resolve_dtype, resolve_model_path

    try:
        dev = resolve_device(device)
        if dev.type != "cuda":
            return None
        path = str(resolve_model_path(name_or_path))
        config = AutoConfig.from_pretrained(path)
        check_supported(config)
        dtype = resolve_dtype("auto", dev)
        prefix = len(prefix_ids(load_tokenizer(path))) if prefix_ids is not None else 0
    except Exception as e:  # noqa: BLE001 - the model's own load reports it
        log.debug("No kernel precompile for %s: %s", name_or_path, e)
        return None
    kv = dtype if kv_dtype == "auto" else kv_dtype
    return BuildPrecompile.start(config, dtype=dtype, kv_dtype=kv, device=dev, prefix_tokens=prefix,
                                 engine_kwargs=engine_kwargs)


def wait_in_flight(until: str = "calibration") -> float:
    """``BuildPrecompile.wait(until)`` for this process's children still running; the seconds
    waited."""
    with _in_flight_lock:
        children = list(_in_flight)
    return sum(child.wait(until) for child in children)
