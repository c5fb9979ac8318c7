"""`xinfer-bench models DIR_OR_IDS...`: the model test sweep. Each model is served by its own
`xinfer serve` (it must load, and /v1/models must answer), then asked to summarise a ~1,000-token
text with thinking off and, when its chat template reads `enable_thinking`, with thinking on. Each
answer is checked (empty; repetitive: the share of repeated word 3-grams over --max-repeat) and
timed; one table (Markdown, and JSON with every figure) sums the sweep up. `--load-format dummy`
models (random weights) give the timing columns; their quality verdicts mean nothing."""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

from bench.common import machine_info, now_iso, stamp, write_json

TEXT = Path(__file__).resolve().parent / "texts" / "fidelity.txt"


def add_args(p) -> None:
    p.add_argument("models", nargs="+", help="model folders, GGUF files, HF cache ids or shipped config names")
    p.add_argument("--prompt-words", type=int, default=500, help="words of the text in the prompt (~1,000 tokens)")
    p.add_argument("--max-tokens", type=int, default=2000, help="output tokens asked for each answer")
    p.add_argument("--max-repeat", type=float, default=0.5, help="flag answers whose repeated word 3-grams exceed this share")
    p.add_argument("--serve-args", default="", help="more `xinfer serve` flags for every model, e.g. '--load-format dummy'")
    p.add_argument("--startup-timeout", type=float, default=600.0)
    p.add_argument("--output", default=None, help="the JSON results file (default bench/results/models-<time>.json)")
    p.set_defaults(func=run)


def repeat_share(text: str) -> float:
    """The share of word 3-grams that occurred earlier in the text (0: none repeat)."""
    words = text.split()
    grams = [tuple(words[i:i + 3]) for i in range(len(words) - 2)]
    return 0.0 if not grams else 1 - len(set(grams)) / len(grams)


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _get(url: str, body: dict | None = None, timeout: float = 5.0) -> dict:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"content-type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())


