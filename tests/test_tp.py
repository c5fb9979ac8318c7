"""Tensor and pipeline parallel over gloo on the CPU: two tensor-parallel ranks, two pipeline
stages, and two stages of two ranks give transformers' greedy tokens and log-probabilities (within
1e-4) for each sharded family, a model with fewer KV heads than ranks and one whose heads split
unevenly; the bundled model's greedy tokens equal one rank's; a rank killed mid-run costs no
request; what is not sharded is a clear start-up error."""
import argparse
import os
import signal

import pytest
import torch
import transformers as tf

from tests.test_models import ARCHS, PROMPTS, SMALL, _make
from xinfer import Engine, EngineConfig, SamplingParams
from xinfer.cli import add_engine_args, engine_config
from xinfer.errors import ModelLoadError

STEPS = 8
PARAMS = SamplingParams(temperature=0, max_tokens=STEPS, ignore_eos=True, logprobs=0)
# GQA with one KV head for two ranks (replicated), and 6 heads in 3 KV groups (2 and 1 a rank)
EXTRA = {"llama_one_kv_head": lambda: tf.LlamaForCausalLM(tf.LlamaConfig(**dict(SMALL, num_key_value_heads=1))),
         "llama_uneven": lambda: tf.LlamaForCausalLM(tf.LlamaConfig(**dict(
             SMALL, hidden_size=96, num_attention_heads=6, num_key_value_heads=3)))}


def _engine(path, **kw):
    return Engine(EngineConfig(model=str(path), tensor_parallel_size=kw.pop("tp", 2), block_size=4,
                               pipeline_parallel_size=kw.pop("pp", 1), num_kv_blocks=200, prefill_chunk_size=8, **kw),
                  log_level="warning")


def _tiny(name, tmp_path):
    if name in EXTRA:
        torch.manual_seed(0)
        model = EXTRA[name]().eval()
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn_like(p) * 0.05)
    else:
        model = _make(name)
    model.save_pretrained(tmp_path)
    return model


@pytest.mark.parametrize("name,tp,pp", [(n, 2, 1) for n in ("llama", "qwen3_moe", "gemma3", "phi3", "glm4_moe",
                                                            "llama_one_kv_head", "llama_uneven")]
                         + [("llama", 1, 2), ("qwen3_moe", 1, 2), ("phi3", 1, 2), ("glm4_moe", 1, 2),
                            ("gemma3", 2, 2), ("llama_one_kv_head", 2, 2)])
def test_ranks_match_transformers(name, tp, pp, tmp_path):
    """PROMPTS' 4 sequences go through two stages in two microbatches."""
    ref = _tiny(name, tmp_path)
    e = _engine(tmp_path, tp=tp, pp=pp)
    try:
        outs = e.generate(PROMPTS, PARAMS)
    finally:
        e.close()
    for prompt, out in zip(PROMPTS, outs):
        full = torch.tensor([prompt + out.token_ids])
        with torch.no_grad():
            lp = torch.log_softmax(ref(full).logits[0, len(prompt) - 1:-1].float(), -1)
        assert out.token_ids == lp.argmax(-1).tolist()
        got = torch.tensor([entry[0] for entry in out.logprobs])  # (chosen logprob, alternatives)
        want = lp.gather(1, torch.tensor(out.token_ids)[:, None])[:, 0]
        assert (got - want).abs().max() < 1e-4, name


@pytest.mark.parametrize("tp,pp", [(2, 1), (1, 2)])
def test_a_killed_rank_restarts_the_group(tp, pp, tmp_path):
    _tiny("llama", tmp_path)
    ref = _engine(tmp_path, tp=1)
    want = [o.token_ids for o in ref.generate(PROMPTS, PARAMS)]
    e = _engine(tmp_path, tp=tp, pp=pp)
    try:
        ids = [e.add_request(p, PARAMS)[0] for p in PROMPTS]
        toks, steps = {}, 0
        while e.has_unfinished():
            for d in e.step():
                toks.setdefault(d.seq_id, []).extend(d.token_ids)
            steps += 1
            if steps == 3:
                os.kill(e.runner.procs[1].pid, signal.SIGKILL)
        assert [toks[i] for i in ids] == want
        assert e.runner.restarts == 1
    finally:
        e.close()


