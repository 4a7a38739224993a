"""PNG figures of a serving-benchmark results file: TTFT vs request rate per system, GPU chunk hit
ratio vs KV budget, offline throughput vs KV budget. A run comparing shared_chunks settings
(``--shared-chunks auto,off``) draws one line per setting of lazy (``lazy[off]`` dashed).

matplotlib is imported only here, when a plot is made (the GPU image has none: plot afterwards
from the JSON with ``lazy-rag bench plot RESULTS.json``).
"""
from __future__ import annotations

from pathlib import Path

from ..errors import LazyRagError

ORDER = ("lazy", "block", "prefix", "full", "transformers")
STYLE = {"lazy": ("tab:blue", "o"), "block": ("tab:orange", "s"), "prefix": ("tab:green", "^"),
         "full": ("tab:red", "v"), "transformers": ("tab:gray", "x")}


def _pyplot():
    try:
        import matplotlib
    except ImportError:
        raise LazyRagError("Plots need matplotlib: pip install matplotlib (or run with --no-plots and plot "
                           "later with `lazy-rag bench plot RESULTS.json`).") from None
    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    return plt


def with_series(records) -> list[dict]:
    """Copies of the records with ``series``, the line they are drawn on: the mode, with its
    shared_chunks value where the records compare several for that mode (``lazy[auto]``, ``lazy[off]``)."""
    values: dict[str, set] = {}
    for r in records:
        values.setdefault(r["mode"], set()).add(r.get("shared_chunks"))
    return [r | {"series": f"{r['mode']}[{r.get('shared_chunks')}]" if len(values[r["mode"]]) > 1 else r["mode"]}
            for r in records]


def _mode(series: str) -> str:
    return series.split("[", 1)[0]


def _systems(records):
    seen = {r["series"] for r in records}
    return sorted(seen, key=lambda s: (ORDER.index(_mode(s)) if _mode(s) in ORDER else len(ORDER), s))


def _budgets(records):
    return sorted({r["budget_fraction"] for r in records if r.get("budget_fraction") is not None}, reverse=True)


def _style(series):
    return STYLE.get(_mode(series), ("black", "."))


def _line(series) -> dict:
    # the engine without shared-chunk grouping: the mode's colour, dashed, hollow markers
    return dict(linestyle="--", markerfacecolor="none") if series.endswith("[off]") else dict(linestyle="-")


def _title(records) -> str:
    r = records[0]
    pop = f"Zipf({r['zipf_a']:g})" if r.get("popularity") == "zipf" else r.get("popularity", "")
    return (f"{r.get('model')} on {r.get('device')}: {r.get('docs')} docs x {r.get('doc_tokens')} tok, "
            f"k={r.get('k')} {pop}")


def plot_ttft_vs_rate(plt, records, path: Path, stat: str = "p50") -> Path | None:
    rated = [r for r in records if r.get("rate_rps") != "offline"]
    if not rated:
        return None
    budgets = _budgets(rated) or [None]
    fig, axes = plt.subplots(1, len(budgets), figsize=(4.2 * len(budgets) + 1, 3.8), squeeze=False, sharey=True)
    for ax, b in zip(axes[0], budgets):
        for s in _systems(rated):
            # transformers is budget-independent: the same line on every panel
            pts = sorted((r["rate_rps"], r[f"ttft_ms_{stat}"]) for r in rated
                         if r["series"] == s and (r.get("budget_fraction") in (b, None)))
            if pts:
                c, m = _style(s)
                ax.plot(*zip(*pts), marker=m, color=c, label=s, **_line(s))
        ax.set_xlabel("request rate (req/s)")
        ax.set_title("KV budget: all documents" if b == 1 else f"KV budget: {b:.0%} of documents"
                     if b is not None else "")
        ax.set_yscale("log")
        ax.grid(True, which="both", alpha=0.3)
    axes[0][0].set_ylabel(f"TTFT {stat} (ms, log)")
    handles = {lab: h for ax in axes[0] for h, lab in zip(*ax.get_legend_handles_labels())}
    fig.legend(handles.values(), handles.keys(), loc="center right", fontsize=8)
    fig.suptitle(_title(records), fontsize=9)
    fig.tight_layout(rect=(0, 0, 1 - 1.1 / fig.get_figwidth(), 1))  # room for the legend on the right
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def _vs_budget(plt, records, path: Path, key: str, ylabel: str, flat_baselines: bool) -> Path | None:
    # one value per (system, budget): the offline point if there is one, else the lowest rate
    def pick(rs):
        off = [r for r in rs if r.get("rate_rps") == "offline"]
        return off[0] if off else min(rs, key=lambda r: r["rate_rps"])

    budgeted = [r for r in records if r.get("budget_fraction") is not None and r.get(key) is not None]
    if not budgeted:
        return None
    fig, ax = plt.subplots(figsize=(5.5, 3.8))
    for s in _systems(budgeted):
        pts = []
        for b in _budgets(budgeted):
            rs = [r for r in budgeted if r["series"] == s and r["budget_fraction"] == b]
            if rs:
                pts.append((b, pick(rs)[key]))
        c, m = _style(s)
        ax.plot(*zip(*sorted(pts)), marker=m, color=c, label=s, **_line(s))
    if flat_baselines:
        for s in _systems(records):
            rs = [r for r in records
                  if r["series"] == s and r.get("budget_fraction") is None and r.get(key) is not None]
            if rs:
                c, _m = _style(s)
                ax.axhline(pick(rs)[key], color=c, linestyle="--", label=f"{s} (no KV reuse)")
    ax.set_xlabel("KV budget (fraction of documents that fit)")
    ax.set_ylabel(ylabel)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    ax.set_title(_title(records), fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def plot_results(records: list[dict], out_dir: Path, name: str) -> list[Path]:
    """Write ``<name>_ttft_vs_rate.png``, ``<name>_hit_ratio_vs_budget.png`` and
    ``<name>_throughput_vs_budget.png`` (each only when the records have its data)."""
    if not records:
        raise LazyRagError("No records to plot.")
    plt = _pyplot()
    records = with_series(records)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    made = [plot_ttft_vs_rate(plt, records, out_dir / f"{name}_ttft_vs_rate.png"),
            _vs_budget(plt, records, out_dir / f"{name}_hit_ratio_vs_budget.png", "gpu_hit_ratio",
                       "GPU-pool chunk hit ratio", flat_baselines=False),
            _vs_budget(plt, records, out_dir / f"{name}_throughput_vs_budget.png", "throughput_rps",
                       "throughput at saturation (req/s)", flat_baselines=True)]
    return [p for p in made if p is not None]
