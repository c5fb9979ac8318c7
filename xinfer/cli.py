"""The `xinfer` command line."""
from __future__ import annotations

import argparse
import dataclasses
import importlib.metadata
import importlib.util
import os
import sys
import time

from xinfer import chat_cli, envs
from xinfer.api.mcp_servers import load_config as load_mcp_config
from xinfer.config import EngineConfig
from xinfer.errors import XinferError
from xinfer.launch import launch
from xinfer.parsers import TOOL_PARSERS, get_tool_parser, reasoning_markers
from xinfer.parsers.reasoning import REASONING_PARSERS
from xinfer.process import setup_logging


ALIASES = {"model": ["--m"], "kvcache_dtype": ["--kv-cache-dtype"], "tensor_parallel_size": ["-tp"],  # short, and vLLM's
           "pipeline_parallel_size": ["-pp"], "devices": ["--d"],  # spelling; --d: xInfer's
           "enforce_eager": ["--disable-cuda-graph"]}  # SGLang's


def add_engine_args(p: argparse.ArgumentParser) -> None:
    """One flag per EngineConfig field, --like-this, and the ALIASES."""
    for f in dataclasses.fields(EngineConfig):
        flag = "--" + f.name.replace("_", "-")
        names = [flag] + ALIASES.get(f.name, [])
        if f.name == "enable_prefix_cache":
            p.add_argument("--disable-prefix-cache", dest="enable_prefix_cache", action="store_false",
                           help="turn off prefix caching (on by default)")
            continue
        t = str(f.type)  # annotations are strings here: "int", "float | None", ...
        if t == "bool":
            p.add_argument(*names, dest=f.name, action="store_true", help=f"(default: {f.default})")
            continue
        kind = int if t.startswith("int") else float if t.startswith("float") else str
        p.add_argument(*names, dest=f.name, type=kind, default=f.default, help=f"(default: {f.default})")


def engine_config(args) -> EngineConfig:
    return EngineConfig(**{f.name: getattr(args, f.name) for f in dataclasses.fields(EngineConfig)})


def cmd_generate(args) -> int:
    from xinfer import Engine, SamplingParams

    engine = Engine(engine_config(args))
    prompts = [p for p in args.prompts.split("|")] if args.prompts else ["Hello"]
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                            top_k=args.top_k, seed=args.seed_sampling, ignore_eos=args.batch is not None)
    tok = engine.tokenizer
    use_chat = not args.no_chat and tok is not None and tok.chat_template
    if use_chat:
        prompts = [tok.encode_chat([{"role": "user", "content": p}]) for p in prompts]
    if args.batch is None:
        for i, out in enumerate(engine.generate(prompts, params)):
            print(f"--- [{i}] ({len(out.token_ids)} tokens, {out.finish_reason})")
            print(out.text)
        return 0
    # Throughput mode: the first prompt N times, exact output lengths.
    batch = [prompts[0]] * args.batch
    t0 = time.perf_counter()
    outs = engine.generate(batch, params)
    t1 = time.perf_counter()
    first = max(o.first_token_time for o in outs) - min(o.queued_time for o in outs)
    n_prompt = sum(len(o.prompt_token_ids) for o in outs)
    n_out = sum(len(o.token_ids) for o in outs)
    decode_s = max(t1 - t0 - first, 1e-9)
    print(f"batch {args.batch}: {n_prompt} prompt tokens, {n_out} generated tokens in {t1 - t0:.2f}s")
    print(f"prefill {n_prompt / max(first, 1e-9):.1f} tok/s, decode {(n_out - len(outs)) / decode_s:.1f} tok/s, "
          f"overall output {n_out / (t1 - t0):.1f} tok/s")
    print(f"sample: {outs[0].text[:200]!r}")
    return 0