def test_what_is_not_sharded_is_a_clear_error(tmp_path):
    _make("deepseek_v3").save_pretrained(tmp_path / "mla")
    with pytest.raises(ModelLoadError, match="not sharded yet"):
        _engine(tmp_path / "mla")
    _make("llama").save_pretrained(tmp_path / "llama")
    with pytest.raises(ModelLoadError, match="speculative decoding"):
        _engine(tmp_path / "llama", num_speculative_tokens=2)
    with pytest.raises(ModelLoadError, match="fewer than the ranks"):  # 2 KV heads on 3 ranks
        _engine(tmp_path / "llama", tp=3)
    with pytest.raises(ModelLoadError, match="do not make 9 stages"):
        _engine(tmp_path / "llama", tp=1, pp=9)
    with pytest.raises(ModelLoadError, match="--headless"):
        _engine(tmp_path / "llama", nnodes=2, node_rank=1)


def test_cli_flags():
    p = argparse.ArgumentParser()
    add_engine_args(p)
    assert engine_config(p.parse_args(["-tp", "2"])).tensor_parallel_size == 2
    assert engine_config(p.parse_args(["--tensor-parallel-size", "4"])).tensor_parallel_size == 4
    with pytest.raises(ValueError, match="tensor-parallel-size"):
        EngineConfig(tensor_parallel_size=0)
    c = engine_config(p.parse_args(["-pp", "2", "--cpu-ranks-bind", "0|1"]))
    assert (c.pipeline_parallel_size, c.cpu_ranks_bind) == (2, "0|1")
    assert engine_config(p.parse_args(["--d", "0,1"])).tensor_parallel_size == 2  # xInfer's spelling
    for bad, why in [(dict(pipeline_parallel_size=0), "pipeline-parallel-size"),
                     (dict(tensor_parallel_size=2, cpu_ranks_bind="0-1"), "1 entries for 2 ranks"),
                     (dict(tensor_parallel_size=2, cpu_ranks_bind="0|x"), "not a list of cores"),
                     (dict(tensor_parallel_size=3, nnodes=2), "must divide"),
                     (dict(tensor_parallel_size=2, nnodes=2, master_addr="10.0.0.1"), "--cluster-key"),
                     (dict(devices="0,a"), "CUDA device numbers")]:
        with pytest.raises(ValueError, match=why):
            EngineConfig(**bad)


@pytest.mark.slow
def test_bundled_model_two_ranks_equal_one(smollm_path):
    """SmolLM2-135M: 9 query heads in 3 KV groups split 6 / 3, its Q4_1 blocks split with them; and
    its 30 layers in two stages of 15."""
    prompts = [[1, 504, 3458, 282, 4649, 314], list(range(100, 160))]
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    outs = []
    for tp, pp in ((1, 1), (2, 1), (1, 2)):
        e = Engine(EngineConfig(model=smollm_path, tensor_parallel_size=tp, pipeline_parallel_size=pp),
                   worker="process", log_level="warning")
        try:
            outs.append([o.token_ids for o in e.generate(prompts, params)])
        finally:
            e.close()
    assert outs[0] == outs[1] == outs[2]


def test_lazy_parts_read_what_the_whole_tensor_holds(smollm_path, tmp_path):
    """A tensor-parallel rank's part of a checkpoint tensor, read alone (loader/lazy.py), equals the
    same part of the whole tensor: safetensors slices, and GGUF rows and columns (block-aligned
    columns read as blocks, others dequantized by rows), Q/K rows unpermuted."""
    from safetensors.torch import save_file

    from xinfer.loader.gguf import load_gguf
    from xinfer.loader.hf import iter_safetensors
    from xinfer.loader.lazy import Lazy
    want = {"w": torch.randn(6, 64), "b": torch.randn(6)}
    save_file(want, tmp_path / "model.safetensors")
    for name, t in iter_safetensors(str(tmp_path), lazy=True):
        assert isinstance(t, Lazy)
        assert torch.equal(t.narrow(0, 2, 3).tensor(), want[name][2:5])
        if name == "w":
            assert torch.equal(t.narrow(1, 16, 32).narrow(0, 1, 2).tensor(), want[name][1:3, 16:48])
    g = load_gguf(smollm_path)
    names = ("model.layers.0.self_attn.q_proj.weight", "model.layers.0.mlp.down_proj.weight")
    whole = {n: t for n, t in g.tensors(keep=lambda n: n in names)}
    parts = {n: t for n, t in g.tensors(keep=lambda n: n in names, lazy=True)}
    assert set(whole) == set(parts) == set(names)
    for n in names:
        w, lz = whole[n], parts[n]
        assert tuple(w.shape) == lz.shape
        assert torch.equal(lz.narrow(0, 64, 128).tensor(), w[64:192])
        assert torch.equal(lz.narrow(1, 64, 128).tensor(), w[:, 64:192])  # whole blocks
        assert torch.equal(lz.narrow(1, 5, 70).tensor(), w[:, 5:75])  # cuts blocks
