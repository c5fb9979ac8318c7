"""`xinfer-bench soak`: constant load for a long time; fails on throughput loss of requests or on the
server's memory growing."""
from __future__ import annotations

import asyncio
import sys
import time
from pathlib import Path

from bench import load, stats
from bench.common import (check_url, load_config, make_source, mean, measure, resolve_model, server_pid, stem_of,
                          text_maker, write_json)


def run(args) -> int:
    check_url(args.base_url)
    if args.duration is None or args.duration <= 0:
        raise SystemExit("xinfer-bench: soak needs --duration > 0")
    return asyncio.run(_soak(args, text_maker(args)))


def rss_growth(samples: list[tuple[float, int]]) -> tuple[float | None, float | None]:
    """(growth in MiB, slope in MiB/min) of the server's memory after its first fifth (warming up):
    the median of the last quarter of samples against the median of the first quarter."""
    if len(samples) < 4:
        return None, None
    t_end = samples[-1][0]
    steady = [(t, b / 2**20) for t, b in samples if t >= t_end * 0.2] or [(t, b / 2**20) for t, b in samples]
    q = max(1, len(steady) // 4)
    growth = stats.percentile([m for _, m in steady[-q:]], 50) - stats.percentile([m for _, m in steady[:q]], 50)
    n = len(steady)
    mt = sum(t for t, _ in steady) / n
    mm = sum(m for _, m in steady) / n
    var = sum((t - mt) ** 2 for t, _ in steady)
    slope = sum((t - mt) * (m - mm) for t, m in steady) / var * 60 if var > 0 else 0.0
    return growth, slope


async def _soak(args, maker) -> int:
    model = await resolve_model(args.base_url, args.model)
    source = make_source(args, maker)
    cfg = load_config(args, args.base_url, model)
    pid = args.server_pid or server_pid(args.base_url)
    if pid is None:
        print("xinfer-bench: server process not found (pass --server-pid): memory is not watched", file=sys.stderr)
    samples: list[tuple[float, int]] = []
    t_start = [time.perf_counter()]

    async def sampler():
        t_start[0] = time.perf_counter()
        while True:
            rss = load.tree_rss(pid) if pid else None
            if rss is not None:
                samples.append((time.perf_counter() - t_start[0], rss))
            await asyncio.sleep(args.sample_interval)

    r = await measure(args, cfg, source, maker, label="soak ", sampler=sampler if pid else None)
    if pid:
        rss = load.tree_rss(pid)
        if rss is not None:
            samples.append((time.perf_counter() - t_start[0], rss))
    series = [v for _, v in r["output_throughput_series"]]
    full = series[:-1] if len(series) > 3 else series  # the last bin is partial
    third = max(1, len(full) // 3)
    first_tp, last_tp = mean(full[:third]), mean(full[-third:])
    drift = (last_tp - first_tp) / first_tp * 100 if first_tp else None
    growth, slope = rss_growth(samples)
    n_all = r["completed"] + r["failed"]
    err_rate = r["failed"] / n_all if n_all else 1.0
    problems = []
    if growth is not None and growth > args.max_rss_growth_mb and slope and slope > 0:
        problems.append(f"server memory grew {growth:.1f} MiB after warming up ({slope:.2f} MiB/min)")
    if err_rate > args.max_error_rate:
        problems.append(f"{r['failed']} of {n_all} requests failed ({err_rate:.1%})")
    if not r["completed"]:
        problems.append("no request completed")
    r.update({"mode": "soak", "server_pid": pid, "rss_samples": samples,
              "rss_start_mb": samples[0][1] / 2**20 if samples else None,
              "rss_end_mb": samples[-1][1] / 2**20 if samples else None,
              "rss_max_mb": max(b for _, b in samples) / 2**20 if samples else None,
              "rss_growth_mb": growth, "rss_slope_mb_per_min": slope,
              "throughput_first_third": first_tp, "throughput_last_third": last_tp, "throughput_drift_pct": drift,
              "error_rate": err_rate, "passed": not problems, "problems": problems})
    print(stats.table(r, "Soak"))
    print(f"throughput drift: {stats.fmt(drift)}% (first third {stats.fmt(first_tp)} tok/s, "
          f"last third {stats.fmt(last_tp)} tok/s)")
    if samples:
        print(f"server RSS: start {r['rss_start_mb']:.1f} MiB, end {r['rss_end_mb']:.1f} MiB, "
              f"max {r['rss_max_mb']:.1f} MiB, growth after warm-up {stats.fmt(growth)} MiB "
              f"({stats.fmt(slope)} MiB/min)")
    print("SOAK PASSED" if not problems else "SOAK FAILED: " + "; ".join(problems))
    out = Path(args.output_dir)
    stem = stem_of(args, "soak")
    write_json(out / f"{stem}.json", r)
    files = [out / f"{stem}.json"]
    if args.plots:
        from bench import plots
        files.append(plots.soak(r, str(out / f"{stem}-soak.png"), f"soak: {model} @ {args.base_url}"))
    print("wrote " + ", ".join(map(str, files)))
    return 0 if not problems else 1
