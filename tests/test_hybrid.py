"""The Gated DeltaNet hybrids (Qwen3-Next, Qwen3.5 dense and MoE): xinfer's logits equal transformers'
on the same random tiny weights over chunked prefill split across steps, a batch of prompts of
different lengths and 32 decode steps; the recurrent state follows its sequence through
preemption, n > 1 siblings and a worker process killed mid-generation; prefix-cache hits resume
from recurrent-state snapshots at block boundaries; what hybrids do not support is refused, not
wrong."""
import os
import signal

import gguf
import numpy as np
import pytest
import torch
import transformers as tf
from safetensors.torch import load_file, save_file

from ops import delta_rule
from tests.conftest import BACKENDS
from tests.test_models import PROMPTS, _check_logits, _gguf_layout, perturbed
from xinfer import Engine, EngineConfig, SamplingParams
from xinfer.errors import ModelLoadError
from xinfer.loader.gguf import load_gguf

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
# llama.cpp's qwen3next has routed experts in every layer
GGUF_QWEN3_NEXT = lambda: tf.Qwen3NextForCausalLM(tf.Qwen3NextConfig(**SMALL, **MOE, intermediate_size=96))
GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)


def _make(name):
    torch.manual_seed(0)  # every weight moved off its init (norms at 0, dt_bias at 1) so each matters
    return perturbed((GGUF_QWEN3_NEXT if name == "qwen3_next_gguf" else ARCHS[name])().eval())


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


def test_siblings_and_repeats_without_snapshots(qwen3_5, caplog):
    """No snapshot slots: no cached blocks are shared (they hold no recurrent state), and every n > 1
    choice computes its prompt to the greedy continuation."""
    path, _ = qwen3_5
    with caplog.at_level("INFO", logger="xinfer.hybrid"):
        engine = _engine(path, hybrid_state_snapshots=0)
    assert "prefix caching is off" in caplog.text
    prompt = list(range(3, 40))
    one = engine.generate([prompt], GREEDY)[0].token_ids
    outs = engine.generate([prompt], SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, n=3))
    assert [o.token_ids for o in outs] == [one] * 3
    assert engine.core.num_cached_prompt_tokens == 0


SHARED = list(range(3, 33))  # 30 tokens: seven full 4-token blocks, then two tokens of the eighth
FIRST, SECOND = SHARED + [40, 41, 42, 43, 44], SHARED + [50, 51, 52]


def _logits_of(engine, prompt, params=GREEDY):
    """Greedy tokens of one prompt run alone, and the logits they were sampled from."""
    rows, orig = [], engine.runner.model.compute_logits
    engine.runner.model.compute_logits = lambda h: rows.append(orig(h)) or rows[-1]
    try:
        out = engine.generate([prompt], params)[0].token_ids
    finally:
        engine.runner.model.compute_logits = orig
    return out, torch.cat(rows).float()


def _reference(ref, prompt, out):
    with torch.no_grad():
        return ref(torch.tensor([prompt + out])).logits[0, len(prompt) - 1:-1].float()


