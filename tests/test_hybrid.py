"""The Gated DeltaNet hybrids (Qwen3-Next, Qwen3.5 dense and MoE): xinfer's logits equal transformers'
on the same random tiny weights over chunked prefill split across steps, a batch of prompts of
different lengths and 32 decode steps; the recurrent state follows its sequence through
preemption, n > 1 siblings and a worker process killed mid-generation; what hybrids do not
support is refused or turned off, not wrong."""
import os
import signal

import pytest
import torch
import transformers as tf
from safetensors.torch import load_file, save_file

from ops import delta_rule
from tests.conftest import BACKENDS
from tests.test_models import PROMPTS, _check_logits
from xinfer import Engine, EngineConfig, SamplingParams
from xinfer.errors import ModelLoadError

# 4 layers: three linear-attention, then one full attention. Two key heads serve four value heads.
SMALL = dict(vocab_size=320, hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
             max_position_embeddings=256, head_dim=16, linear_conv_kernel_dim=4, linear_key_head_dim=16,
             linear_value_head_dim=8, linear_num_key_heads=2, linear_num_value_heads=4)
MOE = dict(num_experts=6, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=48)

ARCHS = {
    # layer 1's MLP dense (mlp_only_layers), the rest routed experts with a gated shared expert
    "qwen3_next": lambda: tf.Qwen3NextForCausalLM(tf.Qwen3NextConfig(
        **SMALL, **MOE, intermediate_size=96, mlp_only_layers=[1])),
    "qwen3_5": lambda: tf.Qwen3_5ForCausalLM(tf.Qwen3_5TextConfig(**SMALL, intermediate_size=96)),
    "qwen3_5_moe": lambda: tf.Qwen3_5MoeForCausalLM(tf.Qwen3_5MoeTextConfig(**SMALL, **MOE)),
}
GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)


def _make(name):
    torch.manual_seed(0)
    model = ARCHS[name]().eval()
    with torch.no_grad():  # move every weight off its init (norms at 0, dt_bias at 1) so each matters
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return model


@pytest.fixture(scope="module", params=sorted(ARCHS))
def tiny(request, tmp_path_factory):
    model = _make(request.param)
    path = tmp_path_factory.mktemp(request.param)
    model.save_pretrained(path)
    return request.param, str(path), model


@pytest.fixture(scope="module")
def qwen3_5(tmp_path_factory):
    model = _make("qwen3_5")
    path = tmp_path_factory.mktemp("qwen3_5_engine")
    model.save_pretrained(path)
    return str(path), model


def _engine(path, **kw):
    args = dict(model=path, block_size=4, num_kv_blocks=200, prefill_chunk_size=8, max_num_batched_tokens=24,
                max_num_seqs=8)
    return Engine(EngineConfig(**dict(args, **kw)), log_level="warning")


@pytest.mark.parametrize("backend", BACKENDS)
def test_logits_match_transformers(tiny, backend):
    """Prompts of 3 to 37 tokens in 8-token chunks under a 24-token budget: the long ones span several
    steps, sharing them with other sequences' chunks and decodes. The delta rule is torch on every
    backend; the backend runs the full-attention layer."""
    name, path, ref = tiny
    engine = _check_logits(name, path, ref, backend)
    layers = engine.runner.model.attention_layers()
    assert len(layers) == 1  # only the full-attention layer has a KV cache


def test_greedy_equals_transformers_generate(tiny):
    name, path, ref = tiny
    engine = _engine(path)
    outs = engine.generate(PROMPTS[:2], GREEDY)
    for prompt, out in zip(PROMPTS[:2], outs):
        want = ref.generate(torch.tensor([prompt]), max_new_tokens=10, do_sample=False)[0, len(prompt):]
        assert out.token_ids == want.tolist(), name


def test_chunked_rule_equals_the_recurrence():
    """The chunked form over any cut of a sequence into pieces (each piece's chunks of any size)
    gives the token-by-token recurrence's outputs and final state."""
    torch.manual_seed(1)
    L, H, Dk, Dv = 70, 3, 8, 5
    q, k = delta_rule.prepare(torch.randn(L, 1, Dk), torch.randn(L, 1, Dk), H)
    v, g, beta = torch.randn(L, H, Dv), -torch.rand(L, H) * 2, torch.rand(L, H)
    S = torch.zeros(1, H, Dk, Dv)
    want = torch.cat([delta_rule.recurrent(q[t:t + 1], k[t:t + 1], v[t:t + 1], g[t:t + 1], beta[t:t + 1], S)
                      for t in range(L)])
    for cuts, chunk in (([0, 70], 64), ([0, 1, 9, 40, 70], 16), ([0, 33, 70], 5)):
        state = torch.zeros(H, Dk, Dv)
        got = torch.cat([delta_rule.chunked(q[a:b], k[a:b], v[a:b], g[a:b], beta[a:b], state, chunk)
                         for a, b in zip(cuts, cuts[1:])])
        assert (got - want).abs().max() < 1e-5 and (state - S[0]).abs().max() < 1e-5


