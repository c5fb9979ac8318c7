"""The `xinfer-bench` command: serve (online load), offline (in-process Engine), compare, soak."""
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
import time
from pathlib import Path

from bench import load, stats

SCENARIOS_DIR = Path(__file__).resolve().parent / "scenarios"
DEFAULT_URL = "http://127.0.0.1:8000/v1"


# ---------------------------------------------------------------- scenarios and arguments

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


def add_load_args(p: argparse.ArgumentParser, url: bool = True) -> None:
    if url:
        p.add_argument("--base-url", default=DEFAULT_URL,
                       help=f"the server's OpenAI base URL (default {DEFAULT_URL}; only loopback unless you say)")
        p.add_argument("--model", default=None, help="model name to send (default: the first of /v1/models)")
    p.add_argument("--scenario", help="a named scenario from bench/scenarios/ (or a .json path); "
                                      "flags given explicitly override it")
    g = p.add_argument_group("load shape")
    g.add_argument("--concurrency", type=int, default=None, help="requests in flight at most (default: no cap)")
    g.add_argument("--request-rate", type=float, default=float("inf"), help="requests/s (default inf: all at once)")
    g.add_argument("--arrival", choices=["poisson", "constant"], default="poisson")
    g.add_argument("--num-requests", type=int, default=None, help="measured requests (default 32)")
    g.add_argument("--duration", type=float, default=None, help="seconds to keep sending new requests")
    g.add_argument("--warmup", type=int, default=1, help="short requests sent first and not counted")
    g.add_argument("--request-timeout", type=float, default=600.0, help="one request's limit, seconds")
    g = p.add_argument_group("prompts")
    g.add_argument("--dataset", choices=["random", "jsonl", "sharegpt"], default="random")
    g.add_argument("--dataset-path", help="the JSONL or ShareGPT file")
    g.add_argument("--input-len", type=int, default=128, help="prompt tokens (random prompts)")
    g.add_argument("--output-len", type=int, default=None,
                   help="max_tokens of each request (default 128; ShareGPT: the recorded reply's length)")
    g.add_argument("--range-ratio", type=float, default=0.0,
                   help="lengths drawn uniformly in [len*(1-r), len*(1+r)]")
    g.add_argument("--shared-prefix-groups", type=int, default=0,
                   help="N groups of requests, each sharing one long system prompt")
    g.add_argument("--shared-prefix-len", type=int, default=0, help="tokens of each group's system prompt")
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--tokenizer", default="auto",
                   help="sizes random prompts: auto (xinfer's bundled model, else words), words, xinfer, "
                        "a tokenizer.json, a folder with one, or a .gguf")
    g = p.add_argument_group("requests")
    g.add_argument("--endpoint", choices=["chat", "completions"], default="chat")
    g.add_argument("--no-stream", dest="stream", action="store_false", help="non-streaming requests")
    g.add_argument("--no-exact", dest="exact", action="store_false",
                   help="don't send ignore_eos/min_tokens (for servers that refuse them)")
    g.add_argument("--temperature", type=float, default=None, help="default: the server's")
    g = p.add_argument_group("results")
    g.add_argument("--slo-ttft", type=float, default=None, help="goodput SLO on TTFT, ms")
    g.add_argument("--slo-tpot", type=float, default=None, help="goodput SLO on TPOT, ms")
    g.add_argument("--percentiles", default="50,90,99")
    g.add_argument("--output-dir", default="bench/results")
    g.add_argument("--result-name", default=None, help="file stem of the results (default: mode-scenario-time)")
    g.add_argument("--no-plots", dest="plots", action="store_false")
    g.add_argument("--quiet", action="store_true", help="no progress bar")


def add_engine_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("engine (EngineConfig; unset: xinfer's defaults)")
    g.add_argument("--m", "--model", dest="model", default=None, help="model (default: the bundled SmolLM2)")
    g.add_argument("--load-format", default=None, choices=["auto", "dummy"])
    for flag, kind in (("--dtype", str), ("--device", str), ("--attention-backend", str), ("--quantization", str),
                       ("--max-num-seqs", int), ("--max-model-len", int), ("--max-num-batched-tokens", int),
                       ("--prefill-chunk-size", int), ("--block-size", int), ("--kv-cache-gb", float),
                       ("--kv-fraction", float)):
        g.add_argument(flag, type=kind, default=None)
    g.add_argument("--disable-prefix-cache", action="store_true")


