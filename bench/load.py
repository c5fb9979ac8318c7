"""Request generation and the asyncio load runner (aiohttp, streamed SSE).

Prompts are made per request index from (seed, shape, index), so a run is the same whatever the
concurrency or the order requests finish in, and `--duration` runs can draw as many as they need.
The same command run twice sends the same prompts: against a server that is still up, the second
run hits its prefix cache. Change --seed between runs (compare does, per round) or restart it.
"""
from __future__ import annotations

import asyncio
import json
import os
import random
import re
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

from bench.stats import RequestRecord

# Fallback when no tokenizer is at hand: common English words, each one token with its leading
# space in the usual BPE vocabularies, so N words come out as about N tokens.
WORDS = ("the of and to in is that it for was on are as with his they at be this from have or by one "
         "had not but what all were when we there can an your which their said if do will each about how "
         "up out them then she many some so these would other into has more her two like him see time "
         "could no make than first been its who now people my made over did down only way find use may "
         "water long little very after words called just where most know get through back much before "
         "go good new write our used me man too any day same right look think also around another came "
         "come work three word must because does part even place well such here take why things help put "
         "years different away again off went old number great tell men say small every found still "
         "between name should home big give air line set own under read last never us left end along "
         "while might next sound below saw something thought both few those always looked show large "
         "often together asked house world going want school important until form food keep children "
         "feet land side without boy once animals life enough took sometimes four head above kind began "
         "almost live page got earth need far hand high year mother light parts country father let night "
         "following picture being study second eyes soon times story boys since white days ever paper "
         "hard near sentence better best across during today others however sure means knew try told "
         "young miles sun ways thing whole hear example heard several change answer room sea against top "
         "turned learn point city play toward five using himself usually").split()


class TextMaker:
    """Makes text of about N tokens: random whole-word tokens of a tokenizer, or plain words."""

    def __init__(self, tokenizer=None, name: str = "words"):
        self.tok = tokenizer  # a tokenizers.Tokenizer, or None for the word list
        self.name = name
        self.pool: list[int] = []
        if tokenizer is not None:
            # Whole-word pieces: "Ġword" (byte-level BPE) or "▁word" (SentencePiece), letters only.
            for piece, tid in tokenizer.get_vocab(with_added_tokens=False).items():
                if len(piece) >= 4 and piece[0] in "Ġ▁" and piece[1:].isascii() and piece[1:].isalpha():
                    self.pool.append(tid)
            self.pool.sort()
            if len(self.pool) < 100:  # not a byte-level BPE vocabulary we understand: use words
                self.tok, self.pool, self.name = None, [], f"words (tokenizer {name} unusable)"

    def count(self, text: str) -> int:
        if self.tok is None:
            return len(text.split())
        return len(self.tok.encode(text, add_special_tokens=False).ids)

    def make(self, rng: random.Random, n: int) -> str:
        if n <= 0:
            return ""
        if self.tok is None:
            return " ".join(rng.choice(WORDS) for _ in range(n))
        ids = [rng.choice(self.pool) for _ in range(n)]
        text = self.tok.decode(ids)
        for _ in range(3):  # re-encoding can merge or split pieces: trim or pad until it fits
            got = self.tok.encode(text, add_special_tokens=False).ids
            if len(got) == n:
                break
            got = got[:n] + [rng.choice(self.pool) for _ in range(n - len(got))]
            text = self.tok.decode(got)
        return text.lstrip()


def load_text_maker(spec: str | None) -> TextMaker:
    """spec: "words"; a tokenizer.json file or a folder holding one; a .gguf file; "xinfer" (the
    bundled model's tokenizer, through xinfer's loader); "auto": xinfer's if it loads, else words."""
    spec = spec or "auto"
    if spec == "words":
        return TextMaker()
    p = Path(spec).expanduser()
    if p.is_dir():
        p = p / "tokenizer.json"
    if p.suffix == ".json" and p.is_file():
        from tokenizers import Tokenizer
        return TextMaker(Tokenizer.from_file(str(p)), str(p))
    if spec in ("auto", "xinfer") or p.suffix == ".gguf":
        try:
            from xinfer.loader import load_model_info
            info = load_model_info(None if spec in ("auto", "xinfer") else str(p))
            return TextMaker(info.tokenizer.tok, f"xinfer:{info.name}")
        except Exception as e:  # noqa: BLE001 - any failure means: fall back or report
            if spec != "auto":
                raise SystemExit(f"xinfer-bench: cannot load tokenizer {spec!r}: {e}")
            print(f"xinfer-bench: no tokenizer ({e}); prompts are sized in words", file=sys.stderr)
            return TextMaker()
    raise SystemExit(f"xinfer-bench: --tokenizer {spec!r}: not 'auto', 'words', 'xinfer', a tokenizer.json, "
                     f"a folder with one, or a .gguf file")


