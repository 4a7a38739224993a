"""A disk's write rate on blocks never written before against blocks freed by a deleted file, for
the writeback probe and for the index build's own write path (issue 24).

On the GPU machines a fresh disk writes its new blocks slower than it rewrites freed ones, and
its rate on new blocks drifts as they fill (BENCHMARKS.md, "The store's write path against the disk"). A first
index build writes new blocks, so a probe that rewrites freed ones (index_build.py's probe at the
end) overstates the disk it had, and a probe just before it takes other new blocks than the
build's. This measures the effect without a model, in one folder:

  1. the probe of ``index_build.py`` (``lazy_rag.bench.disk.write_bandwidth``, writeback started
     per block as the store does), 2 GiB, then ``--gib`` kept on disk: new blocks;
  2. the store's build path (``store_write.store_build``: synthetic KV of ``--shape``, batched as
     the GPU build batches it, through ``KVWriter`` and ``ChunkStore``), ``--gib`` kept: new blocks;
  3. the probe again, ``--gib`` kept: new blocks after the store's;
  4. everything deleted; the store path, then the probe, on the freed blocks; the 2 GiB probe.

Run it first thing on a fresh machine (its records say how long the machine had been up); it
needs about 3 x ``--gib`` free.

    python3 benchmarks/disk_blocks.py --gib 16 --out disk_blocks_h100

Records: benchmarks/results/<out>.json, one per step, in order (``t_start_s`` from the first).
"""
from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def uptime_s() -> float | None:
    try:
        return float(Path("/proc/uptime").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    ap.add_argument("--shape", default="llama-3.1-8b", help="a model shape of lazy_rag.random_models")
    ap.add_argument("--gib", type=float, default=16.0, help="bytes of each kept probe and store run")
    ap.add_argument("--folder", default=None, help="where to write (default: a temporary folder under /tmp)")
    ap.add_argument("--out", default="disk_blocks")
    ap.add_argument("--results-dir", default=str(ROOT / "benchmarks" / "results"))
    args = ap.parse_args(argv)

    import store_write

    from lazy_rag.bench.disk import write_bandwidth
    from lazy_rag.bench.records import environment, format_table, write_records

    kvs = store_write.synthetic_kv(args.shape, 256)
    chunks = max(1, int(args.gib * 2**30 // kvs[0].nbytes))
    nbytes = chunks * kvs[0].nbytes
    parent = Path(args.folder or tempfile.mkdtemp(prefix="disk-blocks-"))
    parent.mkdir(parents=True, exist_ok=True)
    if shutil.disk_usage(parent).free < 3.2 * nbytes:
        raise SystemExit(f"needs {3.2 * nbytes / 1e9:.0f} GB free in {parent} (three kept writes of --gib); "
                         f"has {shutil.disk_usage(parent).free / 1e9:.0f} GB: lower --gib")
    base = {"benchmark": "disk_blocks", **environment(), "shape": args.shape, "uptime_at_start_s": uptime_s(),
            "disk": str(parent)}
    out = Path(args.results_dir) / f"{args.out}.json"
    records: list[dict] = []
    t0 = time.perf_counter()

    def add(mode: str, blocks: str, gbytes: float, gbps: float, started: float, **extra) -> None:
        records.append({**base, "mode": mode, "blocks": blocks, "gbytes": round(gbytes / 1e9, 2),
                        "write_gbps": round(gbps, 3), "t_start_s": round(started - t0, 1),
                        "free_gb_after": round(shutil.disk_usage(parent).free / 1e9, 1), **extra})
        write_records(out, records)
        print({k: records[-1][k] for k in ("mode", "blocks", "gbytes", "write_gbps", "t_start_s")}, flush=True)

    def probe(name: str, blocks: str, size: int, keep: bool) -> None:
        folder = parent / name
        folder.mkdir()
        started = time.perf_counter()
        add("probe_writeback", blocks, size, write_bandwidth(folder, nbytes=size, start_writeback=True, keep=keep), started)

    def store(name: str, blocks: str) -> None:
        folder = parent / name
        folder.mkdir()
        started = time.perf_counter()
        b = store_write.store_build(folder, kvs, chunks, 256, 16384)
        add("store_build_path", blocks, b["bytes"], b["bytes"] / b["seconds"] / 1e9, started,
            **{k: v for k, v in b.items() if k not in ("seconds", "bytes")})

    try:
        probe("p0", "new", 2 << 30, keep=False)
        probe("p1", "new", nbytes, keep=True)
        store("s1", "new, after the probe's")
        probe("p2", "new, after the store's", nbytes, keep=True)
        for name in ("p1", "s1", "p2"):
            shutil.rmtree(parent / name)
        os.sync()
        store("s2", "freed")
        probe("p3", "freed", nbytes, keep=False)
        probe("p4", "freed", 2 << 30, keep=False)
    finally:
        if args.folder is None:
            shutil.rmtree(parent, ignore_errors=True)
    print("\n" + format_table(records, ["mode", "blocks", "gbytes", "write_gbps", "t_start_s"]))
    print(f"-> {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
