"""`xinfer-bench attention`: decode (or, with `--prefill`, prompt) attention alone, as a model's step
runs it, for each KV format.

B sequences of `--context` positions (`--prefill`: each a whole prompt of that many tokens, causal),
`--layers` separate caches (so, as in a model, a step reads every layer's K and V from memory, not from a
cache level that one reused layer would sit in), SmolLM2's heads by default. Each format's cache is
written by the backend's own store; the C kernels (ops/cpu_kernels.c) and the torch path (gather + SDPA,
the baseline) run in the same process, alternated, the best of `--repeats` rounds kept. A step = one attention call per layer.
`--baseline-kernels OLD.c` adds the kernels built from another version of ops/cpu_kernels.c (e.g. `git show
REV:ops/cpu_kernels.c > OLD.c`) to the alternation, with the largest difference between its outputs and
the current build's."""
from __future__ import annotations

import json
import time
from pathlib import Path

import torch

from ops import cpu_kernels, kv_quant
from ops.attention import AttnMetadata, TorchBackend


def _meta(batch: int, context: int, bs: int, perm: torch.Tensor, prefill: bool) -> AttnMetadata:
    per, rows = -(-context // bs), context if prefill else 1
    return AttnMetadata(cu_seqlens_q=torch.arange(0, batch * rows + 1, rows, dtype=torch.int32),
                        seq_lens=torch.full((batch,), context, dtype=torch.int32),
                        block_tables=perm[:batch * per].view(batch, per).int(), slot_mapping=torch.zeros(0, dtype=torch.long),
                        query_lens=[rows] * batch, kv_lens=[context] * batch, block_size=bs)


def run(args) -> int:
    hq, hkv, d = (int(x) for x in args.heads.split(","))
    bs, g = args.block_size, torch.Generator().manual_seed(0)
    nb = args.batch * -(-args.context // bs) + 1
    perm = torch.randperm(nb - 1, generator=g)  # each sequence's blocks scattered through the cache
    q = torch.randn(args.batch * (args.context if args.prefill else 1), hq, d, generator=g)
    fused, plain = TorchBackend(), TorchBackend()
    plain._c = None
    if fused._c is None:
        print("the C kernels do not build here: only the torch path runs")
    baseline = None
    if args.baseline_kernels:
        so = cpu_kernels.load(args.baseline_kernels) if Path(args.baseline_kernels).is_file() else None
        if so is None or fused._c is None:
            print(f"--baseline-kernels {args.baseline_kernels}: not a C source that builds here")
            return 2
        baseline = TorchBackend()
        baseline._c = so
    rows = []
    for name in args.kvcache_dtype.split(","):
        dtype = kv_quant.storage_dtype(name, torch.float32)
        layers = []
        for _ in range(args.layers):
            kc, vc = (kv_quant.alloc((nb, bs, hkv, d), dtype, "cpu") for _ in "kv")
            slots = torch.arange(nb * bs)
            plain.store_kv(torch.randn(nb * bs, hkv, d, generator=g), torch.randn(nb * bs, hkv, d, generator=g),
                           kc, vc, slots)
            layers.append((kc, vc))
        paths = {"c": fused, "torch": plain} if fused._c is not None else {"torch": plain}
        if baseline is not None:
            paths["baseline"] = baseline
        best = {p: float("inf") for p in paths}
        warm = {p: backend.forward(q, *layers[0], _meta(args.batch, args.context, bs, perm, args.prefill), d ** -0.5)
                for p, backend in paths.items()}  # a warm-up step: kernels built, first-touch costs paid
        for _ in range(args.repeats):
            for p, backend in paths.items():
                t = time.perf_counter()
                meta = _meta(args.batch, args.context, bs, perm, args.prefill)  # one a step, its plan shared by the layers, as in a model
                for kc, vc in layers:
                    backend.forward(q, kc, vc, meta, d ** -0.5)
                best[p] = min(best[p], time.perf_counter() - t)
        row = {"kvcache_dtype": name, **{f"{p}_ms": round(v * 1000, 2) for p, v in best.items()}}
        if "c" in best:
            row["speedup"] = round(best["torch"] / best["c"], 2)
        if baseline is not None:
            row["vs_baseline"] = round(best["baseline"] / best["c"], 3)
            row["max_diff_vs_baseline"] = (warm["c"] - warm["baseline"]).abs().max().item()
        rows.append(row)
        if args.prefill:  # causal: each sequence's context^2 / 2 (query, key) pairs, 4 D FLOP a pair and query head
            row.update({f"{p}_gflops": round(args.batch * args.context ** 2 / 2 * 4 * d * hq * args.layers / v / 1e9, 1)
                        for p, v in best.items()})
        print(f"{name:>9}: " + ", ".join(f"{p} {v * 1000:.1f} ms" for p, v in best.items())
              + (f" ({row['speedup']}x)" if "c" in best else "") + f" a step of {args.layers} layers"
              + (f"; {row['vs_baseline']}x the baseline kernels, outputs {row['max_diff_vs_baseline']:.2g} apart"
                 if baseline is not None else "")
              + (f", c {row['c_gflops']} GFLOP/s" if args.prefill and "c" in best else ""))
    if args.output:
        Path(args.output).write_text(json.dumps({"mode": "attention", "prefill": args.prefill, "batch": args.batch,
                                                 "context": args.context,
                                                 "heads": args.heads, "layers": args.layers, "rows": rows}, indent=1) + "\n")
    return 0


def add_args(f) -> None:
    f.add_argument("--batch", type=int, default=16, help="sequences decoding")
    f.add_argument("--context", type=int, default=512, help="positions each sequence attends to")
    f.add_argument("--heads", default="9,3,64", help="query heads, KV heads, head size (default: SmolLM2-135M's)")
    f.add_argument("--layers", type=int, default=30, help="separate caches read one after another a step")
    f.add_argument("--block-size", type=int, default=16, help="tokens a KV block (blocks scattered through the cache)")
    f.add_argument("--kvcache-dtype", default="auto,bf16,fp8,turbo4",
                   help="comma-separated formats (auto: float32)")
    f.add_argument("--prefill", action="store_true", help="each sequence a whole prompt of --context tokens")
    f.add_argument("--repeats", type=int, default=5)
    f.add_argument("--baseline-kernels", default=None, metavar="OLD.c",
                   help="also time the kernels built from this version of ops/cpu_kernels.c, alternated")
    f.add_argument("--output", default=None, help="also write the figures to this JSON file")
    f.set_defaults(func=run)
