"""Data pipeline: tokenizers, sources, packing, prepared token files, and build_data for the trainer.

    bundle = build_data(cfg.data, seq_len=T, batch_size=B, vocab_size=V, seed=s, rank=r, world_size=w, pin=cuda)
    x, y = bundle.train.next_batch()          # int64 [B, T], y = x shifted by one
    state = bundle.train.state_dict()         # plain ints/str/lists/dicts; load_state_dict(state) resumes exactly
    val = bundle.val_batches(n)               # the same n held-out batches on every call
See docs/DATA.md.
"""
from train.core.data_config import DataConfig
from train.data.build import BatchStream, DataBundle, build_data
from train.data.tokenizers import Tokenizer, load_tokenizer, padded_vocab

__all__ = ["BatchStream", "DataBundle", "DataConfig", "Tokenizer", "build_data", "load_tokenizer", "padded_vocab"]
