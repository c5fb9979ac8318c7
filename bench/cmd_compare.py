"""`xinfer-bench compare`: the same load against several servers, in interleaved rounds, as ratios
to the first."""
from __future__ import annotations

import asyncio
from pathlib import Path

from bench import load, stats
from bench.common import (check_url, git_commit, load_config, machine_info, make_source, mean, measure, now_iso,
                          resolve_model, server_pid, stem_of, text_maker, with_seed, write_json)

COMPARE_KEYS = ("completed", "failed", "request_throughput", "output_throughput", "total_token_throughput",
                "request_goodput", "mean_ttft_ms", "median_ttft_ms", "p99_ttft_ms", "mean_tpot_ms",
                "median_tpot_ms", "p99_tpot_ms", "mean_itl_ms", "median_itl_ms", "p99_itl_ms", "mean_e2el_ms",
                "median_e2el_ms", "p99_e2el_ms", "peak_rss_mb")


def run(args) -> int:
    targets = []
    for t in args.target:
        name, sep, url = t.partition("=")
        if not sep or not name or not url:
            raise SystemExit(f"xinfer-bench: --target takes NAME=URL, got {t!r}")
        check_url(url)
        targets.append((name, url))
    if len({n for n, _ in targets}) != len(targets):
        raise SystemExit("xinfer-bench: --target names must differ")
    models = dict(m.partition("=")[::2] for m in args.target_model)
    return asyncio.run(_compare(args, targets, models, text_maker(args)))


async def _compare(args, targets, models, maker) -> int:
    resolved = [(n, u, await resolve_model(u, models.get(n))) for n, u in targets]
    runs: dict[str, list[dict]] = {n: [] for n, _ in targets}
    for rep in range(args.repeats):  # interleaved: round r runs every target once, in order
        # Each round sends fresh prompts (seed + round): a round must not hit the prefix cache that
        # the previous one filled. Within a round every target gets the same prompts.
        round_args = with_seed(args, args.seed + rep)
        for name, url, model in resolved:
            source = make_source(round_args, maker)
            cfg = load_config(args, url, model)
            label = f"{name} ({rep + 1}/{args.repeats}) " if args.repeats > 1 else f"{name} "
            pid, peak = server_pid(url), []

            async def sampler(pid=pid, peak=peak):
                while True:
                    rss = load.tree_rss(pid)
                    if rss is not None:
                        peak.append(rss)
                    await asyncio.sleep(1.0)

            r = await measure(round_args, cfg, source, maker, label=label, sampler=sampler if pid else None)
            r["mode"], r["target"], r["repeat"] = "serve", name, rep
            # the whole process tree's resident memory, at its highest under this load
            r["peak_rss_mb"] = max(peak) / 2**20 if peak else None
            runs[name].append(r)
    summaries = {n: {k: mean([r.get(k) for r in rs]) for k in COMPARE_KEYS} for n, rs in runs.items()}
    first = targets[0][0]
    ratios = {n: {k: (s[k] / summaries[first][k] if s[k] is not None and summaries[first][k] else None)
                  for k in COMPARE_KEYS} for n, s in summaries.items()}
    print(compare_table([n for n, _ in targets], summaries, ratios))
    out = Path(args.output_dir)
    stem = stem_of(args, "compare")
    result = {"mode": "compare", "scenario": args.scenario, "date": now_iso(),
              "machine": machine_info(), "commit": git_commit(), "repeats": args.repeats,
              "targets": [{"name": n, "base_url": u, "model": m, "summary": summaries[n], "ratio": ratios[n],
                           "runs": runs[n]} for n, u, m in resolved]}
    write_json(out / f"{stem}.json", result)
    files = [out / f"{stem}.json"]
    if args.plots:
        from bench import plots
        names = [n for n, _ in targets]
        files.append(plots.compare(names, [summaries[n] for n in names], str(out / f"{stem}-compare.png"),
                                   f"scenario {args.scenario or 'custom'}: ratio to {first}"))
        files.append(plots.latency_cdfs([(n, runs[n][-1]) for n in names], str(out / f"{stem}-latency.png")))
    print("wrote " + ", ".join(map(str, files)))
    return 0 if all(s["completed"] for s in summaries.values()) else 1


def compare_table(names, summaries, ratios) -> str:
    w = max(22, *(len(n) + 2 for n in names))
    lines = [f"{'figure':<24}" + "".join(f"{n:>{w}}" for n in names)]
    for k in COMPARE_KEYS:
        row = f"{k:<24}"
        for j, n in enumerate(names):
            v = summaries[n][k]
            cell = stats.fmt(v)
            if j and ratios[n][k] is not None:
                cell += f" ({ratios[n][k]:.2f}x)"
            row += f"{cell:>{w}}"
        lines.append(row)
    return "\n".join(lines)
