"""Building blocks shared by the architectures.

Every parameter carries its own `weight_loader(param, tensor, shard)` so fused weights
(QKV, gate-up, stacked experts) load from checkpoint names without per-model code.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ops import cpu_kernels, triton_fused
from ops.attention import attend
from ops.linear import linear, pack
from ops.norm import RMSNorm
from ops.qgemm import Bf16Weight, PackedWeight
from ops.quant import QuantWeight
from ops.rotary import RotaryEmbedding
from xinfer import parallel as tp
from xinfer.loader.lazy import Lazy, materialize, reads_parts

HELD = (PackedWeight, Bf16Weight)  # weights held alone, for every batch (ops/qgemm.py)


def default_loader(param: nn.Parameter, loaded: torch.Tensor, shard=None) -> None:
    loaded = materialize(loaded)  # a Lazy part: read now (copy_ casts to the parameter's dtype)
    if param.shape != loaded.shape:
        raise ValueError(f"shape mismatch: parameter {tuple(param.shape)} vs checkpoint {tuple(loaded.shape)}")
    param.data.copy_(loaded)


def _param(*shape, loader=default_loader) -> nn.Parameter:
    p = nn.Parameter(torch.empty(*shape), requires_grad=False)
    p.weight_loader = loader
    return p


class Linear(nn.Module):
    """y = x W^T (+ b). `shards` names the row blocks of a fused weight, in order.

    Tensor parallel (xinfer/parallel.py): "col" keeps this rank's part of each shard's rows; "row"
    keeps its part of the input columns and all-reduces the output (`reduce=False`: the caller sums
    partial outputs itself), the bias added once."""

    def __init__(self, in_features: int, out_sizes: list[int], bias: bool = False, shards: list | None = None,
                 parallel: str | None = None, take: dict | None = None, reduce: bool = True):
        """`take`: {shard: (start, count)} of the checkpoint rows ("col") or {None: ...} of the input
        columns ("row") this rank keeps; default: tp.part of each."""
        super().__init__()
        keys = shards or [None]
        self.full = dict(zip(keys, zip(_offsets(out_sizes), out_sizes)))  # the checkpoint's rows
        self.parallel = parallel if tp.size() > 1 else None
        self.reduce = reduce
        self.take = {}  # checkpoint rows (col) or columns (row) this rank keeps: (start, count)
        if self.parallel == "col":
            self.take = take or {k: tp.part(n) for k, n in zip(keys, out_sizes)}
            out_sizes = [self.take[k][1] for k in keys]
        elif self.parallel == "row":
            self.take = take or {None: tp.part(in_features)}
            in_features = self.take[None][1]
        self.shards = dict(zip(keys, zip(_offsets(out_sizes), out_sizes)))
        loader = self._load_shard if shards or self.parallel else default_loader
        self.weight = _param(sum(out_sizes), in_features, loader=loader)
        self.bias = _param(sum(out_sizes), loader=self._load_bias if self.parallel else loader) if bias else None
        self.blocks = None  # a QuantWeight beside `weight` (attach_blocks)
        self.fast = None  # the packed weight of the big batches (attach_fast)

    def local(self, t, shard):
        """The part of checkpoint tensor `t` (a shard's rows, or the whole weight) this rank keeps;
        anything with `narrow(dim, start, count)` (a tensor, a QuantWeight)."""
        if self.parallel == "col":
            return t.narrow(0, *self.take[shard])
        if self.parallel == "row":
            return t.narrow(1, *self.take[None])
        return t

    @reads_parts
    def _load_shard(self, param, loaded, shard):
        if shard is None and len(self.shards) > 1:  # a fused weight stored whole (Phi-3's qkv_proj, gate_up_proj)
            for key, (start, size) in self.full.items():
                self._load_shard(param, loaded.narrow(0, start, size), key)
            return
        start, size = self.shards[shard]
        default_loader(param.data.narrow(0, start, size), self.local(loaded, shard))

    @reads_parts
    def _load_bias(self, param, loaded, shard=None):
        if self.parallel == "row":
            return default_loader(param, loaded)
        if shard is None and len(self.shards) > 1:
            for key, (start, size) in self.full.items():
                self._load_bias(param, loaded.narrow(0, start, size), key)
            return
        start, size = self.shards[shard]
        default_loader(param.data.narrow(0, start, size), loaded.narrow(0, *self.take[shard]))

    def reads_bf16(self, rows: int) -> bool:
        """A batch of `rows` goes to the bfloat16 weight, which rounds its input to bfloat16 first: a
        bfloat16 input is the same numbers (ops/linear.py takes the blocks up to their max_rows)."""
        return self.fast is not None and self.fast.dtype == torch.bfloat16 and (self.blocks is None or rows > self.blocks.max_rows)

    def forward(self, x, out_bf16: bool = False):
        if self.parallel != "row":
            return linear(x, self.weight, self.bias, self.blocks, self.fast, out_bf16)
        y = linear(x, self.weight, self.bias if tp.rank() == 0 else None, self.blocks, self.fast)
        return tp.all_reduce(y) if self.reduce else y


def _offsets(sizes):
    out, acc = [], 0
    for s in sizes:
        out.append(acc)
        acc += s
    return out


class Embedding(nn.Module):
    """`parallel` (tensor parallel): each rank holds its rows of the vocabulary (tp.vocab_part),
    looks up the ids among them, zeros for the others, and the ranks' rows are summed."""

    def __init__(self, vocab: int, dim: int, parallel: bool = False):
        super().__init__()
        self.start, rows = tp.vocab_part(vocab)[:2] if parallel and tp.size() > 1 else (0, vocab)
        self.parallel = rows != vocab
        self.weight = _param(rows, dim, loader=self._load if self.parallel else default_loader)
        self.blocks = None  # the table held as blocks, rows dequantized as looked up (layers.hold_packed)

    @reads_parts
    def _load(self, param, loaded, shard=None):
        default_loader(param, loaded.narrow(0, self.start, param.shape[0]))

    def forward(self, ids):
        if self.blocks is not None:
            return self.blocks.rows(ids)
        if not self.parallel:
            return F.embedding(ids, self.weight)
        local = ids - self.start
        inside = (local >= 0) & (local < self.weight.shape[0])
        out = F.embedding(torch.where(inside, local, 0), self.weight) * inside[:, None].to(self.weight.dtype)
        return tp.all_reduce(out)


class GatedMLP(nn.Module):
    def __init__(self, hidden: int, inter: int, act: str = "silu", bias: bool = False, reduce: bool = True):
        super().__init__()
        self.gate_up_proj = Linear(hidden, [inter, inter], bias=bias, shards=[0, 1], parallel="col")
        self.down_proj = Linear(inter, [hidden], bias=bias, parallel="row", reduce=reduce)
        self.act, self.act_name = ACTIVATIONS[act], act

    def forward(self, x, out_bf16: bool = False):
        """`out_bf16`: the output may stay in bfloat16 where the down projection runs in it."""
        if self.act_name in ("silu", "gelu_pytorch_tanh") and triton_fused.enabled(x):
            return self.down_proj(triton_fused.gated_act(self.gate_up_proj(x), self.act_name != "silu"))
        # --cpu-matmul bfloat16, batches past the blocks: gate and up stay in bfloat16 through the
        # activation into the down projection, which would round its input to bfloat16 anyway; on a
        # CPU, silu and the product run as one pass over them (ops/cpu_kernels.c)
        gu = self.gate_up_proj(x, out_bf16=self.down_proj.fast is not None)
        h = cpu_kernels.silu_mul(gu) if self.act_name == "silu" else None
        if h is None:
            gate, up = gu.chunk(2, dim=-1)
            h = self.act(gate) * up
        return self.down_proj(h, out_bf16)


ACTIVATIONS = {
    "silu": F.silu,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "gelu": F.gelu,
}


class Attention(nn.Module):
    """QKV projection, optional per-head q/k norms, rotary, paged attention, output projection."""

    def __init__(self, hidden: int, num_heads: int, num_kv_heads: int, head_dim: int, rotary: RotaryEmbedding,
                 qkv_bias: bool = False, o_bias: bool = False, qk_norm_eps: float | None = None,
                 norm_offset: float = 0.0, scale: float | None = None, sliding_window: int | None = None,
                 softcap: float | None = None):
        super().__init__()
        q, kv = num_heads * head_dim, num_kv_heads * head_dim
        # this rank's heads (all of them without tensor parallel), as rows of the projections
        (qs, qn), (ks, kn) = tp.head_parts(num_heads, num_kv_heads)
        rows = {"q": (qs * head_dim, qn * head_dim), "k": (ks * head_dim, kn * head_dim), "v": (ks * head_dim, kn * head_dim)}
        self.qkv_proj = Linear(hidden, [q, kv, kv], bias=qkv_bias, shards=["q", "k", "v"], parallel="col", take=rows)
        self.o_proj = Linear(q, [hidden], bias=o_bias, parallel="row", take={None: rows["q"]})
        self.num_heads, self.num_kv_heads, self.head_dim = qn, kn, head_dim
        if qk_norm_eps is not None:
            self.q_norm = RMSNorm(head_dim, qk_norm_eps, norm_offset)
            self.k_norm = RMSNorm(head_dim, qk_norm_eps, norm_offset)
        else:
            self.q_norm = self.k_norm = None
        self.rotary = rotary
        self.scale = scale if scale is not None else head_dim ** -0.5
        self.sliding_window = sliding_window
        self.softcap = softcap
        self.k_cache = self.v_cache = None  # bound by the model runner

    def forward(self, positions, x, out_bf16: bool = False):
        """`out_bf16`: the output may stay in bfloat16 where the output projection runs in it."""
        t = x.shape[0]
        q, k, v = self.qkv_proj(x).split(
            [self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim, self.num_kv_heads * self.head_dim], -1)
        q = q.view(t, self.num_heads, self.head_dim)
        k = k.view(t, self.num_kv_heads, self.head_dim)
        v = v.view(t, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = self.rotary(positions, q, k)
        o = attend(q, k, v, self.k_cache, self.v_cache, self.scale, self.sliding_window, self.softcap)
        return self.o_proj(o.reshape(t, -1), out_bf16)


# Checkpoint (HF) sub-names that load into a shard of a fused parameter.
PACKED = {
    "q_proj": ("qkv_proj", "q"),
    "k_proj": ("qkv_proj", "k"),
    "v_proj": ("qkv_proj", "v"),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}


def _target(name: str, remap=None) -> tuple[str, object]:
    """The parameter (and shard of it) that checkpoint tensor `name` loads into."""
    target = remap(name) if remap else None
    if target is not None:
        return target
    for src, (dst, shard) in PACKED.items():
        if f".{src}." in name:
            return name.replace(f".{src}.", f".{dst}."), shard
    return name, None


def load_weights(model: nn.Module, weights, remap=None) -> set[str]:
    """Load (name, tensor) pairs through each parameter's loader; returns the names loaded.
    `remap(name) -> (param_name, shard) | None` lets a model handle its own names first."""
    params = dict(model.named_parameters())
    loaded = set(getattr(model, "held", ()))  # parameters whose weights came as blocks (hold_packed)
    for name, tensor in weights:
        pname, shard = _target(name, remap)
        if pname not in params:
            if "rotary_emb.inv_freq" in name:
                continue
            raise KeyError(f"checkpoint tensor {name!r} has no matching parameter")
        p = params[pname]
        loader = getattr(p, "weight_loader", default_loader)
        if isinstance(tensor, Lazy) and not getattr(loader, "reads_parts", False):
            tensor = tensor.tensor()
        try:
            loader(p, tensor if isinstance(tensor, Lazy) else tensor.to(p.dtype), shard)
        except ValueError as e:
            raise ValueError(f"{name}: {e}") from None
        loaded.add(pname)
    return loaded


def attach_blocks(model: nn.Module, blocks, remap=None) -> int:
    """Give each Linear whose every shard comes as blocks its QuantWeight (the shards' rows in
    order); `blocks` yields (checkpoint name, QuantWeight): a GGUF file's, or a quantized HF
    checkpoint's (xinfer/loader/dequant.py). The output head's blocks (the model's
    `head_param_name()`) go to `model.head_blocks`. Returns how many weights got blocks."""
    linears = {f"{n}.weight": m for n, m in model.named_modules() if isinstance(m, Linear)}
    parts: dict[str, dict] = {}
    head = None
    stacks: dict[str, dict] = {}  # MoE expert stacks: {experts module: {part: QuantWeight}}
    for name, q in blocks:
        if "_stack." in name:
            module, part = name.rsplit(".", 1)[0].rsplit(".", 1)
            stacks.setdefault(module, {})[part.removesuffix("_stack")] = q
            continue
        pname, shard = _target(name, remap)
        if pname == model.head_param_name() and tp.last_stage():  # tensor parallel: this rank's rows
            head = q if tp.size() == 1 else q.narrow(0, *tp.vocab_part(q.shape[0])[:2])
        elif pname in linears:
            lin = linears[pname]
            try:
                if shard is None and lin.parallel and len(lin.shards) > 1:  # fused, stored whole: split, then ours
                    parts.setdefault(pname, {}).update({k: lin.local(q.narrow(0, *lin.full[k]), k) for k in lin.full})
                else:
                    parts.setdefault(pname, {})[shard] = lin.local(q, shard)
            except ValueError:  # a tensor-parallel part that cuts a block: this weight runs in float
                parts[pname] = {"cut": None}
    count = 0
    for pname, got in parts.items():
        lin = linears[pname]
        if None in got:  # the whole weight, fused or not
            q = got[None]
        elif set(got) == set(lin.shards):
            parts = [got[s] for s in sorted(lin.shards, key=lambda s: lin.shards[s][0])]
            q = type(parts[0]).cat(parts) if len({type(p) for p in parts}) == 1 else None
        else:
            continue  # some shard is in a type the kernels do not read: float only
        if q is not None and q.shape == tuple(lin.weight.shape):
            lin.blocks = q
            count += 1
    mods = dict(model.named_modules())
    for module, got in stacks.items():
        if module in mods:
            count += mods[module].attach_stacks(got.get("gate_proj"), got.get("up_proj"), got.get("down_proj"))
    if head is not None and not isinstance(getattr(model, "head_blocks", None), HELD):
        model.head_blocks = head
        count += 1
    return count


def holds(model: nn.Module, remap=None):
    """Which checkpoint tensors `hold_packed` can take: the Linears', the embedding tables' and the head's."""
    params = {f"{n}.weight" for n, m in model.named_modules() if isinstance(m, (Linear, Embedding))}
    params.add(model.head_param_name())
    return lambda name: _target(name, remap)[0] in params


def hold_packed(model: nn.Module, blocks, remap=None) -> set[str]:
    """Before any weight is read: the Linears (and the head, unless it is the embedding table too) whose
    every shard comes held (a PackedWeight or Bf16Weight, ops/qgemm.py) take those and hold no float weight. Returns the
    checkpoint names they cover (the loader skips them); the model remembers the parameters in `held`."""
    blocks = list(blocks)
    attach_blocks(model, blocks, remap)
    done = {f"{n}.weight" for n, m in model.named_modules() if isinstance(m, Linear) and isinstance(m.blocks, HELD)}
    if isinstance(getattr(model, "head_blocks", None), HELD):
        done.add(model.head_param_name())
    by_param = {_target(name, remap)[0]: q for name, q in blocks}
    for n, m in model.named_modules():
        if isinstance(m, Embedding) and not m.parallel and f"{n}.weight" in by_param:
            m.blocks = by_param[f"{n}.weight"]  # a tied head's blocks too: one copy for both
            done.add(f"{n}.weight")
    params = dict(model.named_parameters())
    for pname in done:
        params[pname].data = torch.empty(0, dtype=params[pname].dtype)
    model.held = done
    model.held_names = {name for name, _ in blocks if _target(name, remap)[0] in done}
    return model.held_names


def attach_fast(model: nn.Module, matmul: str) -> int:
    """The weights that the batches the GGUF blocks do not take multiply with, packed once
    (ops/linear.py pack), and the blocks' arithmetic (--cpu-matmul, ops/quant.py QuantWeight.use).
    bfloat16: for each Linear and the LM head, its bfloat16 panels (ops/qgemm.py Bf16Weight) for every
    batch where the kernels have AVX512_BF16, else a bfloat16 copy. float32 and int16 (whose GEMMs are
    float32): the Linears that have blocks. A Linear with a packed weight no longer reads its plain
    one (small batches read the blocks, the rest the packed weight): it is freed, so a bfloat16
    checkpoint is held once, in bfloat16, not also widened to float32. Returns how many weights were
    packed."""
    bf16 = matmul == "bfloat16"
    dtype = torch.bfloat16 if bf16 else torch.float32
    head_lin = None if getattr(model, "tied", True) else getattr(model, "lm_head", None)  # packed below, once
    n = 0
    for mod in model.modules():
        if isinstance(mod, Linear) and isinstance(mod.blocks, HELD) or mod is head_lin:
            continue  # every batch reads its blocks
        if isinstance(mod, Linear) and bf16 and mod.blocks is None and Bf16Weight.usable(mod.weight.shape):
            mod.blocks = Bf16Weight.of(mod.weight.data)  # every batch, and the one-call decode step
            mod.weight.data = torch.empty(0, dtype=mod.weight.dtype)
            n += 1
        elif isinstance(mod, Linear) and (bf16 or mod.blocks is not None):
            mod.fast = pack(mod.weight.data, dtype)
            mod.weight.data = torch.empty(0, dtype=mod.weight.dtype)
            if mod.blocks is not None:
                mod.blocks.use(matmul)
            n += 1
    if getattr(model, "head_blocks", None) is not None:
        model.head_blocks.use(matmul)
    # float32: the head stays plain (a tied one is the embedding table too: packing would copy it);
    # pipeline parallel: the head is on the last stage
    if bf16 and tp.last_stage() and not isinstance(getattr(model, "head_blocks", None), HELD):
        head = model.model.embed_tokens.weight if model.tied else model.lm_head.weight
        if getattr(model, "head_blocks", None) is None and Bf16Weight.usable(head.shape):
            model.head_blocks = Bf16Weight.of(head.data)
        else:
            model.head_fast = pack(head.data, dtype)
        if head_lin is not None:  # an own head is read packed (the blocks take the small batches); a tied one is the table
            head_lin.weight.data = torch.empty(0, dtype=head_lin.weight.dtype)
    return n
