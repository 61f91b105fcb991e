"""How much of the indexer's KL target is position? (issue 51: why the learned indexer does not follow its target)

    PYTHONPATH=. python bench/indexer_target_position.py CKPT_OR_RUN [--documents 64] [--out FILE.json]

The indexer (nsa/attention/indexer.py) is trained by KL(target || softmax(scores)) over each query's candidate blocks,
target = the layer's (NSAAttention.indexer_target: by default the compressed branch's block mass, Eq. 9-10 over
RoPE-rotated queries and compressed keys; with nsa.indexer_target=dense, dense attention over the selected branch's
keys). It has no positional encoding by design (its scores must not meet unseen positions beyond the training
length), so the part of the target that depends only on where a block is, not on what it holds, is out of its reach.
On the recall probe's documents (at the training length) of a checkpoint trained with nsa.selector=indexer, per NSA
layer, with the same candidates and the same KL as training:
  indexer     the checkpoint's own indexer scores;
  position    a predictor that knows only positions: the mean target over half of the documents at the same
              (query position, block), evaluated on the other half (a lower bound of what position alone explains);
  uniform     equal scores over the candidates.
If `position` is far below `indexer`, the target is mostly positional and an indexer without positions cannot match
it however it is trained; if `indexer` is below `position`, it has learned content the positions do not carry.
"""
from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

import torch

from nsa.attention.impl.masked import document_block_count
from nsa.attention.impl.index_scores import indexer_kl
from train.checkpoint.io import load_checkpoint, model_from_checkpoint, resolve_checkpoint
from train.data.recall import RecallEncoder, probe_document
from train.data.tokenizers import load_tokenizer
from train.evaluation.recall import PROBE_SEED, corpus_spec


def capture(model) -> list[tuple]:
    """Every NSA layer with an indexer records, for each forward, what its KL is computed from: (target, scores,
    positions) over all queries, target and scores [H_kv, T, N_b] (batch 1), positions [T] or [1, T]."""
    stores = []
    for blk in model.blocks:
        layer = blk.attn
        if getattr(layer, "indexer", None) is None:
            continue
        store: list = []
        stores.append((layer, store))
        c = layer.cfg

        def plain(q, ck, cv, sel_k, sel_v, win_k, win_v, t0, t_end, index=None, capped=None, layer=layer,
                  original=layer._branches, store=store):
            T = q.shape[2]
            q_I, w_I, keys, _, token_keys = index
            s = layer.indexer.scores(q_I, w_I, layer.indexer.block_keys(keys) if token_keys else keys)  # [1, H_kv, T, N_b]
            qg = q.view(1, layer.n_kv_heads, layer.n_groups, T, layer.head_dim)
            target = layer.indexer_target(qg, ck, sel_k, s.shape[-1], all_rows=True)  # [1, H_kv, T, N_b]
            store.append((target[0], s[0], torch.arange(T)))
            return original(q, ck, cv, sel_k, sel_v, win_k, win_v, t0, t_end, index, capped)

        def documents(x, qg, ck, sel_k, frame, *rest, layer=layer, original=layer._index_documents, store=store, c=c):
            T = x.shape[1]
            n_blocks = document_block_count(ck.shape[2], T, c.l, c.d, c.l_sel)
            target = layer.indexer_target(qg, ck, sel_k, n_blocks, frame, all_rows=True)  # [1, H_kv, T, N_b]
            s = layer.indexer.document_scores(x, frame, target.shape[-1])
            store.append((target[0], s[0], frame[0][:, None, :][0]))
            return original(x, qg, ck, sel_k, frame, *rest)

        layer._branches, layer._index_documents = plain, documents
    return stores


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("checkpoint", type=Path)
    p.add_argument("--documents", type=int, default=64)
    p.add_argument("--out", type=Path)
    args = p.parse_args()
    ckpt = resolve_checkpoint(args.checkpoint)
    spec = corpus_spec(ckpt).at_length(1)
    stored = load_checkpoint(ckpt)["config"]
    model, cfg = model_from_checkpoint(ckpt, "cpu", max_seq_len=max(stored["model"]["max_seq_len"], spec.doc_tokens + 1))
    model.eval()
    tok = load_tokenizer(cfg["data"]["tokenizer"])
    rng = random.Random(PROBE_SEED)
    docs = [probe_document(rng, spec, RecallEncoder(tok, spec.format)) for _ in range(args.documents)]
    T = min(len(d.ids) for d in docs) + 1  # one length for all: the same (position, block) cells in every document
    stores = capture(model)
    if not stores:
        raise SystemExit("error: the checkpoint has no NSA layer with an indexer (nsa.selector=indexer)")
    targets = [[] for _ in stores]  # per layer: [H_kv, T, N_b] per document
    scores = [[] for _ in stores]
    with torch.no_grad():
        for doc in docs:
            x = torch.full((1, T), tok.eos_id, dtype=torch.long)
            x[0, 1:] = torch.from_numpy(doc.ids[: T - 1])
            for _, store in stores:
                store.clear()
            model(x)
            for i, (layer, store) in enumerate(stores):
                target, s, positions = store[0]
                targets[i].append(target)
                scores[i].append(s)
    half = len(docs) // 2
    out = {"checkpoint": str(ckpt), "documents": len(docs), "T": T, "layers": {}}
    for i, (layer, _) in enumerate(stores):
        target = torch.stack(targets[i])  # [D, H_kv, T, N_b]
        score = torch.stack(scores[i])
        held = slice(half, None)
        mean = target[:half].mean(0, keepdim=True).expand_as(target[held])  # position's predictor, fit on half
        kl = {
            "indexer": indexer_kl(score[held], target[held], layer.cfg.l_sel, positions),
            "position": indexer_kl(torch.log(mean.clamp_min(1e-30)), target[held], layer.cfg.l_sel, positions),
            "uniform": indexer_kl(torch.zeros_like(score[held]), target[held], layer.cfg.l_sel, positions),
        }
        out["layers"][f"layer{i}"] = {k: round(float(v), 4) for k, v in kl.items()}
        print(f"layer {i}: KL(target || .) over the candidate blocks: " +
              ", ".join(f"{k} {float(v):.4f}" for k, v in kl.items()), flush=True)
    if args.out:
        args.out.write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