def cmd_serve(args) -> int:
    if args.headless:
        from xinfer.workers.headless import serve_headless
        if args.tensor_parallel_size * args.pipeline_parallel_size == 1:
            args.tensor_parallel_size = args.nnodes  # a placeholder: the sizes come from node 0
        return serve_headless(engine_config(args), args.log_level)
    if args.enforce_parser is not None:
        try:
            args.enforce_parser = get_tool_parser(args.enforce_parser).name  # vLLM's names are taken too
        except ValueError as e:
            raise ValueError(f"--enforce-parser / --tool-call-parser: {e}") from None
    if args.reasoning_parser is not None:
        reasoning_markers(None, args.reasoning_parser)  # an unknown name stops here, with the list
    mcp_servers = mcp_check(args)
    if args.embedding_model and not os.path.isfile(os.path.join(args.embedding_model, "config.json")):
        raise ValueError(f"--embedding-model {args.embedding_model}: not an HF model folder (no config.json)")
    api_options = dict(ui_port=args.port + 1 if args.ui_server else None,
                       api_key=args.api_key or envs.api_key(),
                       max_n=args.max_n, max_prompts=args.max_prompts_per_request,
                       request_timeout=args.request_timeout,
                       max_request_bytes=args.max_request_bytes,
                       enforce_parser=args.enforce_parser, disable_reasoning=args.disable_reasoning,
                       enable_tool_grammar=args.enable_tool_grammar,
                       trust_request_chat_template=args.trust_request_chat_template,
                       reasoning_parser=args.reasoning_parser,
                       ssl_certfile=args.ssl_certfile, ssl_keyfile=args.ssl_keyfile,
                       served_model_names=args.served_model_name, strict_model_names=args.strict_model_names,
                       strict_max_tokens=args.strict_max_tokens, access_log=args.access_log,
                       keepalive_s=args.sse_keepalive,
                       allowed_hosts=args.allowed_hosts, allowed_origins=args.allowed_origins,
                       keep_alive_timeout=args.keep_alive_timeout, request_read_timeout=args.request_read_timeout,
                       max_connections_per_client=args.max_connections_per_client,
                       mcp_servers=mcp_servers, mcp_max_rounds=args.mcp_max_rounds, mcp_timeout=args.mcp_timeout,
                       embedding_model=args.embedding_model, embedding_pooling=args.embedding_pooling,
                       allowed_media_domains=args.allowed_media_domains,
                       allowed_local_media_path=args.allowed_local_media_path, max_image_bytes=args.max_image_bytes,
                       media_fetch_timeout=args.media_fetch_timeout, limit_mm_per_prompt=args.limit_mm_per_prompt)
    return launch(engine_config(args), args.host, args.port, args.log_level, args.max_queued_requests,
                  args.drain_timeout, args.startup_timeout, api_options)


def mcp_check(args) -> dict | None:
    """The MCP servers of --mcp-config / --mcp-command; a bad file stops here, before anything starts."""
    servers = load_mcp_config(args.mcp_config, args.mcp_command, args.mcp_args)
    if args.mcp_max_rounds < 1 or not args.mcp_timeout > 0:
        raise ValueError("--mcp-max-rounds must be >= 1 and --mcp-timeout > 0")
    if servers and (importlib.util.find_spec("mcp") is None
                    or int(importlib.metadata.version("mcp").split(".")[0]) < 2):  # v2's Client is used
        raise ValueError("MCP servers need the mcp package, version 2 or later: pip install 'xinfer[mcp]'")
    return servers


