"""What the xinfer-bench modes share: scenarios, the machine's description, result files, and one
measured online run (warm-up, load, server metrics) turned into a result dict."""
from __future__ import annotations

import argparse
import asyncio
import dataclasses
import datetime as _dt
import json
import os
import platform
import random
import subprocess
import sys
from pathlib import Path

from bench import load, stats

SCENARIOS_DIR = Path(__file__).resolve().parent / "scenarios"


# ---------------------------------------------------------------- scenarios

def scenario_path(name: str) -> Path:
    p = Path(name)
    if p.suffix == ".json" and p.is_file():
        return p
    p = SCENARIOS_DIR / f"{name}.json"
    if not p.is_file():
        names = sorted(q.stem for q in SCENARIOS_DIR.glob("*.json"))
        raise SystemExit(f"xinfer-bench: no scenario {name!r}; known: {', '.join(names)} (or a .json path)")
    return p


def load_scenario(name: str) -> dict:
    return json.loads(scenario_path(name).read_text())


# ---------------------------------------------------------------- result files

def machine_info() -> dict:
    cpu, flags = "", ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name") and not cpu:
                cpu = line.split(":", 1)[1].strip()
            if line.startswith("flags") and not flags:
                flags = line
    except OSError:
        pass
    simd = [f for f in ("avx2", "avx512f", "amx_tile") if f" {f}" in flags]
    return {"cpu": cpu or platform.processor(), "cpus": os.cpu_count(), "simd": simd, "platform": platform.platform(),
            "python": platform.python_version()}


def git_commit() -> str | None:
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=Path(__file__).resolve().parent,
                             capture_output=True, text=True, timeout=5, check=False)
        return out.stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def stamp() -> str:
    return _dt.datetime.now().strftime("%Y%m%d-%H%M%S")


def now_iso() -> str:
    return _dt.datetime.now().isoformat(timespec="seconds")


def write_json(path: Path, obj) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(obj, indent=1, default=str) + "\n")


def stem_of(args, kind: str, extra: str = "") -> str:
    if args.result_name:
        return args.result_name
    sc = Path(args.scenario).stem if getattr(args, "scenario", None) else "custom"
    return f"{kind}-{sc}{extra}-{stamp()}"


def mean(xs):
    xs = [x for x in xs if x is not None]
    return sum(xs) / len(xs) if xs else None


# ---------------------------------------------------------------- online load

def check_url(url: str) -> None:
    if not url.startswith(("http://", "https://")):
        raise SystemExit(f"xinfer-bench: not an http(s) URL: {url!r}")
    if not load.is_loopback(url):
        print(f"xinfer-bench: note: {url} is not a loopback address; sending load there as you asked",
              file=sys.stderr)


def text_maker(args):
    # --tokenizer auto sizes random prompts only; dataset prompts are counted in words unless one is named.
    return load.load_text_maker(args.tokenizer if args.dataset == "random" or args.tokenizer != "auto" else "words")


def make_source(args, maker):
    if args.dataset == "random":
        return load.RandomPrompts(maker, args.input_len, args.output_len or 128, args.range_ratio, args.seed,
                                  args.shared_prefix_groups, args.shared_prefix_len)
    if not args.dataset_path:
        raise SystemExit("xinfer-bench: --dataset jsonl/sharegpt needs --dataset-path")
    out_len = args.output_len or (128 if args.dataset == "jsonl" else 0)
    return load.load_dataset(args.dataset_path, args.dataset, maker, out_len, args.seed)


def load_config(args, base_url: str, model: str) -> load.LoadConfig:
    num = args.num_requests
    if num is None and args.duration is None:
        num = 32
    return load.LoadConfig(base_url=base_url, model=model, endpoint=args.endpoint, stream=args.stream,
                           exact=args.exact, temperature=args.temperature, concurrency=args.concurrency,
                           request_rate=args.request_rate, arrival=args.arrival, num_requests=num,
                           duration=args.duration, timeout=args.request_timeout,
                           extra_body=getattr(args, "extra_body", None) or {})