@dataclass
class Request:
    text: str  # the user turn (chat) or the prompt (completions)
    prompt_len: int  # estimated tokens of system + text, before any chat template
    output_len: int
    system: str = ""  # a shared system prompt (shared-prefix scenario)
    messages: list | None = None  # a whole conversation from a dataset file

    def chat_messages(self) -> list[dict]:
        if self.messages is not None:
            return self.messages
        msgs = [{"role": "system", "content": self.system}] if self.system else []
        return msgs + [{"role": "user", "content": self.text}]

    def prompt(self) -> str:
        if self.messages is not None:
            return "\n\n".join(str(m.get("content", "")) for m in self.messages)
        return f"{self.system}\n\n{self.text}" if self.system else self.text


def _span(rng: random.Random, n: int, ratio: float) -> int:
    lo, hi = max(1, round(n * (1 - ratio))), max(1, round(n * (1 + ratio)))
    return rng.randint(lo, hi)


@dataclass
class RandomPrompts:
    """Random prompts of input_len tokens (+-range_ratio), asking for output_len tokens (+-range_ratio).
    With prefix_groups > 0, request i belongs to group i % prefix_groups, whose requests all share
    one system prompt of prefix_len tokens."""
    maker: TextMaker
    input_len: int
    output_len: int
    range_ratio: float = 0.0
    seed: int = 0
    prefix_groups: int = 0
    prefix_len: int = 0
    _prefixes: dict = field(default_factory=dict)

    def get(self, i: int) -> Request:
        # Seeded by the shape too: runs of other lengths share no prefix with this one.
        rng = random.Random(f"{self.seed}/{self.input_len}/{self.output_len}/{self.range_ratio}/{i}")
        n_in = _span(rng, self.input_len, self.range_ratio)
        n_out = _span(rng, self.output_len, self.range_ratio)
        text = self.maker.make(rng, n_in)
        system = ""
        if self.prefix_groups > 0 and self.prefix_len > 0:
            g = i % self.prefix_groups
            if g not in self._prefixes:
                prng = random.Random(f"prefix/{self.seed}/{self.prefix_len}/{g}")
                self._prefixes[g] = f"You are agent {g}. " + self.maker.make(prng, self.prefix_len)
            system = self._prefixes[g]
        return Request(text, n_in + (self.prefix_len if system else 0), n_out, system)


@dataclass
class DatasetPrompts:
    """Requests read from a file, shuffled with the seed, drawn in a cycle."""
    items: list[Request]

    def get(self, i: int) -> Request:
        return self.items[i % len(self.items)]


def load_dataset(path: str, fmt: str, maker: TextMaker, output_len: int, seed: int,
                 max_input_len: int | None = None) -> DatasetPrompts:
    """fmt "jsonl": one object a line, {"prompt": str} or {"messages": [...]}, optional "output_len"
    (or "max_tokens"). fmt "sharegpt": a JSON list of {"conversations": [{"from", "value"}, ...]}: the
    first human turn is the prompt and, unless --output-len is given, the reply's length the output."""
    items: list[Request] = []
    text = Path(path).read_text(encoding="utf-8")
    if fmt == "jsonl":
        for n, line in enumerate(text.splitlines(), 1):
            if not line.strip():
                continue
            obj = json.loads(line)
            out = int(obj.get("output_len") or obj.get("max_tokens") or output_len)
            if "messages" in obj:
                r = Request("", sum(maker.count(str(m.get("content", ""))) for m in obj["messages"]), out,
                            messages=obj["messages"])
            elif "prompt" in obj:
                r = Request(obj["prompt"], maker.count(obj["prompt"]), out)
            else:
                raise SystemExit(f"xinfer-bench: {path}:{n}: needs 'prompt' or 'messages'")
            items.append(r)
    elif fmt == "sharegpt":
        for conv in json.loads(text):
            turns = conv.get("conversations") or conv.get("conversation") or []
            if len(turns) < 2:
                continue
            prompt, reply = turns[0].get("value", ""), turns[1].get("value", "")
            n_in = maker.count(prompt)
            n_out = output_len if output_len else maker.count(reply)
            if n_in < 4 or n_out < 4 or (max_input_len and n_in > max_input_len):
                continue  # too short to time, or too long for the model
            items.append(Request(prompt, n_in, n_out))
    else:
        raise SystemExit(f"xinfer-bench: unknown dataset format {fmt!r}")
    if not items:
        raise SystemExit(f"xinfer-bench: no usable requests in {path}")
    random.Random(seed).shuffle(items)
    return DatasetPrompts(items)


