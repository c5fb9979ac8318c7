"""`xinfer-bench offline`: in-process Engine throughput on random token ids, no HTTP.

`--baseline-kernels OLD.c` times whole runs (prefill and decode steps) on the kernels built from another
version of ops/cpu_kernels.c against the current ones, alternated in one process over `--rounds`, each
run on fresh prompts of the same lengths (the prefix cache would skip the repeats). The weights' panels
are built once, by the current kernels: a baseline that lays them out differently is not comparable."""
from __future__ import annotations

import dataclasses
import random
import sys
import time
from pathlib import Path

from bench import load, stats
from bench.common import git_commit, machine_info, now_iso, stem_of, write_json
from xinfer.cli import engine_config


def run(args) -> int:
    import logging
    logging.basicConfig(level=logging.WARNING)
    from xinfer import Engine

    t_load = time.perf_counter()
    engine = Engine(engine_config(args), worker=args.worker, log_level="warning")  # --seed seeds the prompts too
    t_load = time.perf_counter() - t_load
    rng = random.Random(args.seed)
    if args.baseline_kernels:
        return _against_baseline(args, engine, rng)
    prompts, outs = _workload(args, engine, rng)
    params = _params_and_warm_up(args, engine, outs)
    recs: dict[int, stats.RequestRecord] = {}
    progress = load.Progress(len(prompts), None, "offline ", enabled=not args.quiet)
    t0 = time.perf_counter()
    if args.profile:
        from bench import probe
        deltas, host = probe.host_profile(lambda: list(engine.stream(prompts, params)))
        stream = ((time.perf_counter() - t0, d) for d in deltas)  # times lost: the table is the profiled run's total
    else:
        stream = ((time.perf_counter() - t0, d) for d in engine.stream(prompts, params))
    for now, d in stream:
        rec = recs.get(d.seq_id)
        if rec is None:
            rec = recs[d.seq_id] = stats.RequestRecord(ok=True, usage_reported=True)
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
    r = {"mode": "offline", "date": now_iso(), "machine": machine_info(),
         "commit": git_commit(), "scenario": args.scenario, "model": engine.info.name,
         "engine_config": dataclasses.asdict(c), "load_s": t_load,
         "config": {"num_seqs": len(prompts), "batch": args.batch, "input_len": args.input_len,
                    "max_tokens": args.max_tokens, "min_input_len": args.min_input_len,
                    "max_input_len": args.max_input_len, "min_output_len": args.min_output_len,
                    "max_output_len": args.max_output_len, "temperature": args.temperature, "seed": args.seed},
         **m,
         "worker": args.worker, "decode_graph_replays": getattr(getattr(engine.runner, "graphs", None), "replays", None),
         "early_launches": getattr(engine.runner, "early_launches", None),  # in-process: steps pipelined
         "spec": {"drafts": engine.scheduler.num_draft_tokens, "accepted": engine.scheduler.num_accepted_tokens,
                  "steps": engine.scheduler.num_spec_steps},
         "output_throughput_series": stats.token_rate_series(records, duration),
         "concurrency_series": stats.concurrency_series(records, duration),
         **stats.records_lists(records)}
    print(stats.table(r, "Offline Throughput"))
    print(f"{len(prompts)} sequences, {m['total_input_tokens']} prompt + {m['total_output_tokens']} generated "
          f"tokens in {duration:.2f}s: {m['output_throughput']:.1f} output tok/s, "
          f"{m['total_token_throughput']:.1f} total tok/s ({c.device}, {c.dtype}"
          f"{f' with {c.cpu_matmul} matmuls' if c.device == 'cpu' and c.cpu_matmul != c.dtype else ''}, "
          f"max_num_seqs {c.max_num_seqs})")
    if args.profile:
        print(host)
        if args.worker == "inproc":
            print(probe.device_profile(engine.runner))
    if r["spec"]["steps"]:
        sp = r["spec"]
        print(f"speculative: {sp['accepted']} of {sp['drafts']} drafts accepted, "
              f"{(sp['accepted'] + sp['steps']) / sp['steps']:.2f} tokens per verifying step")
    out = Path(args.output_dir)
    stem = stem_of(args, "offline")
    write_json(out / f"{stem}.json", r)
    files = [out / f"{stem}.json"]
    if args.plots:
        from bench import plots
        files.append(plots.throughput_over_time(r, str(out / f"{stem}-throughput.png"),
                                                f"offline: {engine.info.name}, {len(prompts)} sequences"))
    print("wrote " + ", ".join(map(str, files)))
    engine.close()
    return 0