def build_parser() -> tuple[argparse.ArgumentParser, dict]:
    parser = argparse.ArgumentParser(prog="xinfer-bench",
                                     description="Load tests and benchmarks for xinfer and any OpenAI-compatible server")
    sub = parser.add_subparsers(dest="mode", required=True)
    subs = {}

    s = subs["serve"] = sub.add_parser("serve", help="online load against one server")
    add_load_args(s)
    s.add_argument("--sweep", default=None,
                   help="run a series: concurrency=1,4,16,64 or request_rate=0.5,1,2")
    s.set_defaults(func=cmd_serve)

    c = subs["compare"] = sub.add_parser("compare", help="the same scenario against several servers")
    c.add_argument("--target", action="append", required=True, metavar="NAME=URL",
                   help="a server's OpenAI base URL, repeatable; figures are ratios to the first")
    c.add_argument("--target-model", action="append", default=[], metavar="NAME=MODEL",
                   help="model name to send to a target (default: the first of its /v1/models)")
    c.add_argument("--repeats", type=int, default=1, help="rounds; each round runs every target in turn")
    add_load_args(c, url=False)
    c.set_defaults(func=cmd_compare)

    v = subs["curve"] = sub.add_parser("curve", help="plot output tok/s against concurrency from compare results")
    v.add_argument("results", nargs="+", help="compare JSON files (one per concurrency)")
    v.add_argument("--point", action="append", default=[], metavar="NAME=CONCURRENCY:TOK_S",
                   help="a reference figure to mark, e.g. 'llama.cpp (issue)=1:78'")
    v.add_argument("--output", required=True, help="the PNG to write")
    v.add_argument("--title", default="")
    v.set_defaults(func=cmd_curve)

    k = subs["soak"] = sub.add_parser("soak", help="constant load for a long time; watches drift and memory")
    add_load_args(k)
    k.add_argument("--sample-interval", type=float, default=5.0, help="seconds between memory samples")
    k.add_argument("--server-pid", type=int, default=None,
                   help="the server's PID (default: the process listening on the URL's port)")
    k.add_argument("--max-rss-growth-mb", type=float, default=64.0,
                   help="fail when the server's memory grows more than this after warming up")
    k.add_argument("--max-error-rate", type=float, default=0.01, help="fail above this share of failed requests")
    k.set_defaults(func=cmd_soak, duration=600.0, concurrency=8)

    o = subs["offline"] = sub.add_parser("offline", help="in-process Engine throughput, no HTTP")
    add_engine_args(o)
    o.add_argument("--scenario", help="a named scenario (its 'offline' section)")
    o.add_argument("--num-seqs", type=int, default=256)
    o.add_argument("--min-input-len", type=int, default=100)
    o.add_argument("--max-input-len", type=int, default=1024)
    o.add_argument("--min-output-len", type=int, default=100)
    o.add_argument("--max-output-len", type=int, default=1024)
    o.add_argument("--batch", type=int, default=None,
                   help="original xInfer shape: N copies of one --input-len prompt, each generating --max-tokens "
                        "(clipped to fit --max-model-len)")
    o.add_argument("--input-len", type=int, default=16, help="prompt tokens in --batch mode")
    o.add_argument("--max-tokens", type=int, default=1024, help="tokens per sequence in --batch mode")
    o.add_argument("--temperature", type=float, default=0.6)
    o.add_argument("--seed", type=int, default=0)
    o.add_argument("--output-dir", default="bench/results")
    o.add_argument("--result-name", default=None)
    o.add_argument("--no-plots", dest="plots", action="store_false")
    o.add_argument("--quiet", action="store_true")
    o.set_defaults(func=cmd_offline)
    return parser, subs


def parse_args(argv=None) -> argparse.Namespace:
    """Parse twice: a scenario's values become the defaults, so explicit flags still win."""
    parser, subs = build_parser()
    args = parser.parse_args(argv)
    if getattr(args, "scenario", None):
        sc = load_scenario(args.scenario)
        section = sc.get("offline" if args.mode == "offline" else "serve")
        if section is None:
            raise SystemExit(f"xinfer-bench: scenario {args.scenario!r} has no {args.mode!r} section")
        sub = subs[args.mode]
        known = {a.dest for a in sub._actions}
        bad = sorted(set(section) - known)
        if bad:
            raise SystemExit(f"xinfer-bench: scenario {args.scenario!r}: unknown keys {bad}")
        if args.mode == "soak":
            section = {k: v for k, v in section.items() if k not in ("num_requests",)}  # soak runs on time
        sub.set_defaults(**section)
        args = parser.parse_args(argv)
    return args


# ---------------------------------------------------------------- helpers

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


def write_json(path: Path, obj) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(obj, indent=1, default=str) + "\n")


def percentiles_of(args) -> tuple:
    return tuple(float(x) for x in str(args.percentiles).split(",") if x.strip())


