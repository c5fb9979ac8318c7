"""xinfer-bench: load tests and throughput benchmarks for xinfer and any OpenAI-compatible server.

bench.cli      the `xinfer-bench` command: flags and subcommands (serve, compare, curve, soak, offline)
bench.cmd_*    one module per subcommand; bench.common holds what they share
bench.load     prompts (random, shared-prefix, JSONL, ShareGPT) and the asyncio HTTP load runner
bench.stats    per-request records -> figures (TTFT, TPOT, ITL, e2e, goodput), vLLM key names
bench.plots    PNG plots of a run, a sweep, a comparison and a soak
"""
