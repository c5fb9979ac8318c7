"""`xinfer-bench curve`: output tok/s against concurrency, from compare results."""
from __future__ import annotations

import json
from pathlib import Path


def run(args) -> int:
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
