"""Benchmark records: the environment they were measured in, JSON files, a text table.

A results file is a JSON list of flat records (one per measured case and system), the format of
every file in ``benchmarks/results/``.
"""
from __future__ import annotations

import datetime as _dt
import json
import os
import platform
from pathlib import Path


def environment() -> dict:
    import torch
    import transformers

    dev = torch.cuda.get_device_name(0) if torch.cuda.is_available() else f"cpu ({torch.get_num_threads()} threads)"
    return {"device": dev, "torch": torch.__version__, "transformers": transformers.__version__,
            "python": platform.python_version(), "date": _dt.date.today().isoformat()}


def write_records(path: Path, records: list[dict]) -> Path:
    """Write atomically (temp file + rename): a run cut off while writing keeps the previous file."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(records, indent=1) + "\n")
    os.replace(tmp, path)
    return path


def load_records(path: Path) -> list[dict]:
    from ..errors import LazyRagError

    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError) as e:
        raise LazyRagError(f"Cannot read benchmark records from {path}: {e}") from e
    if not isinstance(data, list) or not all(isinstance(r, dict) for r in data):
        raise LazyRagError(f"{path} is not a list of flat records (a `lazy-rag bench` results file).")
    return data


def fmt(v) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.2f}" if abs(v) < 1000 else f"{v:.0f}"
    return str(v)


def format_table(records: list[dict], columns: list[str]) -> str:
    """A plain aligned text table (no rich: the GPU image has none)."""
    widths = [max(len(c), *(len(fmt(r.get(c))) for r in records)) if records else len(c) for c in columns]
    lines = ["  ".join(c.ljust(w) for c, w in zip(columns, widths))]
    lines += ["  ".join(fmt(r.get(c)).ljust(w) for c, w in zip(columns, widths)) for r in records]
    return "\n".join(lines)

