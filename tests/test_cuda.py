"""The CUDA path for real: Triton kernels compiled (not interpreted), the bundled model's logits
against transformers on the same weights, decode graphs against eager steps. Needs a CUDA GPU and
TRITON_INTERPRET=0 (bench/gpu_check.sh runs it on a lent device); skipped elsewhere."""
import os

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("CUDA tests: no CUDA device here (bench/gpu_check.sh runs them on a GPU)", allow_module_level=True)
if os.environ.get("TRITON_INTERPRET") == "1":
    pytest.skip("CUDA tests: TRITON_INTERPRET=1 would interpret the kernels; run with TRITON_INTERPRET=0",
                allow_module_level=True)

from xinfer import Engine, EngineConfig, SamplingParams

DEV = torch.device("cuda")
TEXT = ("The quick brown fox jumps over the lazy dog. Paged attention stores keys and values in fixed-size "
        "blocks, so sequences of any length share one pool of memory without fragmentation. ") * 4


def test_triton_kernels_compiled_match_the_reference():
    from ops import triton_attention as ta
    from tests.attention_ref import make_batch, ref_paged_attention
    for dtype, tol in ((torch.float32, 2e-3), (torch.bfloat16, 2e-2)):
        q, kc, vc, cu, lens, tables = (t.to(DEV) for t in make_batch([1, 7, 1, 33, 1], [40, 7, 300, 80, 1], 2, 4, 64,
                                                                     dtype))
        out = ta.paged_attention(q, kc, vc, cu, lens, tables, 0.125, max_seqlen_q=33)
        ref = ref_paged_attention(q.cpu(), kc.cpu(), vc.cpu(), cu.cpu(), lens.cpu(), tables.cpu(), 0.125)
        torch.testing.assert_close(out.float().cpu(), ref.float(), atol=tol, rtol=tol)


@pytest.fixture(scope="module")
def cuda_engine(smollm_path):
    e = Engine(EngineConfig(model=smollm_path, device="cuda", dtype="bfloat16", quantization="none"))
    yield e
    e.close()


def test_logits_within_bf16_of_transformers(cuda_engine, smollm_hf):
    ids = cuda_engine.tokenizer.encode(TEXT)[:256]
    ours = cuda_engine.runner.log_probs(ids).float().cpu()
    with torch.no_grad():
        ref = torch.log_softmax(smollm_hf(torch.tensor([ids])).logits[0].float(), dim=-1)
    kld = (ref.exp() * (ref - ours)).sum(-1).mean().item()
    same = (ours.argmax(-1) == ref.argmax(-1)).float().mean().item()
    assert kld < 0.01 and same > 0.95, (kld, same)


def test_graphs_on_and_off_give_identical_tokens(smollm_path):
    """8 sequences of one length: every decode batch is exactly a bucket (no padding), so the graph
    and the eager step run the same GEMM shapes; float32 without TF32."""
    torch.backends.cuda.matmul.allow_tf32 = False
    prompts = [[1, 2 + i, 30 + i, 400 + 7 * i] for i in range(8)]
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    out = {}
    for eager in (True, False):
        e = Engine(EngineConfig(model=smollm_path, device="cuda", dtype="float32", quantization="none",
                                attention_backend="triton", enforce_eager=eager, max_num_seqs=16))
        out[eager] = [o.token_ids for o in e.generate(prompts, params)]
        if not eager:
            assert e.runner.graphs is not None and e.runner.graphs.replays >= 20
        e.close()
    assert out[True] == out[False]