def check_url(url: str) -> None:
    if not url.startswith(("http://", "https://")):
        raise SystemExit(f"xinfer-bench: not an http(s) URL: {url!r}")
    if not load.is_loopback(url):
        print(f"xinfer-bench: note: {url} is not a loopback address; sending load there as you asked",
              file=sys.stderr)


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
                           duration=args.duration, timeout=args.request_timeout)


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
        "date": _dt.datetime.now().isoformat(timespec="seconds"),
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


def stem_of(args, kind: str, extra: str = "") -> str:
    if args.result_name:
        return args.result_name
    sc = Path(args.scenario).stem if getattr(args, "scenario", None) else "custom"
    return f"{kind}-{sc}{extra}-{stamp()}"


# ---------------------------------------------------------------- modes

def cmd_serve(args) -> int:
    check_url(args.base_url)
    maker = load.load_text_maker(args.tokenizer if args.dataset == "random" or args.tokenizer != "auto" else "words")
    return asyncio.run(_serve(args, maker))


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
        point_args = argparse.Namespace(**{**vars(args), "seed": args.seed + k})
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


COMPARE_KEYS = ("completed", "failed", "request_throughput", "output_throughput", "total_token_throughput",
                "request_goodput", "mean_ttft_ms", "median_ttft_ms", "p99_ttft_ms", "mean_tpot_ms",
                "median_tpot_ms", "p99_tpot_ms", "mean_itl_ms", "median_itl_ms", "p99_itl_ms", "mean_e2el_ms",
                "median_e2el_ms", "p99_e2el_ms", "peak_rss_mb")


def cmd_compare(args) -> int:
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
    maker = load.load_text_maker(args.tokenizer if args.dataset == "random" or args.tokenizer != "auto" else "words")
    return asyncio.run(_compare(args, targets, models, maker))


