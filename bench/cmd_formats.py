"""`xinfer-bench formats`: one model in every weight format xinfer loads, side by side in one run:
resident weight bytes, single-stream and batched decode speed, and fidelity (mean KL divergence and
same top token against float32 weights and matmuls, teacher-forced over bench/texts/fidelity.txt).

The model (default: the bundled GGUF) is written once as a float safetensors folder; `--isq` settings
quantize that folder at load, and the checkpoint formats are written from it by bench/quant_writers.py
(round-to-nearest, so their accuracy is a floor next to calibrated GPTQ / AWQ files). Every engine
runs on this CPU's defaults, so the float row shows what the default matmul path alone costs."""
from __future__ import annotations

import json
import tempfile
import time
from pathlib import Path

import torch

from bench import quant_writers as qw
from bench.cmd_fidelity import TEXT, compare

GROUP = 64  # GPTQ / AWQ / WNA16 group size: releases use 128, which SmolLM2's 576-wide rows do not divide


def _gptq(w):
    q, z, s, _, _ = qw.int_quant(w, 4, GROUP)
    # AutoGPTQ's v1 layout stores each zero point minus one
    return {"qweight": torch.from_numpy(qw.pack_rows(q, 4)), "qzeros": torch.from_numpy(qw.pack_cols((z - 1) & 15, 4)),
            "scales": torch.from_numpy(s), "g_idx": torch.arange(w.shape[1], dtype=torch.int32) // GROUP}


def _awq(w):
    q, z, s, _, _ = qw.int_quant(w, 4, GROUP)
    order = [0, 2, 4, 6, 1, 3, 5, 7]
    return {"qweight": torch.from_numpy(qw.pack_cols(q, 4, order)), "qzeros": torch.from_numpy(qw.pack_cols(z, 4, order)),
            "scales": torch.from_numpy(s)}


def _nvfp4(w):
    p, s, g = qw.nvfp4(w)
    return {"weight": p, "weight_scale": s, "weight_scale_2": g}


def _mxfp4(w):
    p, e = qw.mxfp4(w)
    return {"weight_packed": p, "weight_scale": e}


def _w8(w):
    return qw.wna16(w, 8, GROUP, True)[0]


def _fp8(w):
    s = w.abs().amax(1, keepdim=True) / 448
    return {"weight": (w / s).to(torch.float8_e4m3fn), "weight_scale": s}


# name -> (quantization_config, writer)
CHECKPOINTS = {
    "gptq-4bit-g64": ({"quant_method": "gptq", "bits": 4, "group_size": GROUP, "desc_act": False, "sym": False}, _gptq),
    "awq-4bit-g64": ({"quant_method": "awq", "bits": 4, "group_size": GROUP, "version": "gemm", "zero_point": True}, _awq),
    "nvfp4": ({"quant_method": "modelopt", "quant_algo": "NVFP4", "group_size": 16}, _nvfp4),
    "mxfp4": (qw.ct("mxfp4-pack-quantized", {"num_bits": 4, "type": "float", "group_size": 32}), _mxfp4),
    "w8a16-g64": (qw.ct("pack-quantized", {"num_bits": 8, "type": "int", "strategy": "group", "group_size": GROUP,
                                            "symmetric": True}), _w8),
    "fp8-channel": (qw.ct("float-quantized", {"num_bits": 8, "type": "float", "strategy": "channel"}), _fp8),
}
ISQ = ("q8_0", "q6_k", "q4_k", "q4_1", "q4_0")


def export_float(info, dst: Path) -> dict:
    """The model (a ModelInfo) as a float safetensors folder; returns its tensors."""
    from safetensors.torch import save_file
    from xinfer.loader.hf import iter_safetensors
    state = dict(info.gguf.tensors()) if info.kind == "gguf" else dict(iter_safetensors(info.path))
    dst.mkdir(parents=True, exist_ok=True)
    (dst / "config.json").write_text(json.dumps(info.config))
    save_file({k: v.contiguous() for k, v in state.items()}, str(dst / "model.safetensors"))
    return state


def write_checkpoint(config: dict, state: dict, dst: Path, qc: dict, convert) -> None:
    from safetensors.torch import save_file
    dst.mkdir(parents=True, exist_ok=True)
    (dst / "config.json").write_text(json.dumps(dict(config, quantization_config=qc)))
    out = {}
    for name, t in state.items():
        if name.endswith("_proj.weight") and "layers." in name:
            out.update({name[:-len("weight")] + k: v.contiguous() for k, v in convert(t.float()).items()})
        else:
            out[name] = t.contiguous()
    save_file(out, str(dst / "model.safetensors"))


def weight_bytes(model) -> int:
    """Bytes of every weight tensor the model holds: parameters, GGUF blocks (MoE experts': a list
    per part), packed copies (ops/linear.py pack); each storage once."""
    from ops.linear import nbytes
    from ops.quant import QuantWeight
    found = [p.data for p in model.parameters()]
    for mod in model.modules():
        for b in (getattr(mod, "blocks", None), getattr(mod, "head_blocks", None)):
            parts = b.values() if isinstance(b, dict) else [b]
            found += [t for v in parts for q in (v if isinstance(v, list) else [v]) if isinstance(q, QuantWeight)
                      for t in (q.qs, q.d, q.m)]
        found += [getattr(mod, "fast", None), getattr(mod, "head_fast", None)]
    found = [t for t in found if isinstance(t, torch.Tensor) and t.numel()]
    dense = {id(t) if t.is_mkldnn else t.data_ptr(): nbytes(t) for t in found}
    return sum(dense.values())


def measure(name: str, fields: dict, ids: list[int], ref_lp, args) -> dict:
    from xinfer import Engine, EngineConfig, SamplingParams
    t0 = time.perf_counter()
    engine = Engine(EngineConfig(kv_cache_gb=1.0, **fields), log_level="warning")
    try:
        load = time.perf_counter() - t0
        lp = engine.runner.log_probs(ids, args.chunk)
        prompt = ids[:32]
        greedy = SamplingParams(temperature=0, max_tokens=args.decode_tokens, ignore_eos=True)
        engine.generate([prompt], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))  # warm
        t = time.perf_counter()
        engine.generate([prompt], greedy)
        single = args.decode_tokens / (time.perf_counter() - t)
        batch = [ids[i * 16:i * 16 + 32] for i in range(args.batch)]
        t = time.perf_counter()
        engine.generate(batch, SamplingParams(temperature=0, max_tokens=64, ignore_eos=True))
        batched = args.batch * 64 / (time.perf_counter() - t)
        r = compare(ref_lp, lp, ids)
        blocks = sum(getattr(m, "blocks", None) is not None and hasattr(m.blocks, "qs")
                     for m in engine.runner.model.modules())
        return {"name": name, "weight_mib": weight_bytes(engine.runner.model) / (1 << 20), "load_s": load,
                "single_tok_s": single, "batch_tok_s": batched, "mean_kld": r["mean_kld"], "same_top": r["same_top"],
                "ppl_ratio": r["ppl_ratio"], "linears_on_blocks": int(blocks),
                "quantization": engine.config.quantization, "cpu_matmul": engine.config.cpu_matmul}
    finally:
        engine.close()


