"""Full disks, with figures: index updates on a small tmpfs filled to a random level first.

Each trial builds an index of two documents on a fresh tmpfs, adds a third document, fills the
disk with a ballast file so that between 0 and 1.5x the update's estimated KV bytes stay free,
and runs the update. Outcomes: it fits (success), the free-space check refuses it before writing
(clean error), or a write fails with ENOSPC anyway (clean error). Every other trial turns the
free-space check off (as if another process filled the disk after it ran), so that the ENOSPC
path itself is exercised. After a refusal or failure the
previous index must load, pass `verify_index`, hold the same chunk table, and have no temp file
or stray KV file; after removing the ballast the update must succeed. Needs root (mount).
Writes benchmarks/results/reliability_disk_full.json.

    sudo python benchmarks/reliability_disk_full.py --trials 50
"""
import argparse
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

from lazy_rag import LazyIndex, LazyLLM  # noqa: E402
from lazy_rag.embedder import Embedder  # noqa: E402
from lazy_rag.errors import LazyIndexError  # noqa: E402
from lazy_rag.index import build as index_build  # noqa: E402
from lazy_rag.index import verify_index  # noqa: E402

CORPUS = Path(__file__).resolve().parents[1] / "examples" / "corpus"
OPTS = dict(chunk_size=64, chunk_overlap=8, kv_dtype="bfloat16", progress=False)


def table(out: Path) -> str:
    m = json.loads((out / "manifest.json").read_text())
    return (out / m["chunks_file"]).read_text()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--trials", type=int, default=50)
    p.add_argument("--size-mb", type=int, default=24)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=Path("benchmarks/results/reliability_disk_full.json"))
    a = p.parse_args()
    rng = random.Random(a.seed)
    llm, emb = LazyLLM.from_pretrained("smollm2", device="cpu"), Embedder()
    docs = sorted(p for p in CORPUS.iterdir() if p.suffix in (".md", ".txt"))
    per_token = llm.shape.kv_bytes_per_token * 2  # bf16
    new_tokens = len(llm.tokenizer(docs[2].read_text()).input_ids)
    need = new_tokens * per_token
    counts = {"trials": 0, "succeeded": 0, "refused_before_writing": 0, "enospc_clean_error": 0,
              "other_error": 0, "previous_index_intact": 0, "debris_left": 0, "retry_succeeded": 0}
    mnt = Path(tempfile.mkdtemp(prefix="lazy-rag-tmpfs-"))
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={a.size_mb}m", "tmpfs", str(mnt)], check=True)
    try:
        for t in range(a.trials):
            for q in mnt.iterdir():
                shutil.rmtree(q) if q.is_dir() else q.unlink()
            src, out = mnt / "docs", mnt / "idx"
            src.mkdir()
            for d in docs[:2]:
                shutil.copy(d, src / d.name)
            LazyIndex.build([src], out, llm=llm, embedder=emb, **OPTS)
            before = table(out)
            shutil.copy(docs[2], src / docs[2].name)
            leave = int(rng.uniform(0, 1.5) * need)
            free = shutil.disk_usage(mnt).free
            with open(mnt / "ballast", "wb") as f:
                f.truncate(0)
                f.write(b"\0" * max(free - leave, 0))
            counts["trials"] += 1
            check = index_build.check_free_space
            if t % 2:
                index_build.check_free_space = lambda *args, **kw: None
            try:
                LazyIndex.build([src], out, llm=llm, embedder=emb, **OPTS)
                counts["succeeded"] += 1
                continue
            except LazyIndexError as e:
                kind = "refused_before_writing" if "needs" in str(e) and "free" in str(e) else "enospc_clean_error"
                counts[kind] += 1
            except Exception as e:  # anything else is a defect
                counts["other_error"] += 1
                print(f"trial {t}: {type(e).__name__}: {e}", file=sys.stderr)
            finally:
                index_build.check_free_space = check
            (mnt / "ballast").unlink()
            LazyIndex.load(out, llm=llm, embedder=emb)
            report = verify_index(out)
            counts["previous_index_intact"] += int(report["ok"] and table(out) == before)
            counts["debris_left"] += int(report["temp_files"] > 0 or report["stray_kv_files"] > 0)
            LazyIndex.build([src], out, llm=llm, embedder=emb, **OPTS)
            counts["retry_succeeded"] += int(verify_index(out)["ok"] and table(out) != before)
    finally:
        subprocess.run(["umount", str(mnt)], check=False)
        mnt.rmdir()
    failures = counts["trials"] - counts["succeeded"]
    record = {"benchmark": "reliability_disk_full", "mode": "update on a filled tmpfs", "device": "cpu",
              "model": "smollm2", "kv_dtype": "bfloat16", "tmpfs_mb": a.size_mb, "update_kv_bytes": need,
              "torch": torch.__version__, "seed": a.seed, **counts, "date": time.strftime("%Y-%m-%d")}
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps([record], indent=1) + "\n")
    print("| trials | fit | refused before writing | ENOSPC, clean error | other error | previous intact | "
          "debris | retry ok |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|")
    print(f"| {counts['trials']} | {counts['succeeded']} | {counts['refused_before_writing']} | "
          f"{counts['enospc_clean_error']} | {counts['other_error']} | {counts['previous_index_intact']}/{failures} | "
          f"{counts['debris_left']} | {counts['retry_succeeded']}/{failures} |")
    ok = (counts["other_error"] == 0 and counts["previous_index_intact"] == failures and counts["debris_left"] == 0
          and counts["retry_succeeded"] == failures)
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