@pytest.mark.parametrize("stride,chunk", [(1, 8), (3, 8), (2, 6)])
def test_prefix_hit_resumes_from_a_snapshot(qwen3_5, monkeypatch, stride, chunk):
    """A second prompt sharing 30 tokens with the first resumes from the state snapshot at the last
    `stride`-th block boundary inside the shared blocks (captured mid-chunk: 4-token blocks in 8- or
    6-token chunks); a third that continues the first's output resumes from one its decode captured.
    Logits equal transformers' and the greedy tokens a run without caching gives."""
    path, ref = qwen3_5
    monkeypatch.setenv("XINFER_MAMBA_SNAPSHOT_STRIDE_BLOCKS", str(stride))
    engine = _engine(path, prefill_chunk_size=chunk)
    plain = _engine(path, enable_prefix_cache=False, prefill_chunk_size=chunk)
    every = 4 * stride
    out1, _ = _logits_of(engine, FIRST)
    assert engine.core.num_cached_prompt_tokens == 0
    third = FIRST + out1 + [7, 8]  # 45 + 2 tokens: blocks to 44 were computed, 36..44 by decode
    for prompt, cached in ((SECOND, 28 // every * every), (third, 44 // every * every)):
        before = engine.core.num_cached_prompt_tokens
        got, logits = _logits_of(engine, prompt)
        assert engine.core.num_cached_prompt_tokens - before == cached
        assert got == plain.generate([prompt], GREEDY)[0].token_ids
        assert (logits - _reference(ref, prompt, got)).abs().max() < 1e-4
    engine.blocks.check_integrity()
    engine.scheduler.slots.check_integrity()


def test_snapshots_through_preemption_eviction_and_siblings(qwen3_5):
    """Prompts sharing prefixes in a KV cache too small for them all and a pool of 3 snapshots: hits,
    preemptions, recomputes and evictions mix, n > 1 siblings resume from their parent's snapshots,
    and every output is the one of a run without caching."""
    path, _ = qwen3_5
    base = list(range(3, 27))
    prompts = [base + [40 + i] * (i + 1) for i in range(5)] + [base[:13], base + list(range(60, 70))]
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    want = [o.token_ids for o in _engine(path, enable_prefix_cache=False).generate(prompts, params)]
    tight = _engine(path, num_kv_blocks=26, hybrid_state_snapshots=3)
    got = [o.token_ids for o in tight.generate(prompts[:1], params) + tight.generate(prompts[1:], params)]
    assert tight.scheduler.num_preemptions > 0 and tight.core.num_cached_prompt_tokens > 0
    assert got == want
    slots = tight.scheduler.slots
    assert sorted(slots.free) == list(range(slots.num)) and len(slots.saved) == 3
    slots.check_integrity()
    tight.blocks.check_integrity()
    before = tight.core.num_cached_prompt_tokens
    outs = tight.generate([base + [99]], SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, n=3))
    assert len({tuple(o.token_ids) for o in outs}) == 1
    assert tight.core.num_cached_prompt_tokens > before  # the siblings' hits
    assert outs[0].token_ids == _engine(path, enable_prefix_cache=False).generate([base + [99]], GREEDY)[0].token_ids


def test_snapshot_pool_bookkeeping():
    """The scheduler's side alone: a hit is cut back to its last block with a snapshot; a full pool
    gives up first the snapshots whose block left the prefix cache; a failed step forgets them all."""
    from xinfer.hybrid import StateSlots
    slots = StateSlots(2, snapshots=2)
    slots.pending = [(11, slots._take_snapshot({})), (12, slots._take_snapshot({}))]
    assert slots._take_snapshot({}) is None  # both being written
    slots.commit()
    assert slots.resume(7, [10, 11, 13]) == 2 and slots.resumes == {7: 2}
    assert slots.resume(8, [10, 14]) == 0
    assert slots._take_snapshot(cached={11: 0}) == 3  # 12's block is gone, 11 is still cached
    slots.free_snaps.append(3)
    assert slots._take_snapshot(cached={11: 0, 12: 1}) == 3
    slots.pending.append((15, 3))
    slots.forget()
    assert not slots.saved and sorted(slots.free_snaps) == [2, 3]
    slots.check_integrity()


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


GGUF_ARCHS = {"qwen3_next": gguf.MODEL_ARCH.QWEN3NEXT, "qwen3_5": gguf.MODEL_ARCH.QWEN35,
              "qwen3_5_moe": gguf.MODEL_ARCH.QWEN35MOE}
Q8, F32 = gguf.GGMLQuantizationType.Q8_0, gguf.GGMLQuantizationType.F32


def _swap_heads(t, outer, inner, size, dim=0):
    """Value heads along `dim`, read as [outer, inner, size], reordered to [inner, outer, size]."""
    t = t.movedim(dim, 0)
    return t.reshape(outer, inner, size, *t.shape[1:]).transpose(0, 1).reshape(t.shape).movedim(0, dim).contiguous()


def _converted(name, model):
    """The HF tensors changed as llama.cpp's converter (conversion/qwen.py) changes them before naming:
    A_log as -exp, dt_bias as dt_proj.bias, the conv kernel squeezed, (1 + w) norms stored whole,
    Qwen3-Next's in_proj_qkvz split in qkv and z, and Qwen3.5's value heads tiled (j * Hk + g)."""
    c = model.config
    hk, hv, dk, dv = c.linear_num_key_heads, c.linear_num_value_heads, c.linear_key_head_dim, c.linear_value_head_dim
    r, h, qk = hv // hk, c.hidden_size, 2 * hk * dk
    for n, t in _gguf_layout(model.state_dict(), c):
        if name != "qwen3_next" and ".linear_attn." in n:
            if ".in_proj_qkv." in n or ".conv1d." in n:
                t = torch.cat([t[:qk], _swap_heads(t[qk:], hk, r, dv)])
            elif ".in_proj_z." in n:
                t = _swap_heads(t, hk, r, dv)
            elif n.endswith(("in_proj_b.weight", "in_proj_a.weight", "A_log", "dt_bias")):
                t = _swap_heads(t, hk, r, 1)
            elif ".out_proj." in n:
                t = _swap_heads(t, hk, r, dv, 1)
        if n.endswith("A_log"):
            t = -t.exp()
        elif n.endswith("dt_bias"):
            n = n.replace("dt_bias", "dt_proj.bias")
        elif ".conv1d." in n:
            t = t.squeeze(1)
        elif n.endswith("norm.weight") and not n.endswith("linear_attn.norm.weight"):
            t = t + 1
        if ".in_proj_qkvz." in n:
            q, k, v, z = t.reshape(hk, -1, h).split([dk, dk, r * dv, r * dv], 1)
            yield n.replace("in_proj_qkvz", "in_proj_qkv"), torch.cat([x.reshape(-1, h) for x in (q, k, v)])
            yield n.replace("in_proj_qkvz", "in_proj_z"), z.reshape(-1, h)
        else:
            yield n, t


def _write_gguf(name, model, path, qtype, nextn=0):
    """The tiny model as a GGUF: its matrices in `qtype`, the rest F32, and `nextn` MTP blocks (copies
    of the last layer) after the decoder's, as the converter writes Qwen3.5's. Returns the names of the
    tensors written quantized."""
    from tests.test_models import bytes_to_unicode
    c, arch = model.config, GGUF_ARCHS[name]
    layers = c.num_hidden_layers + nextn
    w = gguf.GGUFWriter(str(path), gguf.MODEL_ARCH_NAMES[arch])
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_feed_forward_length(getattr(c, "intermediate_size", None) or 0)
    w.add_block_count(layers)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    w.add_key_length(c.head_dim)
    w.add_value_length(c.head_dim)
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_rope_freq_base(c.rope_parameters["rope_theta"])
    w.add_rope_dimension_count(int(c.head_dim * c.rope_parameters["partial_rotary_factor"]))
    w.add_ssm_conv_kernel(c.linear_conv_kernel_dim)
    w.add_ssm_state_size(c.linear_key_head_dim)
    w.add_ssm_group_count(c.linear_num_key_heads)
    w.add_ssm_time_step_rank(c.linear_num_value_heads)
    w.add_ssm_inner_size(c.linear_value_head_dim * c.linear_num_value_heads)
    w.add_full_attention_interval(4)
    if name != "qwen3_5":
        w.add_expert_count(c.num_experts)
        w.add_expert_used_count(c.num_experts_per_tok)
        w.add_expert_feed_forward_length(c.moe_intermediate_size)
        w.add_expert_shared_feed_forward_length(c.shared_expert_intermediate_size)
    if nextn:
        w.add_nextn_predict_layers(nextn)
    chars = list(bytes_to_unicode().values())
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("qwen2")
    w.add_token_list(chars + [f"t{i}" for i in range(c.vocab_size - len(chars))])
    w.add_token_merges(["t 0"])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    names = gguf.get_tensor_name_map(arch, layers)
    tensors = dict(_converted(name, model))
    last = f"model.layers.{c.num_hidden_layers - 1}."
    for i in range(nextn):
        tensors.update({k.replace(last, f"model.layers.{c.num_hidden_layers + i}."): t.clone()
                        for k, t in list(tensors.items()) if k.startswith(last)})
    quantized = set()
    for n, t in tensors.items():
        gname, data = names.get_name(n, try_suffixes=(".weight", ".bias")), t.float().numpy()
        assert gname, n
        if qtype == F32 or data.ndim != 2 or data.shape[1] % 32:
            w.add_tensor(gname, np.ascontiguousarray(data))
        else:
            w.add_tensor(gname, gguf.quants.quantize(data, qtype), raw_dtype=qtype)
            quantized.add(n)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return quantized


def _on_file_weights(name, model, quantized, qtype):
    """`model` with each quantized matrix as the file holds it: quantized after the converter's row
    changes (which commute with row-wise blocks); Qwen3.5's out_proj, whose columns it reorders, in
    that order."""
    c = model.config
    hk, r, dv = c.linear_num_key_heads, c.linear_num_value_heads // c.linear_num_key_heads, c.linear_value_head_dim
    qd = lambda t: torch.from_numpy(gguf.quants.dequantize(gguf.quants.quantize(t.numpy(), qtype), qtype))
    with torch.no_grad():
        for n, p in model.named_parameters():
            fused = n.replace("in_proj_qkvz", "in_proj_qkv")
            if n not in quantized and fused not in quantized:
                continue
            if ".out_proj." in n and name != "qwen3_next":
                p.copy_(_swap_heads(qd(_swap_heads(p, hk, r, dv, 1)), r, hk, dv, 1))
            else:
                p.copy_(qd(p))
    return model


@pytest.mark.parametrize("qtype", [F32, Q8], ids=lambda q: q.name)
@pytest.mark.parametrize("name", sorted(ARCHS))
def test_gguf_logits_match_transformers(name, tmp_path, qtype):
    """llama.cpp's qwen3next / qwen35 / qwen35moe files written from the same tiny weights (Qwen3.5's
    with an MTP block after the decoder's, skipped): the config comes from the ssm.* keys, the
    converter's changes are undone, and the logits equal transformers' on the weights the file holds
    (the Q8_0 matrices keep their blocks where the kernels can read them)."""
    model = _make(name + "_gguf" if name == "qwen3_next" else name)
    path = tmp_path / f"{name}.gguf"
    quantized = _write_gguf(name, model, path, qtype, nextn=0 if name == "qwen3_next" else 1)
    assert (qtype == Q8) == bool(quantized)
    model = _on_file_weights(name, model, quantized, qtype)
    cfg = load_gguf(str(path)).config
    assert cfg["num_hidden_layers"] == model.config.num_hidden_layers
    assert cfg["layer_types"] == model.config.layer_types
    assert cfg["linear_value_head_dim"] == model.config.linear_value_head_dim
    assert cfg["partial_rotary_factor"] == model.config.rope_parameters["partial_rotary_factor"]
    engine = _check_logits(name, str(path), model)
    if qtype == Q8:
        layer = engine.runner.model.model.layers[0].linear_attn
        assert layer.in_proj.blocks is not None or name == "qwen3_next"  # ssm_ba: float only
