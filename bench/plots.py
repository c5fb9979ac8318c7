"""PNG plots of results (matplotlib, Agg backend; kept small: ~100 dpi, a few hundred KB at most)."""
from __future__ import annotations

import os


def _plt():
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def _cdf(ax, values_ms, label):
    xs = sorted(v for v in values_ms if v is not None)
    if not xs:
        return
    ys = [(i + 1) / len(xs) for i in range(len(xs))]
    ax.step(xs, ys, where="post", label=label)


def _save(fig, path: str) -> str:
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    _plt().close(fig)
    return path


def latency_cdfs(runs: list[tuple[str, dict]], path: str, title: str = "") -> str:
    """TTFT, TPOT, ITL and end-to-end latency CDFs; one line per (label, result)."""
    plt = _plt()
    fig, axes = plt.subplots(2, 2, figsize=(9, 6.5))
    for label, r in runs:
        ok = [e == "" for e in r["errors"]]
        ttft = [t * 1000 for t, g in zip(r["ttfts"], ok) if g and t is not None]
        tpot = [(e - t) * 1000 / (n - 1) for t, e, n, g in zip(r["ttfts"], r["e2els"], r["output_lens"], ok)
                if g and t is not None and n > 1]
        itl = [x * 1000 for xs, g in zip(r["itls"], ok) if g for x in xs]
        e2e = [e * 1000 for e, g in zip(r["e2els"], ok) if g]
        for ax, vals in zip(axes.flat, (ttft, tpot, itl, e2e)):
            _cdf(ax, vals, label)
    for ax, name in zip(axes.flat, ("TTFT", "TPOT (excl. 1st token)", "Inter-token latency", "End-to-end latency")):
        ax.set_title(name)
        ax.set_xlabel("ms")
        ax.set_ylabel("fraction of requests" if name != "Inter-token latency" else "fraction of gaps")
        ax.grid(alpha=0.3)
        if len(runs) > 1 and ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8)
    if title:
        fig.suptitle(title, fontsize=10)
    return _save(fig, path)


def _steps(series, end):
    """[(t, v), ...] per bin -> x, y for a step plot that runs to the end of the last bin."""
    xs, ys = [t for t, _ in series], [v for _, v in series]
    if series:
        xs.append(max(end, xs[-1]))
        ys.append(ys[-1])
    return xs, ys


def throughput_over_time(r: dict, path: str, title: str = "") -> str:
    """Output tokens/s and requests in flight over the run."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(8, 3.8))
    end = r.get("duration") or 0.0
    s = r.get("output_throughput_series") or []
    if s:
        ax.plot(*_steps(s, end), drawstyle="steps-post", color="tab:blue", label="output tok/s")
    ax.set_xlabel("seconds since start")
    ax.set_ylabel("output tokens/s", color="tab:blue")
    ax.grid(alpha=0.3)
    c = r.get("concurrency_series") or []
    if c:
        ax2 = ax.twinx()
        ax2.plot(*_steps(c, end), drawstyle="steps-post", color="tab:orange", alpha=0.7)
        ax2.set_ylabel("requests in flight", color="tab:orange")
        ax2.set_ylim(bottom=0)
    ax.set_ylim(bottom=0)
    ax.set_title(title or "Output tokens/s over time", fontsize=10)
    return _save(fig, path)


def sweep(param: str, runs: list[dict], path: str, title: str = "") -> str:
    """TTFT (median, p99) and output tokens/s against the swept parameter."""
    plt = _plt()
    xs = [r["sweep_value"] for r in runs]
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(9, 3.8))
    a1.plot(xs, [r["median_ttft_ms"] for r in runs], "o-", label="median TTFT")
    a1.plot(xs, [r["p99_ttft_ms"] for r in runs], "s--", label="p99 TTFT")
    a1.plot(xs, [r["median_tpot_ms"] for r in runs], "^-", label="median TPOT")
    a1.set_xlabel(param)
    a1.set_ylabel("ms")
    a1.set_title("Latency against " + param, fontsize=10)
    a1.legend(fontsize=8)
    a2.plot(xs, [r["output_throughput"] for r in runs], "o-", color="tab:green")
    a2.set_xlabel(param)
    a2.set_ylabel("output tokens/s")
    a2.set_title("Throughput against " + param, fontsize=10)
    for a in (a1, a2):
        a.grid(alpha=0.3)
        a.set_ylim(bottom=0)
        if len(xs) > 2 and min(xs) > 0 and max(xs) / min(xs) >= 8:
            a.set_xscale("log", base=2)
    if title:
        fig.suptitle(title, fontsize=10)
    return _save(fig, path)


RATIO_KEYS = ("output_throughput", "request_throughput", "median_ttft_ms", "p99_ttft_ms", "median_tpot_ms",
              "median_itl_ms", "p99_e2el_ms")


def compare(names: list[str], summaries: list[dict], path: str, title: str = "") -> str:
    """Each figure as a ratio to the first target (higher is better for throughput, worse for latency)."""
    plt = _plt()
    keys = [k for k in RATIO_KEYS if summaries[0].get(k)]
    fig, ax = plt.subplots(figsize=(9, 4))
    width = 0.8 / max(1, len(names))
    for j, (name, s) in enumerate(zip(names, summaries)):
        vals = [(s.get(k) or 0.0) / summaries[0][k] for k in keys]
        ax.bar([i + j * width for i in range(len(keys))], vals, width, label=name)
    ax.axhline(1.0, color="gray", lw=0.8)
    ax.set_xticks([i + width * (len(names) - 1) / 2 for i in range(len(keys))])
    ax.set_xticklabels([k.replace("_ms", "") for k in keys], rotation=20, fontsize=8)
    ax.set_ylabel(f"ratio to {names[0]}")
    ax.set_title(title or "Comparison", fontsize=10)
    ax.legend(fontsize=8)
    ax.grid(axis="y", alpha=0.3)
    return _save(fig, path)


def soak(r: dict, path: str, title: str = "") -> str:
    """Output tokens/s and the server's memory over a soak run."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(8, 3.8))
    s = r.get("output_throughput_series") or []
    ax.plot(*_steps(s, r.get("duration") or 0.0), drawstyle="steps-post", color="tab:blue")
    ax.set_xlabel("seconds since start")
    ax.set_ylabel("output tokens/s", color="tab:blue")
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    mem = r.get("rss_samples") or []
    if mem:
        ax2 = ax.twinx()
        ax2.plot([t for t, _ in mem], [b / 2**20 for _, b in mem], "o-", ms=3, color="tab:red")
        ax2.set_ylabel("server RSS (MiB)", color="tab:red")
    ax.set_title(title or "Soak", fontsize=10)
    return _save(fig, path)


def concurrency_curve(series: dict[str, list[tuple[int, float]]], points: dict[str, tuple[int, float]], path: str,
                      title: str = "") -> str:
    """Output tok/s against concurrency, one line per target; `points` are single reference figures
    (e.g. a peer measured elsewhere), drawn as markers."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name, xy in series.items():
        xy = sorted(xy)
        ax.plot([x for x, _ in xy], [y for _, y in xy], marker="o", label=name)
        for x, y in xy:
            ax.annotate(f"{y:.0f}", (x, y), textcoords="offset points", xytext=(0, 6), ha="center", fontsize=8)
    for name, (x, y) in points.items():
        ax.plot([x], [y], marker="*", markersize=12, linestyle="none", label=name)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("concurrent clients")
    ax.set_ylabel("output tok/s")
    ax.grid(alpha=0.3)
    ax.legend()
    ax.set_title(title, fontsize=9)
    return _save(fig, path)
