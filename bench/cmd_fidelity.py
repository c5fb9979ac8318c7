"""`xinfer-bench fidelity`: how far one setting's next-token distributions are from another's, as
llama.cpp judges its quants. Both run teacher-forced over the same fixed text (bench/texts/fidelity.txt,
Python 3.11's module docstrings), prefilled in chunks as a server would; printed: the mean KL
divergence KL(A || B) of the next-token distributions, the share of positions whose top token is the
same, and the perplexity of the text under each (the ratio B / A)."""
from __future__ import annotations

import json
import time
from pathlib import Path

import torch

TEXT = Path(__file__).resolve().parent / "texts" / "fidelity.txt"


def setting(spec: str) -> dict:
    """'cpu_matmul=float32,quantization=none' -> EngineConfig fields."""
    import dataclasses
    from xinfer.config import EngineConfig
    types = {f.name: str(f.type) for f in dataclasses.fields(EngineConfig)}
    out = {}
    for part in filter(None, spec.split(",")):
        key, _, value = part.partition("=")
        key = key.strip().replace("-", "_")
        if key not in EngineConfig.field_names():
            raise SystemExit(f"xinfer-bench fidelity: {key!r} is not an engine setting")
        value = value.strip()
        t = types[key]  # annotations are strings: "int", "float | None", ...
        out[key] = int(value) if t.startswith("int") else float(value) if t.startswith("float") else value
    return out


def log_probs(model: str | None, fields: dict, ids: list[int] | None, tokens: int, text: str):
    """(token ids, log-probs [T, V], the resolved setting, seconds) of the text under one setting."""
    from xinfer import Engine, EngineConfig
    t0 = time.perf_counter()
    engine = Engine(EngineConfig(model=model, kv_cache_gb=1.0, **fields), log_level="warning")
    try:
        ids = ids or engine.tokenizer.encode(text)[:tokens]
        lp = engine.runner.log_probs(ids, engine.config.prefill_chunk_size)
        used = {k: getattr(engine.config, k) for k in ("dtype", "quantization", "cpu_matmul", "kvcache_dtype")}
    finally:
        engine.close()
    return ids, lp, used, time.perf_counter() - t0


def compare(lp_a, lp_b, ids) -> dict:
    """The three figures over every position that has a next token."""
    a, b = lp_a[:-1], lp_b[:-1]
    target = torch.tensor(ids[1:], device=lp_a.device)
    kld = (a.exp() * (a - b)).sum(-1)
    nll_a = -a.gather(1, target[:, None]).mean()
    nll_b = -b.gather(1, target[:, None]).mean()
    return {"positions": len(ids) - 1, "mean_kld": kld.mean().item(), "max_kld": kld.max().item(),
            "same_top": (a.argmax(-1) == b.argmax(-1)).float().mean().item(),
            "ppl_a": nll_a.exp().item(), "ppl_b": nll_b.exp().item(),
            "ppl_ratio": (nll_b - nll_a).exp().item()}


def run(args) -> int:
    text = Path(args.text).read_text()
    ids, lp_a, used_a, s_a = log_probs(args.model, setting(args.a), None, args.tokens, text)
    _, lp_b, used_b, s_b = log_probs(args.model, setting(args.b), ids, args.tokens, text)
    r = compare(lp_a, lp_b, ids)
    from ops import cpu_isa
    r.update(a=used_a, b=used_b, model=args.model or "bundled SmolLM2-135M-Instruct", text=str(args.text),
             cpu=cpu_isa.level(), seconds=[round(s_a, 1), round(s_b, 1)])
    print(f"A {used_a}\nB {used_b}\n{r['positions']} positions of {Path(args.text).name} (cpu {r['cpu']}): "
          f"mean KLD {r['mean_kld']:.5f} (max {r['max_kld']:.3f}), same top token {100 * r['same_top']:.2f}%, "
          f"perplexity {r['ppl_a']:.3f} -> {r['ppl_b']:.3f} (x{r['ppl_ratio']:.4f})")
    if args.output:
        Path(args.output).write_text(json.dumps(r, indent=1) + "\n")
    return 0


def add_args(f) -> None:
    f.add_argument("--m", "--model", dest="model", default=None, help="the model (default: the bundled one)")
    f.add_argument("--a", default="dtype=float32,quantization=none,cpu_matmul=float32",
                   help="the reference setting, EngineConfig fields (default: float32 weights and matmuls)")
    f.add_argument("--b", default="", help="the setting judged (default: xinfer's defaults on this CPU)")
    f.add_argument("--text", default=str(TEXT), help="the text (default: bench/texts/fidelity.txt)")
    f.add_argument("--tokens", type=int, default=2048, help="tokens of the text scored")
    f.add_argument("--output", default=None, help="also write the figures to this JSON file")
    f.set_defaults(func=run)
