"""`xinfer-bench compare`: the same load against several servers, in interleaved rounds, as ratios
to the first."""
from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from bench import load, stats
from bench.common import (check_url, git_commit, load_config, machine_info, make_source, mean, measure, now_iso,
                          resolve_model, server_pid, stem_of, text_maker, with_seed, write_json)

COMPARE_KEYS = ("completed", "failed", "request_throughput", "output_throughput", "total_token_throughput",
                "request_goodput", "mean_ttft_ms", "median_ttft_ms", "p99_ttft_ms", "mean_tpot_ms",
                "median_tpot_ms", "p99_tpot_ms", "mean_itl_ms", "median_itl_ms", "p99_itl_ms", "mean_e2el_ms",
                "median_e2el_ms", "p99_e2el_ms", "peak_rss_mb", "idle_rss_mb", "end_rss_mb", "ready_s")


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
    serve = dict(c.partition("=")[::2] for c in args.serve)
    unknown = set(serve) - {n for n, _ in targets}
    if unknown or not all(serve.values()):
        raise SystemExit(f"xinfer-bench: --serve takes NAME=COMMAND for a --target's NAME, got {args.serve!r}")
    return asyncio.run(_compare(args, targets, models, serve, text_maker(args)))


async def _ready(url: str) -> bool:
    """/models answers and /health (xinfer, vLLM and llama-server have it) is not 5xx: xinfer's API and
    llama-server list their model while it is still loading."""
    import aiohttp
    try:
        await load.first_model(url)
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5)) as s:
            async with s.get(load.root_url(url) + "/health") as r:
                return r.status < 500
    except Exception:  # noqa: BLE001 - not up yet
        return False


async def _start(name: str, cmd: str, url: str, log: Path, timeout: float) -> tuple[subprocess.Popen, float]:
    """Run a target's serve command in its own process group and wait until it is ready (_ready);
    returns it and the seconds that took (its load time)."""
    if await _ready(url):  # the measured server would not be the one this command starts
        raise SystemExit(f"xinfer-bench: a server already answers at {url}; stop it or leave out --serve {name}=...")
    print(f"xinfer-bench: starting {name}: {cmd}", file=sys.stderr)
    with open(log, "ab") as f:
        proc = subprocess.Popen(cmd, shell=True, start_new_session=True, stdout=f, stderr=subprocess.STDOUT)
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if proc.poll() is not None:
            _stop(proc)  # what it may have left running in its group
            raise SystemExit(f"xinfer-bench: {name}'s serve command exited ({proc.returncode}) before serving; "
                             f"see {log}")
        if await _ready(url):
            print(f"xinfer-bench: {name} up in {time.monotonic() - t0:.0f} s", file=sys.stderr)
            return proc, time.monotonic() - t0
        await asyncio.sleep(0.5)
    _stop(proc)
    raise SystemExit(f"xinfer-bench: {name} was not ready at {url} within {timeout:g} s; see {log}")


def _group_alive(pgid: int) -> bool:
    """Whether a process of the group still runs (zombies, dead and waiting for init, do not)."""
    import psutil
    for p in psutil.process_iter(["status"]):
        try:
            if os.getpgid(p.pid) == pgid and p.info["status"] != psutil.STATUS_ZOMBIE:
                return True
        except (ProcessLookupError, psutil.Error):
            pass
    return False


def _stop(proc: subprocess.Popen | None) -> None:
    """SIGTERM to the serve command's whole process group, SIGKILL what is left after 60 s."""
    if proc is None:
        return
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            proc.poll()  # reaps the leader
            if not _group_alive(proc.pid):
                return
            time.sleep(0.2)


async def _compare(args, targets, models, serve, maker) -> int:
    # targets with a serve command are up only for their own runs (the others must be up already)
    resolved = {n: (models.get(n) if n in serve else await resolve_model(u, models.get(n))) for n, u in targets}
    out = Path(args.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    runs: dict[str, list[dict]] = {n: [] for n, _ in targets}
    for rep in range(args.repeats):  # interleaved: round r runs every target once, in order
        # Each round sends fresh prompts (seed + round): a round must not hit the prefix cache that
        # the previous one filled. Within a round every target gets the same prompts.
        round_args = with_seed(args, args.seed + rep)
        for name, url in targets:
            proc, ready = await _start(name, serve[name], url, out / f"serve-{name}.log", args.serve_timeout) \
                if name in serve else (None, None)
            try:
                resolved[name] = resolved[name] or await resolve_model(url, None)
                source = make_source(round_args, maker)
                cfg = load_config(args, url, resolved[name])
                label = f"{name} ({rep + 1}/{args.repeats}) " if args.repeats > 1 else f"{name} "
                pid, peak, each = server_pid(url), [], {}
                idle = load.tree_rss(pid) if pid else None  # loaded, before any request

                async def sampler(pid=pid, peak=peak, each=each):
                    while True:
                        by = load.rss_by_process(pid)
                        if by:
                            peak.append(sum(by.values()))
                            for k, v in by.items():
                                each[k] = max(each.get(k, 0), v)
                        await asyncio.sleep(1.0)

                r = await measure(round_args, cfg, source, maker, label=label, sampler=sampler if pid else None)
                end = load.tree_rss(pid) if pid else None
            finally:
                _stop(proc)
            r["mode"], r["target"], r["repeat"] = "serve", name, rep
            # the whole process tree's resident memory: at its highest under this load, loaded and idle
            # before it, and after it; each process's peak by name; the serve command's load time
            mb = lambda b: b / 2**20 if b else None  # noqa: E731
            r["peak_rss_mb"], r["idle_rss_mb"], r["end_rss_mb"] = mb(max(peak) if peak else None), mb(idle), mb(end)
            r["peak_rss_mb_by_process"] = {k: mb(v) for k, v in sorted(each.items())}
            r["ready_s"] = ready
            runs[name].append(r)
    summaries = {n: {k: mean([r.get(k) for r in rs]) for k in COMPARE_KEYS} for n, rs in runs.items()}
    first = targets[0][0]
    ratios = {n: {k: (s[k] / summaries[first][k] if s[k] is not None and summaries[first][k] else None)
                  for k in COMPARE_KEYS} for n, s in summaries.items()}
    print(compare_table([n for n, _ in targets], summaries, ratios))
    stem = stem_of(args, "compare")
    result = {"mode": "compare", "scenario": args.scenario, "date": now_iso(),
              "machine": machine_info(), "commit": git_commit(), "repeats": args.repeats,
              "targets": [{"name": n, "base_url": u, "model": resolved[n], "serve": serve.get(n),
                           "summary": summaries[n], "ratio": ratios[n], "runs": runs[n]} for n, u in targets]}
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
