"""Decode graphs (xinfer/workers/graphs.py) on the CPU: buckets, padding, static buffer updates and
output slices through the capture stand-in `Rerun` (XINFER_CPU_GRAPHS=1) and the Triton kernels
under the interpreter; the memory sizing's arithmetic. tests/test_cuda.py runs real graphs."""
import pytest
import torch

from tests.conftest import has_triton
from xinfer import Engine, EngineConfig, SamplingParams
from xinfer.workers import graphs

PROMPTS = [[5, 6, 7], [9, 10], [3, 4, 5, 6, 7, 8, 9], [11], [12, 13, 14, 15], [20, 21]]


def test_buckets_follow_vllm_sizes():
    assert graphs.buckets(1) == [1]
    assert graphs.buckets(6) == [1, 2, 4, 6]
    assert graphs.buckets(64) == [1, 2, 4] + list(range(8, 65, 8))
    assert graphs.buckets(20) == [1, 2, 4, 8, 16, 20]
    sizes = graphs.buckets(20)
    assert [graphs.bucket_for(n, sizes) for n in (1, 3, 4, 5, 17, 20, 21)] == [1, 4, 4, 8, 20, 20, None]


def test_kv_budget_takes_activations_and_graphs_before_the_fraction():
    gib = 1 << 30
    assert graphs.kv_budget(10 * gib, 2 * gib, gib, 0.5) == int(3.5 * gib)
    with pytest.raises(ValueError, match="no device memory left for the KV cache.*--enforce-eager"):
        graphs.kv_budget(gib, gib, 1, 0.9)


def test_profile_counts_the_peak_above_what_is_held():
    class Memory:  # allocations: 5 held, then a run that peaks at 5 + 7
        def start(self):
            return 5

        def peak(self):
            return 12
    assert graphs.profile(lambda: None, Memory()) == 7


def test_profile_rows_are_the_largest_step_and_graph():
    cfg = EngineConfig(max_num_batched_tokens=1100, prefill_chunk_size=512, max_num_seqs=20)
    prefill, decode = graphs.profile_rows(cfg, 16)
    assert [len(t) for _, _, t in prefill] == [512, 512, 76]
    assert [len(b) for b, _, _ in prefill] == [32, 32, 5]
    assert sorted(x for b, _, _ in prefill for x in b) == list(range(69))  # no block shared
    assert len(decode) == 20 and all(len(t) == 1 for _, _, t in decode)
    short = EngineConfig(max_num_batched_tokens=8192, prefill_chunk_size=2048, max_model_len=1000)
    prefill, _ = graphs.profile_rows(short, 16)
    assert [len(t) for _, _, t in prefill] == [1000] * 8 + [192]  # no chunk past the model's positions


def test_why_not_names_each_reason(tiny_llama_path, monkeypatch):
    from ops.attention import TorchBackend
    eng = Engine(EngineConfig(model=tiny_llama_path, num_kv_blocks=16))
    runner = eng.core.runner
    cfg = runner.config
    assert runner.graphs is None and runner.graph_why == "not on a CUDA device"
    monkeypatch.setenv("XINFER_CPU_GRAPHS", "1")
    assert "torch attention backend" in graphs.why_not(cfg, runner.model, TorchBackend(), runner.device)
    triton = type("B", (), {"name": "triton"})()
    assert graphs.why_not(cfg, runner.model, triton, runner.device) is None
    cfg.enforce_eager = True
    assert graphs.why_not(cfg, runner.model, triton, runner.device) == "--enforce-eager"
    cfg.enforce_eager = False
    moe = type("Moe", (torch.nn.Module,), {"cuda_graphs": False})()
    assert "data-dependent" in graphs.why_not(cfg, moe, triton, runner.device)
    eng.close()


@pytest.mark.skipif(not has_triton(), reason="triton is not installed: the graphs read the cache through its kernels")
def test_graph_replays_give_the_eager_tokens(tiny_llama_path, monkeypatch):
    """Six sequences of different lengths finish at different steps, so the batch walks down
    through the buckets (6 -> padded 6, 5 -> 6, 3 -> 4, ...) and stale rows sit past the live
    ones; a graph reading anything but its static buffers would give other tokens."""
    base = {"model": tiny_llama_path, "num_kv_blocks": 64, "attention_backend": "triton", "max_num_seqs": 6}
    params = [SamplingParams(max_tokens=3 + 2 * i, ignore_eos=True) for i in range(len(PROMPTS))]
    eager = Engine(EngineConfig(**base, enforce_eager=True))
    want = [o.token_ids for o in eager.generate(PROMPTS, params)]
    assert eager.core.runner.graphs is None
    eager.close()
    monkeypatch.setenv("XINFER_CPU_GRAPHS", "1")
    eng = Engine(EngineConfig(**base))
    g = eng.core.runner.graphs
    assert g is not None and g.sizes == [1, 2, 4, 6]
    got = [o.token_ids for o in eng.generate(PROMPTS, params)]
    assert got == want
    assert g.replays >= 10  # most steps were decodes: they went through the graphs
    # a real graph keeps pointers only: each tensor its metadata reads is held by the graphs' object
    held = {t.untyped_storage().data_ptr() for t in [g.cu, *g.dev.values()]}
    for meta in g.metas.values():
        for t in (meta.cu_seqlens_q, meta.seq_lens, meta.block_tables, meta.slot_mapping):
            assert t.untyped_storage().data_ptr() in held
    eng.close()
    # pipelined (CUDA's default): a graph's input ids come from the step before it on the device,
    # its host mirrors alternate
    monkeypatch.setenv("XINFER_CPU_PIPELINE", "1")
    eng = Engine(EngineConfig(**base, overlap_schedule="on"))
    assert [o.token_ids for o in eng.generate(PROMPTS, params)] == want
    assert eng.core.runner.graphs.replays >= 10 and eng.core.runner.early_launches >= 8
    eng.close()


def test_block_table_and_a_row_past_its_blocks():
    """forward()'s block table (also the graphs' mirror) is each row's blocks, zero-padded; a row whose
    tokens reach past its blocks is refused, not sent to block 0 (a padding entry)."""
    import numpy as np
    from xinfer.workers.batch import block_table, forward
    rows = [([3, 9], 17, [1]), ([5], 0, [1, 2, 3]), ([7, 2, 4], 40, [1])]
    table, nblk = block_table(rows)
    assert table.tolist() == [[3, 9, 0], [5, 0, 0], [7, 2, 4]] and nblk.tolist() == [2, 1, 3]
    out = np.full((4, 5), -1, dtype=np.int32)
    block_table(rows[:2], out)
    assert out.tolist() == [[3, 9, -1, -1, -1], [5, -1, -1, -1, -1]] + [[-1] * 5] * 2
    with pytest.raises(ValueError, match="row 1 reaches position 16 with 1 blocks of 16"):
        forward(None, None, torch.device("cpu"), 16, [([3, 9], 17, [1]), ([5], 14, [1, 2, 3])])