# ---------------------------------------------------------------- the HTTP side

def is_loopback(url: str) -> bool:
    host = (urlsplit(url).hostname or "").lower()
    return host in ("localhost", "::1") or host.startswith("127.")


def root_url(base_url: str) -> str:
    """http://host:port/v1 -> http://host:port"""
    return re.sub(r"/v1/?$", "", base_url.rstrip("/"))


@dataclass
class LoadConfig:
    base_url: str
    model: str
    endpoint: str = "chat"  # "chat" or "completions"
    stream: bool = True
    exact: bool = True  # ignore_eos + min_tokens: exact output lengths where the server allows it
    temperature: float | None = None
    concurrency: int | None = None  # None: no cap
    request_rate: float = float("inf")  # requests/s; inf: send as fast as the cap allows
    arrival: str = "poisson"  # or "constant"
    num_requests: int | None = None
    duration: float | None = None  # seconds of sending new requests
    timeout: float = 600.0  # one request's limit, seconds
    extra_body: dict = field(default_factory=dict)


def payload(cfg: LoadConfig, req: Request) -> tuple[str, dict]:
    body: dict = {"model": cfg.model, "max_tokens": req.output_len, "stream": cfg.stream}
    if cfg.endpoint == "chat":
        url = cfg.base_url.rstrip("/") + "/chat/completions"
        body["messages"] = req.chat_messages()
    else:
        url = cfg.base_url.rstrip("/") + "/completions"
        body["prompt"] = req.prompt()
    if cfg.stream:
        body["stream_options"] = {"include_usage": True}
    if cfg.exact:
        body["ignore_eos"] = True
        body["min_tokens"] = req.output_len
    if cfg.temperature is not None:
        body["temperature"] = cfg.temperature
    body.update(cfg.extra_body)
    return url, body


def _text_of(choice: dict, chat: bool) -> str:
    if not chat:
        return choice.get("text") or ""
    d = choice.get("delta") or choice.get("message") or {}
    return (d.get("content") or "") + (d.get("reasoning_content") or d.get("reasoning") or "")


def _short_error(text: str) -> str:
    text = re.sub(r"\s+", " ", text).strip()
    text = re.sub(r"\b(chatcmpl|cmpl|req)-[0-9a-f]+", r"\1-*", text)  # group errors despite request ids
    return text[:300]


async def send_one(session, cfg: LoadConfig, req: Request, t0: float) -> RequestRecord:
    url, body = payload(cfg, req)
    chat = cfg.endpoint == "chat"
    rec = RequestRecord(prompt_len=req.prompt_len)
    start = time.perf_counter()
    rec.start = start - t0
    usage = None
    try:
        async with session.post(url, json=body) as resp:
            if resp.status != 200:
                rec.error = _short_error(f"HTTP {resp.status}: {await resp.text()}")
            elif cfg.stream:
                async for raw in resp.content:
                    line = raw.strip()
                    if not line.startswith(b"data:"):
                        continue
                    data = line[5:].strip()
                    if data == b"[DONE]":
                        break
                    now = time.perf_counter()
                    obj = json.loads(data)
                    if obj.get("error"):
                        err = obj["error"]
                        rec.error = _short_error("stream error: " + str(err.get("message", err)
                                                                         if isinstance(err, dict) else err))
                        break
                    if obj.get("usage"):
                        usage = obj["usage"]
                    for ch in obj.get("choices") or []:
                        if _text_of(ch, chat):
                            if rec.ttft is None:
                                rec.ttft = now - start
                            rec.chunk_times.append(now - t0)
                            break
            else:
                obj = await resp.json(content_type=None)
                usage = obj.get("usage")
                if obj.get("choices"):
                    rec.ttft = time.perf_counter() - start  # not streamed: the first token shows at the end
                    rec.chunk_times.append(time.perf_counter() - t0)
    except asyncio.TimeoutError:
        rec.error = f"timeout after {cfg.timeout:g}s"
    except Exception as e:  # noqa: BLE001 - every failure is a recorded error, never a crash
        rec.error = _short_error(f"{type(e).__name__}: {e}")
    rec.latency = time.perf_counter() - start
    if not rec.error:
        if usage:
            rec.usage_reported = True
            rec.prompt_len = int(usage.get("prompt_tokens") or rec.prompt_len)
            rec.output_len = int(usage.get("completion_tokens") or 0)
            details = usage.get("prompt_tokens_details") or {}
            if details.get("cached_tokens") is not None:
                rec.cached_tokens = int(details["cached_tokens"])
        else:
            rec.output_len = len(rec.chunk_times)
        rec.ok = rec.output_len > 0 or req.output_len == 0
        if not rec.ok:
            rec.error = "empty response"
    return rec