def _serve(model: str, extra: list[str], timeout: float):
    port = _port()
    proc = subprocess.Popen([sys.executable, "-m", "xinfer.cli", "--log-level", "warning", "serve", "--model", model,
                             "--port", str(port), *extra], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    base, deadline = f"http://127.0.0.1:{port}", time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            return proc, None, (proc.stdout.read() or "").strip()[-500:] or f"exit code {proc.returncode}"
        try:
            _get(base + "/health", timeout=2)
            return proc, base, None
        except (OSError, urllib.error.HTTPError):
            time.sleep(0.5)
    return proc, None, f"not ready within {timeout:.0f}s"


def _stop(proc) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _answer(base: str, model: str, prompt: str, max_tokens: int, thinking: bool, max_repeat: float) -> dict:
    body = {"model": model, "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
            "temperature": 0, "chat_template_kwargs": {"enable_thinking": thinking}}
    r, row = _timed(base + "/v1/chat/completions", body)
    msg = r["choices"][0]["message"]
    text = (msg.get("content") or "") + (msg.get("reasoning_content") or "")
    share = repeat_share(text)
    verdict = "empty" if not text.strip() else "repetitive" if share > max_repeat else "ok"
    return dict(row, repeat_share=round(share, 3), verdict=verdict, finish_reason=r["choices"][0]["finish_reason"])


def _timed(url: str, body: dict) -> tuple[dict, dict]:
    """The response, and its token counts and speed."""
    t0 = time.perf_counter()
    r = _get(url, body, timeout=3600)
    secs = time.perf_counter() - t0
    out = r["usage"]["completion_tokens"]
    return r, {"prompt_tokens": r["usage"]["prompt_tokens"], "completion_tokens": out, "seconds": round(secs, 2),
               "tok_s": round(out / secs, 1) if secs else None}


def _timing(base: str, card: dict, max_tokens: int) -> dict:
    """A dummy model: 1,000 token ids in (fewer where the context is short), max_tokens out (no EOS),
    for the throughput alone."""
    room = card.get("max_model_len") or 4096
    max_tokens = min(max_tokens, room // 2)
    n = min(1000, room - max_tokens)
    # ids that any vocabulary has
    body = {"model": card["id"], "prompt": [(7919 * i) % 100 + 10 for i in range(n)], "max_tokens": max_tokens,
            "temperature": 0, "ignore_eos": True}
    return dict(_timed(base + "/v1/completions", body)[1], verdict="timing only")


def _reads_thinking(base: str, model: str) -> bool:
    """Whether the chat template reads enable_thinking: the same message renders differently."""
    counts = set()
    for on in (False, True):
        body = {"model": model, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1,
                "chat_template_kwargs": {"enable_thinking": on}}
        counts.add(_get(base + "/v1/chat/completions", body, timeout=600)["usage"]["prompt_tokens"])
    return len(counts) > 1


def sweep_one(model: str, args) -> dict:
    row = {"model": model, "format": "gguf" if model.endswith(".gguf") else "dummy" if "dummy" in args.serve_args
           else "hf"}
    proc, base, err = _serve(model, args.serve_args.split(), args.startup_timeout)
    try:
        if base is None:
            return dict(row, verdict="load failed", error=err)
        card = _get(base + "/v1/models")["data"][0]
        row["served_as"] = card["id"]
        if "--load-format" in args.serve_args and "dummy" in args.serve_args:
            row["thinking_off"] = _timing(base, card, args.max_tokens)  # random weights, maybe no tokenizer
            row["thinking_on"], row["verdict"] = None, "timing only"
            return row
        words = TEXT.read_text().split()[:args.prompt_words]
        prompt = " ".join(words) + "\n\nSummarise the text above in a few paragraphs."
        row["thinking_off"] = _answer(base, card["id"], prompt, args.max_tokens, False, args.max_repeat)
        row["thinking_on"] = (_answer(base, card["id"], prompt, args.max_tokens, True, args.max_repeat)
                              if _reads_thinking(base, card["id"]) else None)
        verdicts = [r["verdict"] for r in (row["thinking_off"], row["thinking_on"]) if r]
        row["verdict"] = "ok" if all(v == "ok" for v in verdicts) else ", ".join(v for v in verdicts if v != "ok")
        return row
    except (OSError, urllib.error.HTTPError, KeyError, IndexError, ValueError) as e:
        return dict(row, verdict="request failed", error=f"{type(e).__name__}: {e}")
    finally:
        _stop(proc)


def _cell(r: dict | None) -> str:
    if not r:
        return "-"
    return f"{r['completion_tokens']} tok, {r['tok_s']} tok/s, {r['verdict']}"


def table(rows: list[dict]) -> str:
    lines = ["| model | format | thinking off | thinking on | verdict |", "|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r.get('served_as', r['model'])} | {r['format']} | {_cell(r.get('thinking_off'))} | "
                     f"{_cell(r.get('thinking_on'))} | {r['verdict']} |")
    return "\n".join(lines)


def run(args) -> int:
    rows = []
    for i, m in enumerate(args.models, 1):
        print(f"[{i}/{len(args.models)}] {m}", file=sys.stderr, flush=True)
        rows.append(sweep_one(m, args))
        print(f"[{i}/{len(args.models)}] {m}: {rows[-1]['verdict']}", file=sys.stderr, flush=True)
    md = table(rows)
    print(md)
    out = args.output or os.path.join("bench", "results", f"models-{stamp()}.json")
    write_json(Path(out), {"date": now_iso(), "machine": machine_info(), "max_tokens": args.max_tokens,
                     "max_repeat": args.max_repeat, "models": rows, "markdown": md})
    print(f"results: {out}", file=sys.stderr)
    return 0 if all(r["verdict"] not in ("load failed", "request failed") for r in rows) else 1