def run(args) -> int:
    from ops import cpu_isa
    from xinfer import Engine, EngineConfig
    from xinfer.loader import load_model_info
    from xinfer.loader.hf import bundled_model_path
    info = load_model_info(args.model or bundled_model_path())
    config = info.config
    tmp = Path(args.workdir or tempfile.mkdtemp(prefix="xinfer-formats-"))
    print(f"writing the float model and the checkpoint formats under {tmp}", flush=True)
    state = export_float(info, tmp / "float")
    wanted = args.formats.split(",") if args.formats else ["float", "gguf", *ISQ, *CHECKPOINTS]
    for name in CHECKPOINTS:
        if name in wanted:
            write_checkpoint(config, state, tmp / name, *CHECKPOINTS[name])
    ref = Engine(EngineConfig(model=str(tmp / "float"), kv_cache_gb=1.0, dtype="float32", quantization="none",
                              cpu_matmul="float32"), log_level="warning")
    try:
        text = Path(args.text).read_text()
        # a folder without a tokenizer: the text's bytes as token ids
        ids = (info.tokenizer.encode(text)[:args.tokens] if info.tokenizer
               else [b % config["vocab_size"] for b in text.encode()[:args.tokens]])
        ref_lp = ref.runner.log_probs(ids, ref.config.prefill_chunk_size)
    finally:
        ref.close()
    rows = []
    for name in wanted:
        if name == "float":
            fields = {"model": str(tmp / "float"), "quantization": "none"}
        elif name == "gguf":
            if info.kind != "gguf":
                continue
            fields = {"model": info.path}
        elif name in ISQ:
            fields = {"model": str(tmp / "float"), "isq": name}
        else:
            fields = {"model": str(tmp / name)}
        r = measure(name, fields, ids, ref_lp, args)
        rows.append(r)
        print(f"{name:16s} {r['weight_mib']:7.1f} MiB  1 stream {r['single_tok_s']:6.1f} tok/s  "
              f"{args.batch} seqs {r['batch_tok_s']:6.1f} tok/s  KLD {r['mean_kld']:.5f}  "
              f"same top {100 * r['same_top']:.2f}%  ppl x{r['ppl_ratio']:.4f}  ({r['linears_on_blocks']} linears on blocks)",
              flush=True)
    out = {"model": args.model or "bundled SmolLM2-135M-Instruct", "cpu": cpu_isa.level(), "tokens": len(ids),
           "decode_tokens": args.decode_tokens, "batch": args.batch, "rows": rows}
    if args.output:
        Path(args.output).write_text(json.dumps(out, indent=1) + "\n")
    return 0


def add_args(f) -> None:
    f.add_argument("--m", "--model", dest="model", default=None, help="a GGUF file or float HF folder (default: the bundled model)")
    f.add_argument("--formats", default=None, help="comma-separated subset of: float, gguf, " + ", ".join((*ISQ, *CHECKPOINTS)))
    f.add_argument("--tokens", type=int, default=1024, help="tokens of the text scored for fidelity")
    f.add_argument("--chunk", type=int, default=8, help="rows a forward while scoring: as few as a decode step's, "
                   "so the block kernels (not the prefill GEMMs on the float weights) are what is judged")
    f.add_argument("--decode-tokens", type=int, default=128, help="tokens of the single-stream decode")
    f.add_argument("--batch", type=int, default=16, help="sequences of the batched decode (64 tokens each)")
    f.add_argument("--text", default=str(TEXT))
    f.add_argument("--workdir", default=None, help="where the written checkpoints go (default: a temporary folder)")
    f.add_argument("--output", default=None, help="also write the figures to this JSON file")
    f.set_defaults(func=run)
