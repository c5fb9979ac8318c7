"""--speculative-method mtp: a checkpoint's multi-token-prediction head drafts. The head's drafts
equal a reference built from transformers' own layers on the same weights; the output is the
target's greedy output, with preemption and prefix caching; GGUF next-n tensors load."""
import json

import pytest
import torch
import transformers as tf
from gguf import GGMLQuantizationType as Q
from safetensors.torch import load_file, save_file

from tests.test_models import DEEPSEEK, _make, _write_gguf, perturbed
from xinfer import Engine, EngineConfig, SamplingParams
from xinfer.errors import ModelLoadError
from xinfer.models import MODELS
from xinfer.spec import MTP_ARCHITECTURES

PROMPTS = [list(range(3, 40)), [7, 9, 11, 7, 9, 11, 7, 9], [5] * 13 + [100, 200, 300], list(range(250, 270))]
GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
CFG = dict(DEEPSEEK, rope_parameters={"rope_type": "default", "rope_theta": 10000.0})


def _rms(x, w, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


class Reference:
    """The head written out with transformers' pieces: the target (3 layers) gives h; a one-layer
    DeepSeek-V3 whose layer is MoE stands for the head's decoder layer, its final norm for
    shared_head.norm and its lm_head for the target's."""

    def __init__(self):
        self.target = _make_ds(CFG)
        self.layer = _make_ds(dict(CFG, num_hidden_layers=1, first_k_dense_replace=0), seed=1)
        self.layer.lm_head.weight.data.copy_(self.target.lm_head.weight)
        h = CFG["hidden_size"]
        g = torch.Generator().manual_seed(2)
        self.enorm, self.hnorm = (1 + 0.1 * torch.randn(h, generator=g) for _ in range(2))
        self.eh_proj = torch.randn(h, 2 * h, generator=g) * 0.1
        self.eps = self.target.config.rms_norm_eps

    def state_dict(self):
        """The target's weights and the head's as DeepSeek-V3 checkpoints store it: layer 3, with
        copies of the embedding and head."""
        sd = dict(self.target.state_dict())
        n = "model.layers.3."
        sd.update({k.replace("model.layers.0.", n): v for k, v in self.layer.state_dict().items()
                   if k.startswith("model.layers.0.")})
        sd.update({n + "enorm.weight": self.enorm, n + "hnorm.weight": self.hnorm, n + "eh_proj.weight": self.eh_proj,
                   n + "shared_head.norm.weight": self.layer.model.norm.weight,
                   n + "shared_head.head.weight": self.target.lm_head.weight,
                   n + "embed_tokens.weight": self.target.model.embed_tokens.weight})
        return {k: v.detach().clone().contiguous() for k, v in sd.items()}

    def _x(self, tok, hidden):
        emb = self.target.model.embed_tokens.weight[tok]
        return torch.cat([_rms(emb, self.enorm, self.eps), _rms(hidden, self.hnorm, self.eps)], -1) @ self.eh_proj.T

    @torch.no_grad()
    def drafts(self, tokens, k):
        """The greedy drafts after `tokens`: the head over every position, then its own output fed
        back at each further one."""
        t = torch.tensor(tokens)
        h = self.target.model(t[None]).last_hidden_state[0]
        xs = [self._x(t[1:], h[:-1])]
        out = []
        for _ in range(k):
            x = torch.cat(xs)[None]
            cap = {}
            hook = self.layer.model.layers[0].register_forward_hook(lambda m, a, o: cap.update(g=o[0] if isinstance(o, tuple) else o))
            logits = self.layer(inputs_embeds=x, position_ids=torch.arange(x.shape[1])[None]).logits[0, -1]
            hook.remove()
            out.append(int(logits.argmax()))
            xs.append(self._x(torch.tensor([out[-1]]), cap["g"][0, -1:]))
        return out


def _make_ds(cfg, seed=0):
    torch.manual_seed(seed)
    return perturbed(tf.DeepseekV3ForCausalLM(tf.DeepseekV3Config(**cfg)).eval())


@pytest.fixture(scope="module")
def ref():
    return Reference()


@pytest.fixture(scope="module")
def mtp_path(ref, tmp_path_factory):
    path = tmp_path_factory.mktemp("deepseek_mtp")
    ref.target.save_pretrained(path)
    for f in path.glob("*.safetensors"):
        f.unlink()
    save_file(ref.state_dict(), path / "model.safetensors")
    cfg = json.loads((path / "config.json").read_text())
    cfg["num_nextn_predict_layers"] = 1
    (path / "config.json").write_text(json.dumps(cfg))
    return str(path)


def _engine(path, **kw):
    return Engine(EngineConfig(model=path, block_size=4, num_kv_blocks=kw.pop("num_kv_blocks", 200),
                               prefill_chunk_size=kw.pop("prefill_chunk_size", 16), speculative_disable_by_batch_size=0,
                               **kw))


@pytest.fixture(scope="module")
def plain(mtp_path):
    return [o.token_ids for o in _engine(mtp_path).generate(PROMPTS, GREEDY)]


def test_drafts_equal_the_reference_head(ref, mtp_path):
    """Every proposal, through chunked prefill, rejections and rewritten head KV, equals the head
    recomputed from scratch on the tokens so far."""
    e = _engine(mtp_path, num_speculative_tokens=3, prefill_chunk_size=8)
    assert e.scheduler.spec_method == "mtp"  # the default where the model has a head xinfer loads
    drafter, calls = e.runner.drafter, []
    orig = drafter.propose

    def propose(plan, seqs):
        out = orig(plan, seqs)
        calls.extend((list(seqs[sid].tokens), d) for sid, (d, _) in out.items())
        return out
    drafter.propose = propose
    e.generate([PROMPTS[0], PROMPTS[2]], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    assert len(calls) >= 6 and any(len(d) > 1 for _, d in calls)
    for tokens, drafts in calls:
        assert drafts == ref.drafts(tokens, len(drafts)), len(tokens)


def test_greedy_output_is_the_targets(mtp_path, plain):
    e = _engine(mtp_path, num_speculative_tokens=3)
    assert [o.token_ids for o in e.generate(PROMPTS, GREEDY)] == plain
    s = e.scheduler
    assert s.num_spec_steps > 0 and 0 <= s.num_accepted_tokens <= s.num_draft_tokens
    e.blocks.check_integrity()


def test_preemption_and_prefix_cache(mtp_path, plain):
    e = _engine(mtp_path, num_speculative_tokens=2, num_kv_blocks=34)
    ids, toks = [], {}

    def step():
        for d in e.step():
            toks.setdefault(d.seq_id, []).extend(d.token_ids)
    for p in PROMPTS + PROMPTS[:2]:
        ids += e.add_request(p, GREEDY)
        step()
    while e.has_unfinished():
        step()
    assert [toks[i] for i in ids[:len(PROMPTS)]] == plain
    assert e.scheduler.num_preemptions > 0 and e.core.num_cached_prompt_tokens > 0
    e.blocks.check_integrity()


def test_sampled_requests_are_reproducible(mtp_path):
    e = _engine(mtp_path, num_speculative_tokens=3)
    p = SamplingParams(temperature=0.8, top_p=0.9, max_tokens=16, seed=7, ignore_eos=True)
    a, b = (e.generate(PROMPTS[:2], p) for _ in range(2))
    assert [o.token_ids for o in a] == [o.token_ids for o in b]


def test_a_checkpoint_without_the_head_is_a_clear_error(ref, mtp_path, tmp_path):
    path = tmp_path / "no_head"
    path.mkdir()
    (path / "config.json").write_text(open(f"{mtp_path}/config.json").read())
    sd = {k: v for k, v in load_file(f"{mtp_path}/model.safetensors").items() if not k.startswith("model.layers.3.")}
    save_file(sd, path / "model.safetensors")
    with pytest.raises(ModelLoadError, match="no weights for them"):
        _engine(str(path), num_speculative_tokens=2)
    _engine(str(path), num_speculative_tokens=2, speculative_method="ngram")  # the way out the error names


def test_every_listed_family_builds_its_head(mtp_path):
    base = json.loads(open(f"{mtp_path}/config.json").read())
    for arch in MTP_ARCHITECTURES:
        assert MODELS[arch](dict(base, architectures=[arch], _mtp=True)).mtp is not None, arch


@pytest.mark.parametrize("qtype", [Q.F32, Q.Q8_0], ids=lambda q: q.name)
def test_gguf_nextn_tensors(tmp_path, qtype):
    """GLM-4.5 MoE from GGUF with its next-n depth: the head loads (as blocks too) and drafts."""
    path = tmp_path / "glm.gguf"
    _write_gguf(_make("glm4_moe"), "glm4moe", path, qtype, nextn=1)
    want = [o.token_ids for o in _engine(str(path)).generate(PROMPTS[:3], GREEDY)]
    e = _engine(str(path), num_speculative_tokens=3)
    assert e.runner.model.mtp is not None
    if qtype != Q.F32:
        assert e.runner.model.mtp.eh_proj.blocks is not None
    assert [o.token_ids for o in e.generate(PROMPTS[:3], GREEDY)] == want
    assert e.scheduler.num_spec_steps > 0