class Progress:
    """A one-line progress bar on stderr (redrawn on a terminal, a line every 10 s otherwise)."""

    def __init__(self, total: int | None, duration: float | None, label: str = "", enabled: bool = True):
        self.total, self.duration, self.label, self.enabled = total, duration, label, enabled
        self.done = self.failed = self.tokens = 0
        self.t0 = time.perf_counter()
        self.tty = sys.stderr.isatty()
        self.last = 0.0

    def update(self, rec: RequestRecord) -> None:
        self.done += 1
        self.failed += not rec.ok
        self.tokens += rec.output_len if rec.ok else 0
        self.draw()

    def draw(self, final: bool = False) -> None:
        if not self.enabled:
            return
        now = time.perf_counter()
        if not final and now - self.last < (0.25 if self.tty else 10.0):
            return
        self.last = now
        el = now - self.t0
        frac = (self.done / self.total if self.total else el / self.duration if self.duration else 0.0)
        frac = min(1.0, frac)
        bar = "#" * int(frac * 30) + "." * (30 - int(frac * 30))
        total = f"/{self.total}" if self.total else ""
        line = (f"{self.label}[{bar}] {self.done}{total} done, {self.failed} failed, "
                f"{self.tokens / max(el, 1e-9):.1f} out tok/s, {el:.0f}s")
        sys.stderr.write(("\r" + line) if self.tty else line + "\n")
        if final and self.tty:
            sys.stderr.write("\n")
        sys.stderr.flush()


async def run_load(cfg: LoadConfig, source, progress: Progress | None = None, on_start=None):
    """Send requests until num_requests or duration; returns (records, duration s).
    on_start(t0) is called as the first request goes out."""
    import aiohttp

    if cfg.num_requests is None and cfg.duration is None:
        raise ValueError("a run needs --num-requests or --duration")
    timeout = aiohttp.ClientTimeout(total=cfg.timeout)
    conn = aiohttp.TCPConnector(limit=0, force_close=False)
    async with aiohttp.ClientSession(timeout=timeout, connector=conn) as session:
        sem = asyncio.Semaphore(cfg.concurrency) if cfg.concurrency else None
        rng = random.Random(12345)  # arrival times only
        records: list[RequestRecord] = []
        tasks = []
        t0 = time.perf_counter()
        if on_start is not None:
            on_start(t0)
        if progress is not None:
            progress.t0 = t0

        async def one(req):
            try:
                rec = await send_one(session, cfg, req, t0)
            finally:
                if sem is not None:
                    sem.release()
            records.append(rec)
            if progress is not None:
                progress.update(rec)

        def time_left() -> bool:
            return cfg.duration is None or time.perf_counter() - t0 < cfg.duration

        i = 0
        next_send = t0
        while (cfg.num_requests is None or i < cfg.num_requests) and time_left():
            if cfg.request_rate != float("inf"):
                gap = 1.0 / cfg.request_rate
                next_send += rng.expovariate(1.0 / gap) if cfg.arrival == "poisson" else gap
                delay = next_send - time.perf_counter()
                if cfg.duration is not None:
                    delay = min(delay, t0 + cfg.duration - time.perf_counter())
                if delay > 0:
                    await asyncio.sleep(delay)
                if not time_left():
                    break
            if sem is not None:
                if cfg.duration is not None:
                    try:
                        await asyncio.wait_for(sem.acquire(), max(0.0, t0 + cfg.duration - time.perf_counter()))
                    except asyncio.TimeoutError:
                        break
                else:
                    await sem.acquire()
            tasks.append(asyncio.create_task(one(source.get(i))))
            i += 1
        if tasks:
            await asyncio.gather(*tasks)
        duration = time.perf_counter() - t0
    if progress is not None:
        progress.draw(final=True)
    records.sort(key=lambda r: r.start)
    return records, duration