def with_seed(args, seed: int) -> argparse.Namespace:
    return argparse.Namespace(**{**vars(args), "seed": seed})


def server_pid(base_url: str) -> int | None:
    """The root of the process tree serving a loopback URL, or None: the process listening on its
    port, or its parent when that is xinfer's supervisor (xinfer's API listens, but the scheduler
    and the worker are its siblings under xinfer::launch)."""
    import psutil
    from urllib.parse import urlsplit
    u = urlsplit(base_url)
    port = u.port or (443 if u.scheme == "https" else 80)
    pid = load.listening_pid(port) if load.is_loopback(base_url) else None
    try:
        parent = psutil.Process(pid).parent() if pid else None
        if parent is not None and parent.cmdline()[:1] == ["xinfer::launch"]:
            return parent.pid
    except psutil.Error:
        pass
    return pid


class WarmupPrompts:
    """Short requests of their own (never sharing a prefix with the measured ones)."""

    def __init__(self, maker, output_len):
        self.maker, self.output_len = maker, max(1, min(16, output_len))

    def get(self, i):
        return load.Request(self.maker.make(random.Random(f"warmup:{i}"), 16), 16, self.output_len)


async def resolve_model(base_url: str, model: str | None) -> str:
    if model:
        return model
    try:
        return await load.first_model(base_url)
    except Exception as e:  # noqa: BLE001
        raise SystemExit(f"xinfer-bench: cannot list models at {base_url}/models ({e}); is the server up? "
                         f"or pass --model")


def percentiles_of(args) -> tuple:
    return tuple(float(x) for x in str(args.percentiles).split(",") if x.strip())


async def measure(args, cfg: load.LoadConfig, source, maker, label: str = "", sampler=None) -> dict:
    """Warm up, then one measured run; returns the result dict (figures + per-request lists)."""
    if args.warmup:
        wcfg = dataclasses.replace(cfg, num_requests=args.warmup, duration=None, request_rate=float("inf"),
                                   concurrency=min(args.warmup, cfg.concurrency or args.warmup))
        recs, _ = await load.run_load(wcfg, WarmupPrompts(maker, source.get(0).output_len))
        bad = [r.error for r in recs if not r.ok]
        if bad:
            print(f"xinfer-bench: {len(bad)} of {len(recs)} warm-up requests failed: {bad[0]}", file=sys.stderr)
    before = await load.scrape_metrics(cfg.base_url)
    progress = load.Progress(cfg.num_requests, cfg.duration, label, enabled=not args.quiet)
    task = None
    if sampler is not None:
        task = asyncio.create_task(sampler())
    try:
        records, duration = await load.run_load(cfg, source, progress)
    finally:
        if task is not None:
            task.cancel()
    after = await load.scrape_metrics(cfg.base_url)
    m = stats.compute_metrics(records, duration, args.slo_ttft, args.slo_tpot, percentiles_of(args))
    m["server_metrics"] = load.metrics_delta(before, after)
    ok = [r for r in records if r.ok]
    bin_s = getattr(args, "sample_interval", None) if args.mode == "soak" else None
    result = {
        "date": now_iso(),
        "base_url": cfg.base_url, "model": cfg.model, "scenario": args.scenario, "tokenizer": maker.name,
        "machine": machine_info(), "commit": git_commit(),
        "config": {**{k: v for k, v in dataclasses.asdict(cfg).items() if k not in ("base_url", "model")},
                   "request_rate": str(cfg.request_rate), "warmup": args.warmup, "dataset": args.dataset,
                   "input_len": args.input_len, "output_len": args.output_len, "range_ratio": args.range_ratio,
                   "shared_prefix_groups": args.shared_prefix_groups, "shared_prefix_len": args.shared_prefix_len,
                   "seed": args.seed},
        "max_concurrency": cfg.concurrency, "request_rate": str(cfg.request_rate),
        **m,
        "output_throughput_series": stats.token_rate_series(ok, duration, bin_s),
        "concurrency_series": stats.concurrency_series(records, duration, bin_s),
        **stats.records_lists(records),
    }
    return result
