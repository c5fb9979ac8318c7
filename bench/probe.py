"""`xinfer-bench offline --profile`: where a run's time goes, printed after its table.

- the host: the run's Python functions by own time (cProfile), the scheduler and worker included when
  the worker runs in-process;
- the device (CUDA, in-process): one decode step's GPU time alone, a captured graph replayed over a
  given context (no host work between replays), against the run's measured time per step; and an
  eager decode step's kernels by GPU time (torch.profiler), the share attention, GEMMs and the rest take.
"""
from __future__ import annotations

import cProfile
import io
import pstats

import torch

from xinfer.workers.batch import forward


def host_profile(run, top: int = 30):
    """run() under cProfile; returns its result and the top functions by own time as text."""
    prof = cProfile.Profile()
    prof.enable()
    try:
        result = run()
    finally:
        prof.disable()
    buf = io.StringIO()
    pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(top)
    return result, buf.getvalue()


def _rows(batch: int, context: int, block_size: int):
    per = -(-context // block_size)
    return [(list(range(i * per, (i + 1) * per)), context - 1, [0]) for i in range(batch)], per


def device_profile(runner, batches=(1, 64, 256), contexts=(128, 600, 1024), repeats: int = 20) -> str:
    """Decode-step GPU times from the runner's graphs, and one eager step's kernels (CUDA only)."""
    if runner.device.type != "cuda":
        return "device profile: not on a CUDA device"
    lines, g, bs = [], runner.graphs, runner.block_size
    if g is not None:
        for b in batches:
            for ctx in contexts:
                rows, per = _rows(b, ctx, bs)
                if b not in g.graphs or b * per > runner.num_blocks or per > g.width:
                    continue
                g.run(rows)  # fills the static buffers: the replays below read them
                replay = g.graphs[b][0]
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                torch.cuda.synchronize()
                start.record()
                for _ in range(repeats):
                    replay()
                end.record()
                torch.cuda.synchronize()
                ms = start.elapsed_time(end) / repeats
                lines.append(f"decode graph replay: batch {b:4d}, context {ctx:5d}: {ms:7.3f} ms a step, "
                             f"{b / ms * 1000:9.0f} tok/s if the host kept up")
    b = min(max(batches), runner.config.max_num_seqs)
    rows, per = _rows(b, 600, bs)
    if b * per <= runner.num_blocks:
        step = lambda: forward(runner.model, runner.backend, runner.device, bs, rows)
        with torch.inference_mode():
            step()
            torch.cuda.synchronize()
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
                step()
                torch.cuda.synchronize()
        lines.append(f"eager decode step, batch {b}, context 600, kernels by GPU time:")
        lines.append(prof.key_averages().table(sort_by="self_device_time_total", row_limit=15, max_name_column_width=60))
    return "\n".join(lines)
