"""`xinfer-bench serve`: online load against one server, once or as a sweep."""
from __future__ import annotations

import asyncio
import dataclasses
from pathlib import Path

from bench import stats
from bench.common import (check_url, load_config, make_source, measure, resolve_model, stem_of, text_maker,
                          with_seed, write_json)


def run(args) -> int:
    check_url(args.base_url)
    return asyncio.run(_serve(args, text_maker(args)))


async def _serve(args, maker) -> int:
    model = await resolve_model(args.base_url, args.model)
    out = Path(args.output_dir)
    if not args.sweep:
        cfg = load_config(args, args.base_url, model)
        r = await measure(args, cfg, make_source(args, maker), maker)
        r["mode"] = "serve"
        print(stats.table(r))
        stem = stem_of(args, "serve", f"-c{cfg.concurrency}" if cfg.concurrency else "")
        write_json(out / f"{stem}.json", r)
        files = [out / f"{stem}.json"]
        if args.plots:
            from bench import plots
            title = f"{model} @ {args.base_url}, concurrency {cfg.concurrency or 'unbounded'}"
            files.append(plots.latency_cdfs([("", r)], str(out / f"{stem}-latency.png"), title))
            files.append(plots.throughput_over_time(r, str(out / f"{stem}-throughput.png"), title))
        print("wrote " + ", ".join(map(str, files)))
        return 0 if r["completed"] else 1
    param, _, values = args.sweep.partition("=")
    param = param.strip().replace("-", "_")
    if param not in ("concurrency", "request_rate") or not values:
        raise SystemExit("xinfer-bench: --sweep takes concurrency=1,4,16 or request_rate=0.5,1,2")
    runs = []
    for k, v in enumerate(values.split(",")):
        val = int(v) if param == "concurrency" else float(v)
        cfg = dataclasses.replace(load_config(args, args.base_url, model), **{param: val})
        # Fresh prompts per point (seed + k), so no point rides on the prefix cache of the last one.
        point_args = with_seed(args, args.seed + k)
        r = await measure(point_args, cfg, make_source(point_args, maker), maker, label=f"{param}={v} ")
        r["mode"], r["sweep_param"], r["sweep_value"] = "serve", param, val
        print(stats.table(r, f"{param} = {v}"))
        runs.append(r)
    print(sweep_table(param, runs))
    stem = stem_of(args, "sweep", f"-{param}")
    write_json(out / f"{stem}.json", {"mode": "sweep", "sweep_param": param, "runs": runs})
    files = [out / f"{stem}.json"]
    if args.plots:
        from bench import plots
        files.append(plots.sweep(param, runs, str(out / f"{stem}-sweep.png"), f"{model} @ {args.base_url}"))
        files.append(plots.latency_cdfs([(f"{param}={r['sweep_value']}", r) for r in runs],
                                        str(out / f"{stem}-latency.png")))
    print("wrote " + ", ".join(map(str, files)))
    return 0 if all(r["completed"] for r in runs) else 1


def sweep_table(param: str, runs: list[dict]) -> str:
    cols = ("completed", "failed", "request_throughput", "output_throughput", "median_ttft_ms", "p99_ttft_ms",
            "median_tpot_ms", "median_itl_ms", "p99_e2el_ms")
    lines = [f"{param:>14} " + " ".join(f"{c:>18}" for c in cols)]
    for r in runs:
        lines.append(f"{r['sweep_value']:>14} " + " ".join(f"{stats.fmt(r.get(c)):>18}" for c in cols))
    return "\n".join(lines)