def _params_and_warm_up(args, engine, outs: list[int]) -> list:
    """Each sequence's sampling parameters (its own seed); one short generation first, so the timed
    runs do not pay the first step's set-up."""
    from xinfer import SamplingParams
    engine.generate([[1, 2, 3, 4]], SamplingParams(max_tokens=4, ignore_eos=True))
    return [SamplingParams(temperature=args.temperature, ignore_eos=True, max_tokens=n, seed=args.seed + i)
            for i, n in enumerate(outs)]


def _ids(engine, rng: random.Random, n: int) -> list[int]:
    """n random token ids, from the vocabulary's first 10,000."""
    hi = min(engine.vocab_size, 10000)
    return [rng.randint(0, hi - 1) for _ in range(n)]


def _workload(args, engine, rng: random.Random) -> tuple[list[list[int]], list[int]]:
    """The prompts (random token ids) and each one's output length."""
    limit = engine.max_model_len
    prompts, outs = [], []
    if args.batch:
        n_in = min(args.input_len, limit - 1)
        prompt = _ids(engine, rng, n_in)
        n_out = min(args.max_tokens, limit - n_in)
        if n_out < args.max_tokens:
            print(f"xinfer-bench: --max-tokens {args.max_tokens} clipped to {n_out} to fit max_model_len {limit}",
                  file=sys.stderr)
        prompts, outs = [list(prompt) for _ in range(args.batch)], [n_out] * args.batch
    else:
        for _ in range(args.num_seqs):
            n_in = min(rng.randint(args.min_input_len, args.max_input_len), limit - 1)
            n_out = min(rng.randint(args.min_output_len, args.max_output_len), limit - n_in)
            prompts.append(_ids(engine, rng, n_in))
            outs.append(n_out)
    return prompts, outs


def _against_baseline(args, engine, rng: random.Random) -> int:
    from ops import cpu_kernels
    src = Path(args.baseline_kernels)
    so = cpu_kernels.load(src) if src.is_file() else None
    backend = getattr(engine.runner, "backend", None)
    if so is None or cpu_kernels.lib() is None or backend is None:
        print(f"--baseline-kernels {src}: needs a C source that builds here and --worker inproc", file=sys.stderr)
        return 2
    builds = {"current": cpu_kernels.lib(), "baseline": so}
    times: dict[str, list[float]] = {name: [] for name in builds}
    prompts, outs = _workload(args, engine, rng)
    params = _params_and_warm_up(args, engine, outs)
    try:
        for r in range(args.rounds):
            for name in (("current", "baseline") if r % 2 == 0 else ("baseline", "current")):
                cpu_kernels.swap(builds[name])
                backend._c = builds[name]
                fresh = [_ids(engine, rng, len(p)) for p in prompts]
                t = time.perf_counter()
                engine.generate(fresh, params)
                times[name].append(time.perf_counter() - t)
                if not args.quiet:
                    print(f"round {r + 1}/{args.rounds} {name}: {times[name][-1]:.3f} s", file=sys.stderr)
    finally:
        cpu_kernels.swap(None)
        backend._c = builds["current"]
    best = {name: min(v) for name, v in times.items()}
    med = {name: sorted(v)[len(v) // 2] for name, v in times.items()}
    r = {"mode": "offline-kernels", "date": now_iso(), "machine": machine_info(), "commit": git_commit(),
         "baseline_kernels": str(src), "num_seqs": len(prompts), "prompt_tokens": sum(map(len, prompts)),
         "output_tokens": sum(outs), "seconds": times, "best": best, "median": med,
         "speedup_best": round(best["baseline"] / best["current"], 3),
         "speedup_median": round(med["baseline"] / med["current"], 3)}
    print(f"{len(prompts)} sequences, {r['prompt_tokens']} prompt + {r['output_tokens']} generated tokens a run, "
          f"{args.rounds} rounds alternated: current {best['current']:.3f} s best ({med['current']:.3f} median), "
          f"baseline {best['baseline']:.3f} s ({med['baseline']:.3f}): {r['speedup_best']}x best, "
          f"{r['speedup_median']}x median")
    out = Path(args.output_dir) / f"{stem_of(args, 'offline-kernels')}.json"
    write_json(out, r)
    print(f"wrote {out}")
    engine.close()
    return 0
