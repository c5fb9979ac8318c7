"""Every architecture: xinfer's logits equal transformers' on the same random tiny weights,
for a batch of prompts of different lengths, through chunked prefill and 32 decode steps (12 under the Triton interpreter)."""
import pytest
import torch
import transformers as tf

from tests.conftest import BACKENDS
from xinfer import Engine, EngineConfig, SamplingParams

SMALL = dict(vocab_size=320, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)

ARCHS = {
    "llama": lambda: tf.LlamaForCausalLM(tf.LlamaConfig(**SMALL, tie_word_embeddings=False)),
    "llama_tied_llama3_rope": lambda: tf.LlamaForCausalLM(tf.LlamaConfig(
        **SMALL, tie_word_embeddings=True, rope_scaling={
            "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64})),
    "qwen2": lambda: tf.Qwen2ForCausalLM(tf.Qwen2Config(**SMALL)),
    "qwen3": lambda: tf.Qwen3ForCausalLM(tf.Qwen3Config(**SMALL, head_dim=32)),
    "qwen3_moe": lambda: tf.Qwen3MoeForCausalLM(tf.Qwen3MoeConfig(
        **SMALL, head_dim=16, num_experts=6, num_experts_per_tok=2, moe_intermediate_size=32,
        decoder_sparse_step=1, mlp_only_layers=[1], norm_topk_prob=True)),
    "mistral": lambda: tf.MistralForCausalLM(tf.MistralConfig(**SMALL, sliding_window=7)),
    "gemma3": lambda: tf.Gemma3ForCausalLM(tf.Gemma3TextConfig(
        **SMALL, head_dim=16, sliding_window=6, query_pre_attn_scalar=24,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"])),
}

PROMPTS = [list(range(3, 40)), [7, 9, 11], [5] * 13 + [100, 200, 300], list(range(250, 270))]


@pytest.fixture(scope="module", params=sorted(ARCHS))
def tiny(request, tmp_path_factory):
    torch.manual_seed(0)
    model = ARCHS[request.param]().eval()
    # Random init leaves some weights at 0/1; perturb everything so each parameter matters.
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    path = tmp_path_factory.mktemp(request.param)
    model.save_pretrained(path)
    return request.param, str(path), model


def _record_logits(engine):
    """Capture every sampled row's logits, keyed by the sequence it came from."""
    records = []
    orig = engine.runner.model.compute_logits

    def hook(hidden):
        logits = orig(hidden)
        records.append(logits.clone())
        return logits
    engine.runner.model.compute_logits = hook
    return records


@pytest.mark.parametrize("backend", BACKENDS)
def test_logits_match_transformers(tiny, backend):
    name, path, ref = tiny
    engine = Engine(EngineConfig(model=path, attention_backend=backend, block_size=4, num_kv_blocks=200,
                                 prefill_chunk_size=8, max_num_batched_tokens=24, max_num_seqs=8))
    orig = engine.runner.model.compute_logits
    per_seq = {}

    def hook(hidden):
        logits = orig(hidden)
        hook.rows.append(logits.clone())
        return logits
    hook.rows = []
    engine.runner.model.compute_logits = hook
    # Map each captured row back to its sequence through the step results.
    orig_update = engine.scheduler.update

    def update(result):
        rows = hook.rows.pop() if result.seq_ids else None
        for i, sid in enumerate(result.seq_ids):
            per_seq.setdefault(sid, []).append(rows[i])
        return orig_update(result)
    engine.scheduler.update = update

    # The Triton interpreter is slow on a CPU: 12 decode steps still cross several 4-token blocks.
    steps = 32 if backend == "torch" else 12
    outs = engine.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=steps, ignore_eos=True))
    worst = 0.0
    for prompt, out in zip(PROMPTS, outs):
        assert len(out.token_ids) == steps
        full = torch.tensor([prompt + out.token_ids])
        with torch.no_grad():
            want = ref(full).logits[0, len(prompt) - 1:-1].float()
        got = torch.stack(per_seq[out.seq_id])
        assert got.shape == want.shape
        worst = max(worst, (got - want).abs().max().item())
        assert torch.equal(got.argmax(-1), torch.tensor(out.token_ids))
    assert worst < 1e-4, f"{name}/{backend}: max |logit diff| {worst:.2e}"
