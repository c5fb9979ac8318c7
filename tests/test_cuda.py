"""The CUDA path for real: Triton kernels compiled (not interpreted), a small Qwen3's logits
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
def qwen3(tmp_path_factory):
    """A small random Qwen3 (q/k norms, GQA) saved by transformers: no download on the device."""
    import transformers as tf
    from tests.test_models import perturbed
    torch.manual_seed(0)
    cfg = tf.Qwen3Config(vocab_size=2048, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                         num_attention_heads=8, num_key_value_heads=4, head_dim=64, max_position_embeddings=1024)
    model = perturbed(tf.Qwen3ForCausalLM(cfg).eval())
    path = tmp_path_factory.mktemp("qwen3")
    model.save_pretrained(path)
    return str(path), model


def test_logits_within_bf16_of_transformers(qwen3):
    path, ref_model = qwen3
    ids = [(37 * i + 11) % 2048 for i in range(300)]
    e = Engine(EngineConfig(model=path, device="cuda", dtype="bfloat16"))
    ours = e.runner.log_probs(ids).float().cpu()
    e.close()
    with torch.no_grad():
        ref = torch.log_softmax(ref_model(torch.tensor([ids])).logits[0].float(), dim=-1)
    kld = (ref.exp() * (ref - ours)).sum(-1).mean().item()
    same = (ours.argmax(-1) == ref.argmax(-1)).float().mean().item()
    assert kld < 1e-3 and same > 0.9, (kld, same)


def test_graphs_on_and_off_give_identical_tokens(qwen3):
    """8 sequences of one length: every decode batch is exactly a bucket (no padding), so the graph
    and the eager step run the same GEMM shapes; float32 without TF32."""
    torch.backends.cuda.matmul.allow_tf32 = False
    prompts = [[1, 2 + i, 30 + i, 400 + 7 * i] for i in range(8)]
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    out = {}
    for eager in (True, False):
        e = Engine(EngineConfig(model=qwen3[0], device="cuda", dtype="float32", attention_backend="triton",
                                enforce_eager=eager, max_num_seqs=16))
        out[eager] = [o.token_ids for o in e.generate(prompts, params)]
        if not eager:
            assert e.runner.graphs is not None and e.runner.graphs.replays >= 20
        e.close()
    assert out[True] == out[False]


def test_graphs_with_padding_and_sampling_give_the_eager_tokens(qwen3):
    """Lengths that finish at different steps (padded buckets) and seeded sampling with top-k / top-p
    on the GPU: bfloat16, so rows may round differently in other GEMM shapes; most sequences must
    still agree token for token."""
    prompts = [[5 + i, 6, 7 + 3 * i] for i in range(11)]
    params = [SamplingParams(max_tokens=6 + 3 * i, temperature=0.8, top_p=0.9, top_k=50, seed=i, ignore_eos=True)
              for i in range(11)]
    out = {}
    for eager in (True, False):
        e = Engine(EngineConfig(model=qwen3[0], device="cuda", attention_backend="triton", enforce_eager=eager))
        out[eager] = [o.token_ids for o in e.generate(prompts, params)]
        e.close()
    assert sum(a == b for a, b in zip(out[True], out[False])) >= 9
