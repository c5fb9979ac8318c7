"""Every architecture: xinfer's logits equal transformers' on the same random tiny weights,
for a batch of prompts of different lengths, through chunked prefill and 32 decode steps (12 under the Triton interpreter).
Phi-3, GLM-4, GLM-4.5 MoE and DeepSeek-V3 also from GGUF files written from those weights with the gguf
package's own tensor names."""
import math

import gguf
import numpy as np
import pytest
import torch
import transformers as tf
from gguf import GGMLQuantizationType as Q
from safetensors.torch import save_file

from tests.conftest import BACKENDS
from xinfer import Engine, EngineConfig, SamplingParams
from xinfer.loader.gguf import load_gguf
from xinfer.loader.gguf_tokenizer import bytes_to_unicode
from xinfer.models.layers import Linear

SMALL = dict(vocab_size=320, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
IDS = dict(bos_token_id=1, eos_token_id=2, pad_token_id=0)  # the defaults of Phi-3 and GLM-4 lie outside 320


def _longrope(orig, dims):
    """LongRoPE over `dims` rotated dims, pretrained on `orig` positions (SMALL stretches it to 256).
    Phi3Config overwrites the rope_scaling's original_max_position_embeddings with its own: both are set."""
    return dict(original_max_position_embeddings=orig, rope_scaling={
        "rope_type": "longrope", "original_max_position_embeddings": orig,
        "short_factor": [1.0 + 0.1 * i for i in range(dims // 2)],
        "long_factor": [2.0 + 0.7 * i for i in range(dims // 2)]})


DEEPSEEK = dict(SMALL, **IDS, num_key_value_heads=4, q_lora_rank=32, kv_lora_rank=32, qk_rope_head_dim=16,
                qk_nope_head_dim=16, v_head_dim=24, n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                n_shared_experts=1, first_k_dense_replace=1, n_group=4, topk_group=2, routed_scaling_factor=2.5,
                norm_topk_prob=True)

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
    "phi3": lambda: tf.Phi3ForCausalLM(tf.Phi3Config(**SMALL, **IDS, sliding_window=9)),
    # Every sequence checked here (15 to 69 tokens) is past 8 positions: transformers takes the long factors,
    # and xinfer too, as it serves 256. Partial rotary as in Phi-4-mini: 12 of 16 dims.
    "phi3_longrope": lambda: tf.Phi3ForCausalLM(tf.Phi3Config(
        **SMALL, **IDS, partial_rotary_factor=0.75, **_longrope(8, 12))),
    # ... and none is past 128: both take the short factors (xinfer serves 128), with the attention scaling.
    "phi3_longrope_short": lambda: tf.Phi3ForCausalLM(tf.Phi3Config(**SMALL, **IDS, **_longrope(128, 16))),
    "glm4": lambda: tf.Glm4ForCausalLM(tf.Glm4Config(**SMALL, **IDS, head_dim=32)),
    # One dense layer, then 8 sigmoid-routed experts in 4 groups (2 picked from the best 2 groups) and a
    # shared expert; q/k norms and biased Q/K/V, rotary on half of each head.
    "glm4_moe": lambda: tf.Glm4MoeForCausalLM(tf.Glm4MoeConfig(
        **SMALL, **IDS, head_dim=16, n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
        n_shared_experts=1, first_k_dense_replace=1, n_group=4, topk_group=2, routed_scaling_factor=2.5,
        norm_topk_prob=True, use_qk_norm=True, attention_bias=True)),
    # MLA (q and kv low-rank, YaRN with its softmax mscale) and the same routing, 1 dense layer then MoE.
    "deepseek_v3": lambda: tf.DeepseekV3ForCausalLM(tf.DeepseekV3Config(**DEEPSEEK, rope_parameters={
        "rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 64,
        "mscale": 1.0, "mscale_all_dim": 1.0, "beta_fast": 32, "beta_slow": 1})),
    # ... and as DeepSeek-V2-Lite lays it out: no q low-rank; half-split rotary; mscale != mscale_all_dim.
    "deepseek_v3_lite": lambda: tf.DeepseekV3ForCausalLM(tf.DeepseekV3Config(**dict(
        DEEPSEEK, q_lora_rank=None, rope_interleave=False, n_group=1, topk_group=1, norm_topk_prob=False),
        rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                         "original_max_position_embeddings": 64, "mscale": 0.9, "mscale_all_dim": 0.6})),
    # DeepSeek-V2: softmax routing limited to the 2 groups with the best expert, no renormalizing; plain rope.
    "deepseek_v2": lambda: tf.DeepseekV2ForCausalLM(tf.DeepseekV2Config(**dict(
        DEEPSEEK, q_lora_rank=None, topk_method="group_limited_greedy", norm_topk_prob=False))),
    # GLM-4.7-Flash: DeepSeek-V3's MLA with GLM-4.5's MoE, its dense and MoE layers listed per layer.
    "glm4_moe_lite": lambda: tf.Glm4MoeLiteForCausalLM(tf.Glm4MoeLiteConfig(**dict(
        DEEPSEEK, mlp_layer_types=["dense", "sparse", "dense"]))),
}
# Checkpoints store multi-token-prediction layers after the decoder's own; the loader must skip them.
MTP_TENSORS = {"glm4_moe": {"model.layers.3.eh_proj.weight": (64, 128), "model.layers.3.enorm.weight": (64,),
                            "model.layers.3.mlp.experts.0.gate_proj.weight": (32, 64)},
               "deepseek_v3": {"model.layers.3.eh_proj.weight": (64, 128),
                               "model.layers.3.self_attn.kv_b_proj.weight": (160, 32)}}
ENGINE_ARGS = {"phi3_longrope_short": dict(max_model_len=128)}

PROMPTS = [list(range(3, 40)), [7, 9, 11], [5] * 13 + [100, 200, 300], list(range(250, 270))]


def _make(name):
    torch.manual_seed(0)
    return perturbed(ARCHS[name]().eval())


def perturbed(model):
    """Random init leaves some weights at 0/1; perturb everything so each parameter matters."""
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
        for n, b in model.named_buffers():  # the router's bias is a buffer, and starts at zero
            if n.endswith("e_score_correction_bias"):
                b.add_(torch.randn_like(b) * 0.05)
    return model


@pytest.fixture(scope="module", params=sorted(ARCHS))
def tiny(request, tmp_path_factory):
    model = _make(request.param)
    path = tmp_path_factory.mktemp(request.param)
    model.save_pretrained(path)
    if request.param in MTP_TENSORS:
        save_file({n: torch.randn(shape) for n, shape in MTP_TENSORS[request.param].items()}, path / "mtp.safetensors")
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
    _check_logits(name, path, ref, backend)


def _check_logits(name, path, ref, backend="torch"):
    engine = Engine(EngineConfig(model=path, attention_backend=backend, block_size=4, num_kv_blocks=200,
                                 prefill_chunk_size=8, max_num_batched_tokens=24, max_num_seqs=8,
                                 **ENGINE_ARGS.get(name, {})))
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

    # The Triton interpreter is slow on a CPU: 8 decode steps still cross two 4-token blocks.
    steps = 32 if backend == "torch" else 8
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
    return engine


def test_mla_caches_the_compressed_kv(tmp_path):
    """MLA's paged cache holds, per token and layer, the latent (32) and the rotated shared key (16):
    one tensor read as K and V, and the block budget counts it once."""
    from xinfer.workers.kv_memory import kv_bytes_per_token
    _make("deepseek_v3").save_pretrained(tmp_path)
    engine = Engine(EngineConfig(model=str(tmp_path), block_size=4, num_kv_blocks=8))
    for a in engine.runner.model.attention_layers():
        assert a.k_cache is a.v_cache and tuple(a.k_cache.shape) == (8, 4, 1, 48)
    assert kv_bytes_per_token(engine.runner.model.cfg, torch.float32) == 3 * 48 * 4


# ---- GGUF: the same tiny weights, written as llama.cpp's converter lays them out


GGUF_ARCHS = {"phi3": gguf.MODEL_ARCH.PHI3, "glm4": gguf.MODEL_ARCH.GLM4, "glm4moe": gguf.MODEL_ARCH.GLM4_MOE,
              "deepseek2": gguf.MODEL_ARCH.DEEPSEEK2}


def _write_gguf(model, arch, path, qtype, nextn=0, experts_q=False):
    """Matrices in `qtype` (F32 or a block type), everything else F32; a byte-level vocabulary to load.
    `nextn`: that many multi-token-prediction blocks follow the decoder's, as llama.cpp's converter
    writes them for GLM-4.5; `experts_q`: the expert stacks in `qtype` too. Returns the HF names of the
    weights written quantized."""
    c = model.config
    rp = c.rope_parameters
    mla = arch == "deepseek2"
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    w = gguf.GGUFWriter(str(path), arch)
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_block_count(c.num_hidden_layers + nextn)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(1 if mla else c.num_key_value_heads)  # the converter files MLA as MQA over the latent
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_rope_freq_base(rp["rope_theta"])
    w.add_rope_dimension_count(c.qk_rope_head_dim if mla else int(head_dim * rp["partial_rotary_factor"]))
    if arch in ("glm4", "glm4moe"):
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)
    if arch in ("glm4moe", "deepseek2"):
        w.add_expert_count(c.n_routed_experts)
        w.add_expert_used_count(c.num_experts_per_tok)
        w.add_expert_shared_count(c.n_shared_experts)
        w.add_leading_dense_block_count(c.first_k_dense_replace)
        w.add_expert_feed_forward_length(c.moe_intermediate_size)
        w.add_expert_weights_scale(c.routed_scaling_factor)
        w.add_expert_weights_norm(c.norm_topk_prob)
        w.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID)
        w.add_expert_group_count(c.n_group)
        w.add_expert_group_used_count(c.topk_group)
        w.add_nextn_predict_layers(nextn)
    if mla:
        w.add_q_lora_rank(c.q_lora_rank)
        w.add_kv_lora_rank(c.kv_lora_rank)
        w.add_key_length(c.kv_lora_rank + c.qk_rope_head_dim)
        w.add_value_length(c.kv_lora_rank)
        w.add_key_length_mla(c.qk_nope_head_dim + c.qk_rope_head_dim)
        w.add_value_length_mla(c.v_head_dim)
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(rp["factor"])
        w.add_rope_scaling_orig_ctx_len(rp["original_max_position_embeddings"])
        w.add_rope_scaling_yarn_log_mul(0.1 * rp["mscale_all_dim"])
    if arch == "phi3":
        w.add_sliding_window(c.sliding_window or 0)
        if rp["rope_type"] == "longrope":
            orig = rp["original_max_position_embeddings"]
            w.add_rope_scaling_orig_ctx_len(orig)
            w.add_rope_scaling_attn_factors(math.sqrt(1 + math.log(c.max_position_embeddings / orig) / math.log(orig)))
            w.add_tensor("rope_factors_long.weight", np.array(rp["long_factor"], np.float32))
            w.add_tensor("rope_factors_short.weight", np.array(rp["short_factor"], np.float32))
    chars = list(bytes_to_unicode().values())
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("glm4" if arch.startswith("glm4") else "gpt2")
    w.add_token_list(chars + [f"t{i}" for i in range(c.vocab_size - len(chars))])
    w.add_token_merges(["t 0"])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    names = gguf.get_tensor_name_map(GGUF_ARCHS[arch], c.num_hidden_layers + nextn)
    tensors = dict(_gguf_layout(model.state_dict(), c))
    last = f"model.layers.{c.num_hidden_layers - 1}."
    for i in range(nextn):  # an MTP depth: a decoder layer (a copy of the last one) and its own tensors
        n = f"model.layers.{c.num_hidden_layers + i}."
        tensors.update({k.replace(last, n): t.clone() for k, t in list(tensors.items()) if k.startswith(last)})
        tensors[n + "eh_proj.weight"] = torch.randn(c.hidden_size, 2 * c.hidden_size) * 0.1
        for norm in ("enorm", "hnorm", "shared_head.norm"):
            tensors[n + norm + ".weight"] = 1 + 0.1 * torch.randn(c.hidden_size)
    quantized = set()
    for name, t in tensors.items():
        gname, data = names.get_name(name, try_suffixes=(".weight", ".bias")), t.numpy()
        assert gname, name
        if qtype == Q.F32 or data.ndim != 2 and not (experts_q and data.ndim == 3):
            w.add_tensor(gname, data)
        else:
            w.add_tensor(gname, gguf.quants.quantize(data, qtype), raw_dtype=qtype)
            quantized.add(name)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return quantized


def _gguf_layout(state, c):
    """HF tensors as llama.cpp's converter hands them to the name map: expert stacks split in gate, up
    and down; kv_b_proj split per head in k_b (transposed) and v_b; the router's bias as a `.bias`."""
    for name, t in state.items():
        if name.endswith("mlp.experts.gate_up_proj"):
            gate, up = t.chunk(2, dim=1)
            yield name.replace("gate_up_proj", "gate_proj.weight"), gate.contiguous()
            yield name.replace("gate_up_proj", "up_proj.weight"), up.contiguous()
        elif name.endswith("mlp.experts.down_proj"):
            yield name + ".weight", t
        elif name.endswith("kv_b_proj.weight"):
            kv = t.view(c.num_attention_heads, c.qk_nope_head_dim + c.v_head_dim, c.kv_lora_rank)
            yield name.replace("kv_b_proj", "k_b_proj"), kv[:, :c.qk_nope_head_dim].transpose(1, 2).contiguous()
            yield name.replace("kv_b_proj", "v_b_proj"), kv[:, c.qk_nope_head_dim:].contiguous()
        else:
            yield name.replace("e_score_correction_bias", "e_score_correction.bias"), t


@pytest.mark.parametrize("name,qtype", [("phi3_longrope", Q.F32), ("phi3", Q.Q8_0), ("glm4", Q.F32),
                                        ("glm4", Q.Q8_0), ("glm4_moe", Q.F32), ("glm4_moe", Q.Q8_0),
                                        ("deepseek_v3", Q.F32), ("deepseek_v3", Q.Q8_0)],
                         ids=lambda v: getattr(v, "name", v))
def test_gguf_logits_match_transformers(tmp_path, name, qtype):
    """From GGUF, fused weights included; a Q8_0 file against transformers on the dequantized weights, with
    the blocks kept for the fused linears (the decode steps read them). GLM-4.5's file carries an MTP block."""
    arch = {"glm4_moe": "glm4moe", "deepseek_v3": "deepseek2"}.get(name, name.split("_")[0])
    model = _make(name)
    path = tmp_path / f"{name}.gguf"
    quantized = _write_gguf(model, arch, path, qtype, nextn=1 if arch == "glm4moe" else 0)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if n in quantized:
                p.copy_(torch.from_numpy(gguf.quants.dequantize(gguf.quants.quantize(p.numpy(), qtype), qtype)))
    cfg = load_gguf(str(path)).config
    assert cfg["model_type"] == model.config.model_type
    assert cfg["num_hidden_layers"] == model.config.num_hidden_layers
    if arch != "deepseek2":
        assert cfg["partial_rotary_factor"] == model.config.rope_parameters["partial_rotary_factor"]
    if name == "phi3_longrope":
        want = model.config.rope_parameters
        assert cfg["rope_scaling"]["long_factor"] == pytest.approx(want["long_factor"])
        assert cfg["rope_scaling"]["short_factor"] == pytest.approx(want["short_factor"])
    engine = _check_logits(name, str(path), model)
    layer = engine.runner.model.model.layers[0]
    linears = [m for m in layer.modules() if isinstance(m, Linear)]
    assert len(linears) >= 4 and all((lin.blocks is not None) == (qtype != Q.F32) for lin in linears)


def test_transformers4_config_keys():
    """transformers<5 config.json layouts build the same rotary tables: Phi-3's rope_scaling of type "su"
    with the pretraining context beside it, GLM-4's top-level partial_rotary_factor or none (half)."""
    from xinfer.models import model_class

    def rotary(cfg):
        return model_class(cfg)(cfg).model.layers[0].self_attn.rotary

    phi = dict(_make("phi3_longrope").config.to_dict(), architectures=["Phi3ForCausalLM"])
    rp = phi.pop("rope_parameters")
    old = dict(phi, rope_theta=rp["rope_theta"], partial_rotary_factor=0.75, original_max_position_embeddings=8,
               rope_scaling={"type": "su", "short_factor": rp["short_factor"], "long_factor": rp["long_factor"]})
    new, was = rotary(dict(phi, rope_parameters=rp)), rotary(old)
    assert new.rot_dim == was.rot_dim == 12
    assert torch.equal(new.cos, was.cos) and torch.equal(new.sin, was.sin)
    assert new.cos.abs().max() > 1.5  # the long factors' attention scaling, sqrt(1 + ln 32 / ln 8)
    glm = dict(_make("glm4").config.to_dict(), architectures=["Glm4ForCausalLM"])
    glm.pop("rope_parameters")
    for extra in ({"partial_rotary_factor": 0.5}, {}):
        r = rotary(dict(glm, rope_theta=10000.0, **extra))
        assert (r.rot_dim, r.interleaved) == (16, True)