def cmd_chat(args) -> int:
    if args.url is None:
        args.engine_config = engine_config(args)
    return chat_cli.cmd_chat(args)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="xinfer", description="LLM inference engine")
    log_levels = ["debug", "info", "warning", "error"]
    parser.add_argument("--log-level", default="info", choices=log_levels)
    sub = parser.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="generate text offline (no server)")
    # Also after the command; SUPPRESS keeps a value given before it when it is not repeated.
    g.add_argument("--log-level", default=argparse.SUPPRESS, choices=log_levels)
    add_engine_args(g)
    g.add_argument("--prompts", help="prompts separated by '|'")
    g.add_argument("--max-tokens", type=int, default=64)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--seed-sampling", type=int, default=None, help="per-request sampling seed")
    g.add_argument("--batch", type=int, default=None, help="throughput mode: run the first prompt N times")
    g.add_argument("--no-chat", action="store_true", help="send prompts raw, without the chat template")
    g.set_defaults(func=cmd_generate)

    s = sub.add_parser("serve", help="start the OpenAI-compatible server with the web chat page "
                       "(under the xinfer-launch supervisor)")
    s.add_argument("--log-level", default=argparse.SUPPRESS, choices=log_levels)
    add_engine_args(s)
    # A server refuses what it cannot start in time (retry later); an offline batch just waits.
    s.set_defaults(max_queue_wait=120.0)
    s.add_argument("--host", default="127.0.0.1")
    s.add_argument("--port", type=int, default=8000)
    s.add_argument("--max-queued-requests", type=int, default=256,
                   help="requests waiting beyond --max-num-seqs before new ones get 503")
    s.add_argument("--drain-timeout", type=float, default=30.0,
                   help="on SIGTERM/SIGINT: seconds in-flight requests may take to finish")
    s.add_argument("--api-key", default=None,
                   help="require 'Authorization: Bearer KEY' on every route but /, /health and /metrics "
                        "(or set XINFER_API_KEY)")
    s.add_argument("--max-n", type=int, default=16, help="largest n (choices per request) accepted")
    s.add_argument("--max-prompts-per-request", type=int, default=256,
                   help="most prompts in one /v1/completions request (more get 400)")
    s.add_argument("--request-timeout", type=float, default=0.0,
                   help="seconds a generation request may run before it is ended with 408 (0: no limit)")
    s.add_argument("--max-request-bytes", type=int, default=8 << 20, help="larger request bodies get 413")
    s.add_argument("--allowed-hosts", nargs="+", default=None, metavar="HOST",
                   help="Host header values answered, other ones get 421 (NAME allows any port, NAME:PORT "
                        "one, '*' any); default: loopback names when bound to loopback, else any")
    s.add_argument("--allowed-origins", nargs="+", default=[], metavar="ORIGIN",
                   help="web pages on other origins allowed to call the API (CORS; '*': any); "
                        "a cross-origin POST from any other gets 403")
    s.add_argument("--keep-alive-timeout", type=float, default=5.0,
                   help="seconds an idle connection is kept open")
    s.add_argument("--request-read-timeout", type=float, default=30.0,
                   help="seconds a request's head and body may take to arrive (408 and close after)")
    s.add_argument("--max-connections-per-client", type=int, default=None, metavar="N",
                   help="open connections per client address; more get 429 and are closed (0: no limit; "
                        "default 64, loopback clients not counted)")
    s.add_argument("--enforce-parser", "--tool-call-parser", dest="enforce_parser", default=None,
                   help=f"tool-call parser ({', '.join(TOOL_PARSERS)}, or vLLM's names for them: hermes, "
                        "llama3_json, deepseek_v3, qwen3_coder, glm45, glm47, kimi_k2); default: chosen from "
                        "the model's chat template and architecture")
    s.add_argument("--served-model-name", nargs="+", default=None, metavar="NAME",
                   help="the model's name in /v1/models and in responses (the first; all answer "
                        "/v1/models/{id}); default: the model's folder or file name, or its HF id")
    s.add_argument("--strict-model-names", action="store_true",
                   help="a request naming a model not served gets 404 (default: any name is served)")
    s.add_argument("--strict-max-tokens", action="store_true",
                   help="max_tokens over the room left in the context is a 400 (default: cut to the room)")
    s.add_argument("--access-log", action="store_true", help="log one line per request")
    s.add_argument("--ssl-certfile", default=None, help="serve HTTPS with this certificate (PEM; with --ssl-keyfile)")
    s.add_argument("--ssl-keyfile", default=None, help="the certificate's private key (PEM)")
    s.add_argument("--reasoning-parser", default=None,
                   help=f"reasoning markers by name ({', '.join(REASONING_PARSERS)}; none: no reasoning split); "
                        "default: from the chat template")
    s.add_argument("--enable-tool-grammar", action="store_true",
                   help="with tool_choice auto, a tool call the model opens is held to its JSON schema by "
                        "a grammar (forced calls always are)")
    s.add_argument("--trust-request-chat-template", action="store_true",
                   help="accept a request's own 'chat_template' (vLLM's flag): it renders sandboxed, time-boxed "
                        "and size-capped; without the flag such a request is a 400")
    s.add_argument("--disable-reasoning", action="store_true",
                   help="requests think only when they ask to (the default of their 'thinking' flag)")
    s.add_argument("--sse-keepalive", type=float, default=15.0,
                   help="seconds without output before a stream gets a keep-alive comment")
    s.add_argument("--mcp-config", default=None, metavar="FILE",
                   help="MCP servers whose tools the server offers to the model and runs itself (JSON: "
                        "{\"mcpServers\": {name: {\"command\", \"args\", \"env\"} or {\"url\"}}})")
    s.add_argument("--mcp-command", default=None, metavar="CMD", help="one stdio MCP server to run (named 'mcp')")
    s.add_argument("--mcp-args", nargs="+", default=[], metavar="ARG", help="the --mcp-command's arguments")
    s.add_argument("--mcp-max-rounds", type=int, default=5,
                   help="rounds of MCP tool calls in one chat request; a reply calling MCP tools after them is "
                        "returned as it is")
    s.add_argument("--mcp-timeout", type=float, default=30.0,
                   help="seconds an MCP tool call may take (a restart of its server included)")
    s.add_argument("--embedding-model", default=None, metavar="PATH",
                   help="an HF folder of a BERT-style encoder (e.g. all-MiniLM-L6-v2) that serves /v1/embeddings, "
                        "in the API process on the CPU; default: the served model's pooled hidden states")
    s.add_argument("--allowed-media-domains", nargs="+", default=None, metavar="HOST",
                   help="hosts whose http(s) image URLs the server fetches (default: none; data: URLs always work)")
    s.add_argument("--allowed-local-media-path", default=None, metavar="DIR",
                   help="a folder whose image files requests may name by path (default: none)")
    s.add_argument("--max-image-bytes", type=int, default=20 << 20, help="largest image accepted, in bytes")
    s.add_argument("--media-fetch-timeout", type=float, default=10.0, help="seconds to fetch one image URL")
    s.add_argument("--limit-mm-per-prompt", type=int, default=4, help="most images in one request")
    s.add_argument("--embedding-pooling", default="mean", choices=["mean", "cls"],
                   help="--embedding-model's pooling: mean over the tokens, or the [CLS] token")
    s.add_argument("--ui-server", action="store_true",
                   help="also serve the web chat page on port + 1 (the API port serves it at / too)")
    s.add_argument("--headless", action="store_true",
                   help="a node other than node 0 (--nnodes, --node-rank): run this node's model ranks only, with "
                        "the step plans node 0 sends (no API, no scheduler)")
    s.set_defaults(func=cmd_serve)

    c = sub.add_parser("chat", help="chat in the terminal (engine in this process, or --url of a server)")
    # Warnings only by default: the loading messages would bury the prompt.
    c.add_argument("--log-level", default="warning", choices=log_levels)
    add_engine_args(c)
    chat_cli.add_chat_args(c)
    c.set_defaults(func=cmd_chat)

    args = parser.parse_args(argv)
    name = "xinfer" if args.command != "serve" else f"xinfer::node-{args.node_rank}" if args.headless else "xinfer::launch"
    setup_logging(args.log_level, name)
    try:
        return args.func(args)
    except (XinferError, ValueError, FileNotFoundError) as e:
        print(f"xinfer: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


def launch_main(argv=None) -> int:
    """`xinfer-launch ...` is `xinfer serve ...`."""
    argv = list(sys.argv[1:] if argv is None else argv)
    return main(["serve"] + argv)


if __name__ == "__main__":
    sys.exit(main())