async def get_json(url: str, timeout: float = 10.0):
    import aiohttp
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout)) as s:
        async with s.get(url) as r:
            r.raise_for_status()
            return await r.json(content_type=None)


async def first_model(base_url: str) -> str:
    data = await get_json(base_url.rstrip("/") + "/models")
    return data["data"][0]["id"]


# ---------------------------------------------------------------- the server's /metrics

def parse_prometheus(text: str) -> dict[str, float]:
    """Prometheus text format -> {metric name: value summed over its label sets}."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        m = re.match(r"^([A-Za-z_:][A-Za-z0-9_:]*)(\{.*\})?\s+(\S+)", line)
        if not m:
            continue
        try:
            v = float(m.group(3))
        except ValueError:
            continue
        out[m.group(1)] = out.get(m.group(1), 0.0) + v
    return out


async def scrape_metrics(base_url: str) -> dict[str, float] | None:
    """The server's /metrics, or None when it has none (404, refused, not Prometheus text)."""
    import aiohttp
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5)) as s:
            async with s.get(root_url(base_url) + "/metrics") as r:
                if r.status != 200:
                    return None
                return parse_prometheus(await r.text()) or None
    except Exception:  # noqa: BLE001
        return None


def _find(d: dict, *suffixes: str) -> str | None:
    for k in d:
        if any(k.endswith(s) for s in suffixes):
            return k
    return None


def metrics_delta(before: dict | None, after: dict | None) -> dict | None:
    """What the run did to the server's counters: prefix-cache hit rate, preemptions, and the raw
    deltas of every counter whose name mentions the prefix cache, preemption or the KV cache."""
    if not before or not after:
        return None
    keys = [k for k in after if re.search(r"prefix_cache|preempt|kv_cache|cache_hit", k)]
    out: dict = {"deltas": {k: after[k] - before.get(k, 0.0) for k in keys}}
    hits = _find(after, "prefix_cache_hits_total", "prefix_cache_hits")
    queries = _find(after, "prefix_cache_queries_total", "prefix_cache_queries")
    if hits and queries:
        dq = after[queries] - before.get(queries, 0.0)
        out["prefix_cache_hit_rate"] = (after[hits] - before.get(hits, 0.0)) / dq if dq > 0 else None
    pre = _find(after, "num_preemptions_total", "preemptions_total", "num_preemptions")
    if pre:
        out["preemptions"] = after[pre] - before.get(pre, 0.0)
    return out


# ---------------------------------------------------------------- the server's memory

def listening_pid(port: int) -> int | None:
    """The process listening on a local TCP port (psutil; needs the right to see its sockets)."""
    try:
        import psutil
    except ImportError:
        return None
    try:
        for c in psutil.net_connections(kind="tcp"):
            if c.status == psutil.CONN_LISTEN and c.laddr and c.laddr.port == port and c.pid:
                return c.pid
    except (psutil.AccessDenied, PermissionError):
        return None
    return None


def rss_by_process(pid: int) -> dict[str, int]:
    """Resident bytes of a process and its descendants by name (xinfer's titles: xinfer::worker, ...;
    else the executable's name, `#pid` added where two share it); empty when it is gone."""
    import psutil
    try:
        p = psutil.Process(pid)
        procs = [p] + p.children(recursive=True)
    except psutil.Error:
        return {}
    out = {}
    for q in procs:
        try:
            argv0 = (q.cmdline() or [q.name()])[0]
            name = argv0 if argv0.startswith("xinfer::") else os.path.basename(argv0)
            out[f"{name}#{q.pid}" if name in out else name] = q.memory_info().rss
        except psutil.Error:
            pass
    return out


def tree_rss(pid: int) -> int | None:
    """Resident memory in bytes of a process and all its descendants; None when it is gone."""
    by = rss_by_process(pid)
    return sum(by.values()) if by else None