def test_preemption_recomputes_the_state(qwen3_5):
    """A KV cache too small for the batch: sequences are preempted and recomputed, their state slots
    given back and retaken, and the outputs are those of a run with room for all."""
    path, _ = qwen3_5
    prompts = [list(range(3, 30)), list(range(40, 62)), [5] * 19, list(range(100, 125))]
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    want = [o.token_ids for o in _engine(path).generate(prompts, params)]
    tight = _engine(path, num_kv_blocks=24)
    got = [o.token_ids for o in tight.generate(prompts, params)]
    assert tight.scheduler.num_preemptions > 0
    assert got == want
    slots = tight.scheduler.slots
    assert sorted(slots.free) == list(range(slots.num))  # every slot back once all finished
    tight.blocks.check_integrity()


def test_siblings_and_repeats_compute_their_own_prompt(qwen3_5, caplog):
    """n > 1 and a repeated prompt: no cached blocks are shared (they hold no recurrent state), and
    every choice is the greedy continuation."""
    path, _ = qwen3_5
    with caplog.at_level("INFO", logger="xinfer.hybrid"):
        engine = _engine(path)
    assert "prefix caching is off" in caplog.text
    prompt = list(range(3, 40))
    one = engine.generate([prompt], GREEDY)[0].token_ids
    outs = engine.generate([prompt], SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, n=3))
    assert [o.token_ids for o in outs] == [one] * 3
    assert engine.core.num_cached_prompt_tokens == 0


def test_speculative_decoding_is_refused(qwen3_5):
    path, _ = qwen3_5
    with pytest.raises(ModelLoadError, match="speculative decoding is not supported"):
        _engine(path, num_speculative_tokens=2, speculative_method="ngram")


def test_vision_language_checkpoint_loads_its_text_model(qwen3_5, tmp_path):
    """Qwen3.5 as released: Qwen3_5ForConditionalGeneration with the text settings in text_config and
    the language model's weights under model.language_model. beside the vision tower's."""
    import json
    path, ref = qwen3_5
    cfg = json.loads(open(os.path.join(path, "config.json")).read())
    cfg.pop("architectures")
    wrapper = {"architectures": ["Qwen3_5ForConditionalGeneration"], "model_type": "qwen3_5", "text_config": cfg,
               "vision_config": {"hidden_size": 8}}
    (tmp_path / "config.json").write_text(json.dumps(wrapper))
    weights = {(n.replace("model.", "model.language_model.", 1) if n.startswith("model.") else n): t
               for n, t in load_file(os.path.join(path, "model.safetensors")).items()}
    weights["model.visual.patch_embed.proj.weight"] = torch.zeros(8, 3)
    weights["mtp.fc.weight"] = torch.zeros(64, 128)
    save_file(weights, tmp_path / "model.safetensors")
    got = _engine(str(tmp_path)).generate([PROMPTS[0]], GREEDY)[0].token_ids
    want = ref.generate(torch.tensor([PROMPTS[0]]), max_new_tokens=10, do_sample=False)[0, len(PROMPTS[0]):]
    assert got == want.tolist()


def test_killed_worker_process_recomputes_the_state(qwen3_5):
    """The state slots cross the process boundary in NewSeq; a worker killed mid-generation comes
    back with empty state pools, and recompute gives the same greedy tokens."""
    path, _ = qwen3_5
    prompts = PROMPTS
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    want = [o.token_ids for o in _engine(path).generate(prompts, params)]
    engine = Engine(EngineConfig(model=path, block_size=4, num_kv_blocks=200, prefill_chunk_size=8,
                                 max_num_batched_tokens=24, max_num_seqs=8), worker="process", log_level="warning")
    try:
        ids = [engine.add_request(p, params)[0] for p in prompts]
        toks, steps = {i: [] for i in ids}, 0
        while engine.has_unfinished():
            if steps == 4:
                os.kill(engine.runner.proc.pid, signal.SIGKILL)
            for d in engine.step():
                toks[d.seq_id].extend(d.token_ids)
            steps += 1
        assert engine.runner.restarts == 1
        assert [toks[i] for i in ids] == want
    finally:
        engine.close()
