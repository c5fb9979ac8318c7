"""The `xinfer-bench` command: its flags and subcommands. Each mode runs in its own module: serve
(bench.cmd_serve), compare (bench.cmd_compare), curve (bench.cmd_curve), soak (bench.cmd_soak) and
offline (bench.cmd_offline), with what they share in bench.common."""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from bench import (cmd_attention, cmd_compare, cmd_curve, cmd_fidelity, cmd_formats, cmd_fuzz, cmd_models,
                   cmd_offline, cmd_serve, cmd_soak)
from bench.common import load_scenario
from xinfer.cli import add_engine_args

DEFAULT_URL = "http://127.0.0.1:8000/v1"


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
    g.add_argument("--extra-body", type=json.loads, default=None, metavar="JSON",
                   help="fields merged into every request body, e.g. a response_format (structured outputs)")
    g = p.add_argument_group("results")
    g.add_argument("--slo-ttft", type=float, default=None, help="goodput SLO on TTFT, ms")
    g.add_argument("--slo-tpot", type=float, default=None, help="goodput SLO on TPOT, ms")
    g.add_argument("--percentiles", default="50,90,99")
    g.add_argument("--output-dir", default="bench/results")
    g.add_argument("--result-name", default=None, help="file stem of the results (default: mode-scenario-time)")
    g.add_argument("--no-plots", dest="plots", action="store_false")
    g.add_argument("--quiet", action="store_true", help="no progress bar")


def build_parser() -> tuple[argparse.ArgumentParser, dict]:
    parser = argparse.ArgumentParser(prog="xinfer-bench",
                                     description="Load tests and benchmarks for xinfer and any OpenAI-compatible server")
    sub = parser.add_subparsers(dest="mode", required=True)
    subs = {}

    s = subs["serve"] = sub.add_parser("serve", help="online load against one server")
    add_load_args(s)
    s.add_argument("--sweep", default=None,
                   help="run a series: concurrency=1,4,16,64 or request_rate=0.5,1,2")
    s.set_defaults(func=cmd_serve.run)

    c = subs["compare"] = sub.add_parser("compare", help="the same scenario against several servers")
    c.add_argument("--target", action="append", required=True, metavar="NAME=URL",
                   help="a server's OpenAI base URL, repeatable; figures are ratios to the first")
    c.add_argument("--target-model", action="append", default=[], metavar="NAME=MODEL",
                   help="model name to send to a target (default: the first of its /v1/models)")
    c.add_argument("--repeats", type=int, default=1, help="rounds; each round runs every target in turn")
    c.add_argument("--serve", action="append", default=[], metavar="NAME=COMMAND",
                   help="start this target's server (a shell command) for each of its runs and stop it after, "
                        "so each server runs alone (servers in turn); without it the target must be up")
    c.add_argument("--serve-timeout", type=float, default=600.0,
                   help="seconds a --serve command may take to be ready (/models answers, /health not 5xx)")
    add_load_args(c, url=False)
    c.set_defaults(func=cmd_compare.run)

    v = subs["curve"] = sub.add_parser("curve", help="plot output tok/s against concurrency from compare results")
    v.add_argument("results", nargs="+", help="compare JSON files (one per concurrency)")
    v.add_argument("--point", action="append", default=[], metavar="NAME=CONCURRENCY:TOK_S",
                   help="a reference figure to mark, e.g. 'llama.cpp (issue)=1:78'")
    v.add_argument("--output", required=True, help="the PNG to write")
    v.add_argument("--title", default="")
    v.set_defaults(func=cmd_curve.run)

    k = subs["soak"] = sub.add_parser("soak", help="constant load for a long time; watches drift and memory")
    add_load_args(k)
    k.add_argument("--sample-interval", type=float, default=5.0, help="seconds between memory samples")
    k.add_argument("--server-pid", type=int, default=None,
                   help="the server's PID (default: the process listening on the URL's port)")
    k.add_argument("--max-rss-growth-mb", type=float, default=64.0,
                   help="fail when the server's memory grows more than this after warming up")
    k.add_argument("--max-error-rate", type=float, default=0.01, help="fail above this share of failed requests")
    k.set_defaults(func=cmd_soak.run, duration=600.0, concurrency=8)

    f = subs["fuzz"] = sub.add_parser("fuzz", help="property-based fuzz of a server's POST routes from its "
                                      "/openapi.json: fails on a 5xx, a hang or a dropped connection")
    f.add_argument("--base-url", default=DEFAULT_URL, help="the server's OpenAI base URL")
    f.add_argument("--examples", type=int, default=1000, help="bodies per route and source (schema, any JSON)")
    f.add_argument("--timeout", type=float, default=10.0, help="seconds a request may take")
    f.add_argument("--seed", type=int, default=0)
    f.set_defaults(func=cmd_fuzz.run)

    cmd_fidelity.add_args(sub.add_parser("fidelity", help="KL divergence, same top token and perplexity of one "
                                         "setting against another (default: xinfer's defaults against float32)"))

    cmd_attention.add_args(sub.add_parser("attention", help="decode attention alone, C kernels against the torch "
                                                            "path, for each KV format"))
    cmd_formats.add_args(sub.add_parser("formats", help="one model in every weight format (GGUF, --isq, GPTQ, AWQ, "
                                                        "NVFP4, MXFP4, W8, FP8): memory, decode speed, KL divergence"))

    cmd_models.add_args(sub.add_parser("models", help="the model test sweep: serve each model, two long answers, "
                                                      "quality flags and throughput in one table"))
    o = subs["offline"] = sub.add_parser("offline", help="in-process Engine throughput, no HTTP")
    # The engine's own flags, one per EngineConfig field, so bench never lags behind xinfer's; its
    # --seed also seeds the prompts.
    add_engine_args(o.add_argument_group("engine (EngineConfig, as in `xinfer generate`)"))
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
    o.add_argument("--worker", choices=("inproc", "process"), default="inproc",
                   help="the model in this process, or in a worker process as `xinfer serve` runs it (where "
                        "overlap scheduling plans a step while the previous one runs)")
    o.add_argument("--output-dir", default="bench/results")
    o.add_argument("--result-name", default=None)
    o.add_argument("--no-plots", dest="plots", action="store_false")
    o.add_argument("--quiet", action="store_true")
    o.add_argument("--baseline-kernels", default=None, metavar="OLD.c",
                   help="time whole runs on the kernels built from another version of ops/cpu_kernels.c (e.g. "
                        "`git show REV:ops/cpu_kernels.c > OLD.c`) against the current ones, alternated (--worker inproc)")
    o.add_argument("--rounds", type=int, default=3, help="with --baseline-kernels: runs of each build")
    o.add_argument("--profile", action="store_true",
                   help="after the table, where the time went: the host's functions (cProfile) and, on CUDA "
                        "in-process, a decode step's GPU time and kernels (bench/probe.py)")
    o.set_defaults(func=cmd_offline.run)
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
        if section.get("dataset_path") and not Path(section["dataset_path"]).is_absolute():
            section["dataset_path"] = str(Path(__file__).resolve().parent.parent / section["dataset_path"])
        sub.set_defaults(**section)
        args = parser.parse_args(argv)
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        return args.func(args)
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
