"""What a step returns besides its tokens: sampled tokens' logprobs, prompt tokens' logprobs (echo,
scoring) and pooled embeddings, from the hidden states and sampler outputs of the model runner."""
from __future__ import annotations

import torch


def pooled_embeddings(hidden, pooled, seqs: dict, pooling: str) -> list[tuple[int, bytes]]:
    """Embedding sequences: --pooling over their prompt's final hidden states, which come in as
    many steps as the prefill has chunks (mean keeps a running float32 sum in the WorkerSeq; a
    recompute makes a new one). A prompt that ends this step gives its vector, L2-normalised."""
    out = []
    for sid, row, start, end in pooled:
        ws = seqs[sid]
        if pooling == "mean":  # the rows of this chunk's prompt tokens
            part = hidden[row:row + end - start].float().sum(0)
            ws.pool_sum = part if ws.pool_sum is None else ws.pool_sum + part
        if end < ws.num_prompt:
            continue
        mean = pooling == "mean"
        vec = ws.pool_sum / ws.num_prompt if mean else hidden[row + end - start - 1].float()
        vec = torch.nn.functional.normalize(vec, dim=0)
        out.append((sid, vec.cpu().numpy().astype("<f4").tobytes()))
    return out


def prompt_logprobs(model, hidden, scored, seqs: dict):
    """Logprobs of prompt tokens under the model's raw distribution (for echo / scoring):
    the row of position p scores the token at p + 1."""
    out = []
    for sid, row, first, count in scored:
        ws = seqs[sid]
        lp = torch.log_softmax(model.compute_logits(hidden[row:row + count]).float(), dim=-1)
        target = torch.tensor(ws.tokens[first:first + count], device=lp.device)
        chosen_t = lp.gather(1, target[:, None])
        ranks = (lp >= chosen_t).sum(-1).tolist()  # vLLM's rank: 1 + how many are more likely (ties count)
        chosen = chosen_t[:, 0].tolist()
        k = ws.params.prompt_logprobs
        if k:
            vals, idx = lp.topk(k, dim=-1)
            alts = [list(zip(i, v)) for i, v in zip(idx.tolist(), vals.tolist())]
        else:
            alts = [[] for _ in chosen]
        out.append((sid, first, list(zip(chosen, alts, ranks))))
    return out


def token_logprobs(seq_ids, lps, seqs: dict):
    """Each sampled token's (logprob, top alternatives) where its sequence asked for them, else None.
    `seqs`: the step's own (a step launched after it may have dropped some from the runner's)."""
    if lps is None:
        return []
    chosen, top_ids, top_vals = (x.tolist() if x is not None else None for x in lps)
    out = []
    for i, sid in enumerate(seq_ids):
        k = seqs[sid].params.logprobs
        if k is None:
            out.append(None)
        else:
            alts = list(zip(top_ids[i][:k], top_vals[i][:k])) if k and top_ids else []
            out.append((chosen[i], alts))
    return out
