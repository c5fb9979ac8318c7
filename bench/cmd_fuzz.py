"""`xinfer-bench fuzz`: the property-based fuzz of tests/test_fuzz.py, as long as you like."""
from __future__ import annotations

import sys

from bench.fuzz import fuzz


def run(args) -> int:
    base = args.base_url.rstrip("/").removesuffix("/v1")
    report = fuzz(base, examples=args.examples, timeout=args.timeout, seed=args.seed,
                  progress=lambda text: print("xinfer-bench fuzz:", text, file=sys.stderr, flush=True))
    print(report.line())
    for f in report.failures[:20]:
        print("FAIL", f)
    return 1 if report.failures else 0