async def _compare(args, targets, models, maker) -> int:
    resolved = [(n, u, await resolve_model(u, models.get(n))) for n, u in targets]
    runs: dict[str, list[dict]] = {n: [] for n, _ in targets}
    for rep in range(args.repeats):  # interleaved: round r runs every target once, in order
        # Each round sends fresh prompts (seed + round): a round must not hit the prefix cache that
        # the previous one filled. Within a round every target gets the same prompts.
        round_args = argparse.Namespace(**{**vars(args), "seed": args.seed + rep})
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
    summaries = {n: {k: _mean([r.get(k) for r in rs]) for k in COMPARE_KEYS} for n, rs in runs.items()}
    first = targets[0][0]
    ratios = {n: {k: (s[k] / summaries[first][k] if s[k] is not None and summaries[first][k] else None)
                  for k in COMPARE_KEYS} for n, s in summaries.items()}
    print(compare_table([n for n, _ in targets], summaries, ratios))
    out = Path(args.output_dir)
    stem = stem_of(args, "compare")
    result = {"mode": "compare", "scenario": args.scenario, "date": _dt.datetime.now().isoformat(timespec="seconds"),
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


def _mean(xs):
    xs = [x for x in xs if x is not None]
    return sum(xs) / len(xs) if xs else None


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


def cmd_soak(args) -> int:
    check_url(args.base_url)
    if args.duration is None or args.duration <= 0:
        raise SystemExit("xinfer-bench: soak needs --duration > 0")
    maker = load.load_text_maker(args.tokenizer if args.dataset == "random" or args.tokenizer != "auto" else "words")
    return asyncio.run(_soak(args, maker))


def cmd_curve(args) -> int:
    from bench import plots
    series: dict[str, list[tuple[int, float]]] = {}
    for f in args.results:
        r = json.loads(Path(f).read_text())
        if r.get("mode") != "compare":
            raise SystemExit(f"xinfer-bench: {f} is not a compare result")
        for t in r["targets"]:
            conc = t["runs"][0].get("max_concurrency") if t["runs"] else None
            if conc and t["summary"]["output_throughput"] is not None:
                series.setdefault(t["name"], []).append((conc, t["summary"]["output_throughput"]))
    points = {}
    for p in args.point:
        name, sep, rest = p.rpartition("=")
        conc, sep2, val = rest.partition(":")
        if not sep or not sep2:
            raise SystemExit(f"xinfer-bench: --point takes NAME=CONCURRENCY:TOK_S, got {p!r}")
        points[name] = (int(conc), float(val))
    print("wrote " + plots.concurrency_curve(series, points, args.output, args.title))
    return 0


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
    first_tp, last_tp = _mean(full[:third]), _mean(full[-third:])
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


def cmd_offline(args) -> int:
    import logging
    logging.basicConfig(level=logging.WARNING)
    from xinfer import Engine, EngineConfig, SamplingParams

    kw = {k: getattr(args, k) for k in ("model", "load_format", "dtype", "device", "attention_backend", "quantization",
                                        "max_num_seqs", "max_model_len", "max_num_batched_tokens",
                                        "prefill_chunk_size", "block_size", "kv_cache_gb", "kv_fraction")
          if getattr(args, k) is not None}
    if args.disable_prefix_cache:
        kw["enable_prefix_cache"] = False
    kw["seed"] = args.seed
    t_load = time.perf_counter()
    engine = Engine(EngineConfig(**kw))
    t_load = time.perf_counter() - t_load
    rng = random.Random(args.seed)
    hi = min(engine.vocab_size, 10000)
    limit = engine.max_model_len
    prompts, outs = [], []
    if args.batch:
        n_in = min(args.input_len, limit - 1)
        prompt = [rng.randint(0, hi - 1) for _ in range(n_in)]
        n_out = min(args.max_tokens, limit - n_in)
        if n_out < args.max_tokens:
            print(f"xinfer-bench: --max-tokens {args.max_tokens} clipped to {n_out} to fit max_model_len {limit}",
                  file=sys.stderr)
        prompts, outs = [list(prompt) for _ in range(args.batch)], [n_out] * args.batch
    else:
        for _ in range(args.num_seqs):
            n_in = min(rng.randint(args.min_input_len, args.max_input_len), limit - 1)
            n_out = min(rng.randint(args.min_output_len, args.max_output_len), limit - n_in)
            prompts.append([rng.randint(0, hi - 1) for _ in range(n_in)])
            outs.append(n_out)
    params = [SamplingParams(temperature=args.temperature, ignore_eos=True, max_tokens=n, seed=args.seed + i)
              for i, n in enumerate(outs)]
    engine.generate([[1, 2, 3, 4]], SamplingParams(max_tokens=4, ignore_eos=True))  # warm-up
    recs: dict[int, stats.RequestRecord] = {}
    progress = load.Progress(len(prompts), None, "offline ", enabled=not args.quiet)
    t0 = time.perf_counter()
    order = []
    for d in engine.stream(prompts, params):
        now = time.perf_counter() - t0
        rec = recs.get(d.seq_id)
        if rec is None:
            rec = recs[d.seq_id] = stats.RequestRecord(ok=True, usage_reported=True)
            order.append(d.seq_id)
        if d.token_ids:
            if rec.ttft is None:
                rec.ttft = now
            rec.chunk_times.append(now)
            rec.output_len += len(d.token_ids)
        if d.finish_reason:
            rec.latency = now
            progress.update(rec)
    duration = time.perf_counter() - t0
    progress.draw(final=True)
    records = [recs[s] for s in sorted(recs)]
    for rec, p in zip(records, prompts):  # seq ids are handed out in the order prompts were added
        rec.prompt_len = len(p)
    m = stats.compute_metrics(records, duration)
    c = engine.config
    r = {"mode": "offline", "date": _dt.datetime.now().isoformat(timespec="seconds"), "machine": machine_info(),
         "commit": git_commit(), "scenario": args.scenario, "model": engine.info.name,
         "engine_config": dataclasses.asdict(c), "load_s": t_load,
         "config": {"num_seqs": len(prompts), "batch": args.batch, "input_len": args.input_len,
                    "max_tokens": args.max_tokens, "min_input_len": args.min_input_len,
                    "max_input_len": args.max_input_len, "min_output_len": args.min_output_len,
                    "max_output_len": args.max_output_len, "temperature": args.temperature, "seed": args.seed},
         **m,
         "output_throughput_series": stats.token_rate_series(records, duration),
         "concurrency_series": stats.concurrency_series(records, duration),
         **stats.records_lists(records)}
    print(stats.table(r, "Offline Throughput"))
    print(f"{len(prompts)} sequences, {m['total_input_tokens']} prompt + {m['total_output_tokens']} generated "
          f"tokens in {duration:.2f}s: {m['output_throughput']:.1f} output tok/s, "
          f"{m['total_token_throughput']:.1f} total tok/s ({c.device}, {c.dtype}, max_num_seqs {c.max_num_seqs})")
    out = Path(args.output_dir)
    stem = stem_of(args, "offline")
    write_json(out / f"{stem}.json", r)
    files = [out / f"{stem}.json"]
    if args.plots:
        from bench import plots
        files.append(plots.throughput_over_time(r, str(out / f"{stem}-throughput.png"),
                                                f"offline: {engine.info.name}, {len(prompts)} sequences"))
    print("wrote " + ", ".join(map(str, files)))
    return 0


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        return args.func(args)
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
