"""Generation with decode caches (nsa/generate.py), the CLI (train/generate.py), samples during training."""
from __future__ import annotations

import io
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from nsa.config import ModelConfig, NSAConfig
from nsa.generate import GenerationError, generate, seeded_generators
from nsa.model import Transformer
from nsa.static_decode import StaticDecoder
from train import generate as cli
from train.checkpoint.io import model_from_checkpoint
from train.data.tokenizers import load_tokenizer
from train.core.errors import ConfigError
from train.trainer.runner import run_training
from train.generation.text_stream import TextStream, continuation_text

from .helpers import read_jsonl, tiny_config

REPO = Path(__file__).resolve().parents[2]
# small NSA blocks: over 50 tokens, compressed tokens are emitted, 4 selection blocks compete for 3
# slots and the 16-token window rolls over during decode
NSA = NSAConfig(l=8, d=4, l_sel=16, n_sel=3, w=16)
PROMPT_LEN, NEW, CHUNK = 20, 30, 8  # chunk < prompt: chunked prefill


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Tiny models: one intra-op thread is faster than two competing for a busy machine's cores."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def tiny_model(attention: str) -> Transformer:
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=320, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=64, max_seq_len=64,
                      attention=attention, nsa=NSA, init_std=0.2)  # wide init: a far from uniform distribution
    return Transformer(cfg).eval()


def prompt_ids() -> list[int]:
    return torch.randint(0, 320, (PROMPT_LEN,), generator=torch.Generator().manual_seed(1)).tolist()


@pytest.fixture(scope="module", params=["dense", "nsa"])
def model(request):
    return tiny_model(request.param)


def test_greedy_equals_argmax_of_full_recomputation(model):
    prompt = prompt_ids()
    new = generate(model, prompt, NEW, temperature=0.0, prefill_chunk=CHUNK).ids[0]
    assert len(new) == NEW and len(set(new)) > 10  # not a degenerate repetition
    with torch.no_grad():
        logits = model(torch.tensor([prompt + new]))[0]  # [T, V] one forward, no caches
    # position p's logits predict token p + 1: new[i] sits at PROMPT_LEN + i
    assert logits[PROMPT_LEN - 1:-1].argmax(-1).tolist() == new


def test_greedy_batch_rows_are_identical(model):
    single = generate(model, prompt_ids(), NEW, temperature=0.0, prefill_chunk=CHUNK).ids[0]
    batch = generate(model, prompt_ids(), NEW, temperature=0.0, num_samples=3, prefill_chunk=CHUNK)
    assert batch.ids == [single] * 3
    assert batch.prefill_tokens == 3 * PROMPT_LEN and batch.decode_tokens == 3 * NEW


def test_seeded_batch_equals_separate_runs(model):
    sample = dict(temperature=1.0, top_k=0, top_p=1.0, prefill_chunk=CHUNK)
    batch = generate(model, prompt_ids(), NEW, num_samples=3, generators=seeded_generators(7, 3, "cpu"), **sample)
    alone = [generate(model, prompt_ids(), NEW, generators=seeded_generators(7 + j, 1, "cpu"), **sample).ids[0]
             for j in range(3)]
    assert batch.ids == alone
    assert len({tuple(row) for row in batch.ids}) == 3


def test_seeded_sampling_is_reproducible():
    m = tiny_model("dense")
    run = lambda seed: generate(m, prompt_ids(), NEW, temperature=1.0, top_k=100, top_p=0.9,  # noqa: E731
                                generators=seeded_generators(seed, 1, "cpu")).ids[0]
    assert run(3) == run(3)
    assert run(3) != run(4)
    greedy = generate(m, prompt_ids(), NEW, temperature=0.0).ids[0]
    assert run(3) != greedy  # the sampler samples


def test_top_k_one_and_tiny_top_p_are_greedy():
    m = tiny_model("dense")
    greedy = generate(m, prompt_ids(), NEW, temperature=0.0).ids[0]
    gens = seeded_generators(0, 1, "cpu")
    assert generate(m, prompt_ids(), NEW, temperature=1.5, top_k=1, generators=gens).ids[0] == greedy
    assert generate(m, prompt_ids(), NEW, temperature=1.5, top_p=1e-6, generators=gens).ids[0] == greedy


def test_stops_at_eos_and_streams_each_step():
    m = tiny_model("nsa")
    greedy = generate(m, prompt_ids(), NEW, temperature=0.0).ids[0]
    eos = greedy[12]
    cut = greedy.index(eos)
    streamed = []
    out = generate(m, prompt_ids(), NEW, temperature=0.0, num_samples=2, eos_id=eos, on_token=streamed.append)
    assert out.ids == [greedy[:cut]] * 2
    assert len(streamed) == cut + 1 and streamed[-1] == [eos, eos]  # stopped once every row had EOS
    assert [step[0] for step in streamed[:-1]] == greedy[:cut]


def test_a_static_decoder_generates_what_the_growing_caches_generate(model):
    """decoder=StaticDecoder (nsa/static_decode.py, eager on CPU): greedy and seeded sampling, two rows, the same
    tokens as the growing caches (its steps' logits equal a full forward's: tests/nsa/test_static_decode.py)."""
    prompt = prompt_ids()
    for sample in (dict(temperature=0.0), dict(temperature=1.0, top_k=0, top_p=1.0)):
        gens = lambda: seeded_generators(5, 2, "cpu")  # noqa: E731
        caches = generate(model, prompt, NEW, num_samples=2, generators=gens(), prefill_chunk=CHUNK, **sample)
        decoder = StaticDecoder(model, 2, PROMPT_LEN + NEW, graphs=False)
        static = generate(model, prompt, NEW, num_samples=2, generators=gens(), prefill_chunk=CHUNK,
                          decoder=decoder, **sample)
        assert static.ids == caches.ids and len(static.ids[0]) == NEW
    with pytest.raises(GenerationError, match="holds 2 rows of 50 positions; this call needs 1 rows of 51"):
        generate(model, prompt, NEW + 1, decoder=decoder)


def test_a_static_decoder_restarts_at_a_sampled_document_eos():
    """A packed-documents model continues past a sampled EOS in a new document from position 0: the static decoder
    restarts over the same buffers (a step reads nothing of the old document) and samples what fresh growing caches
    sample; several such samples at once are refused in one line."""
    m = tiny_model("nsa")
    prompt = prompt_ids()
    run = lambda **kw: generate(m, prompt, NEW, temperature=1.0, generators=seeded_generators(2, 1, "cpu"),  # noqa: E731
                                **kw).ids[0]
    first = run()
    eos = next(t for t in first[3:] if t not in prompt)  # a token sampled after the prompt: the document's EOS
    m.document_eos_id = eos
    try:
        caches = run()
        assert eos in caches[:-1]  # it is sampled and decoding goes on past it, in a new document
        assert run(decoder=StaticDecoder(m, 1, PROMPT_LEN + NEW, graphs=False)) == caches
        with pytest.raises(GenerationError, match="several samples of a packed-documents model"):
            generate(m, prompt, NEW, num_samples=2, decoder=StaticDecoder(m, 2, PROMPT_LEN + NEW, graphs=False))
    finally:
        m.document_eos_id = None


def test_too_long_for_the_context_is_an_error():
    m = tiny_model("dense")
    with pytest.raises(GenerationError, match="max_seq_len=64"):
        generate(m, prompt_ids(), 64 - PROMPT_LEN + 1, temperature=0.0)
    generate(m, prompt_ids(), 64 - PROMPT_LEN, temperature=0.0)  # exactly the context: fine
    for bad in (dict(temperature=-1.0), dict(top_p=0.0), dict(top_k=-1), dict(num_samples=0)):
        with pytest.raises(GenerationError):
            generate(m, prompt_ids(), 4, **bad)


def test_text_stream_never_prints_half_characters():
    tok = load_tokenizer("byte")
    prompt = tok.encode_batch(["Ça coûte "])[0]
    ids = tok.encode_batch(["5 € — naïve 日本"])[0]  # 2- and 3-byte characters, one byte per token
    stream = TextStream(tok, prompt)
    pieces = [stream.push(i) for i in ids] + [stream.flush()]
    assert all("\ufffd" not in p for p in pieces)
    assert "".join(pieces) == "5 € — naïve 日本" == continuation_text(tok, prompt, ids)
    assert "" in pieces  # held back while a character was incomplete


# ---- the CLI on a trained checkpoint ---------------------------------------------------------------
@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("gen") / "run"
    assert run_training(tiny_config(out, "--data.tokenizer=byte", "--train.steps=2")) == 0
    return out


def _main(*argv: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    return cli.main(list(argv), out, err), out.getvalue(), err.getvalue()


def test_cli_streams_the_continuation(run_dir):
    assert not (run_dir / "samples.jsonl").exists()  # sampling is off by default
    args = ["--prompt", "Hello", "--max_new_tokens", "20", "--temperature", "0", "--device", "cpu"]
    proc = subprocess.run([sys.executable, "-m", "train.generate", str(run_dir), *args], cwd=REPO,
                          capture_output=True, text=True, timeout=120, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert proc.returncode == 0, proc.stderr
    assert "prefill 5 tokens" in proc.stderr and "decode 20 tokens" in proc.stderr and "tok/s" in proc.stderr
    code, out, _ = _main(str(run_dir / "latest.pt"), *args, "--json")
    assert code == 0
    (row,) = [json.loads(line) for line in out.splitlines()]
    model, _ = model_from_checkpoint(run_dir / "latest.pt")
    assert row["ids"] == generate(model, list(b"Hello"), 20, temperature=0.0).ids[0]
    assert proc.stdout == "Hello" + row["text"] + "\n"


def test_cli_prompt_file_and_samples(run_dir, tmp_path):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("The sky\n\n   \nOnce upon\n")
    code, out, err = _main(str(run_dir), "--prompt_file", str(prompts), "--num_samples", "2", "--max_new_tokens", "6",
                           "--seed", "3", "--json")
    assert code == 0, err
    rows = [json.loads(line) for line in out.splitlines()]
    assert [(r["prompt"], r["sample"]) for r in rows] == [("The sky", 1), ("The sky", 2), ("Once upon", 1), ("Once upon", 2)]
    assert all(len(r["ids"]) == 6 and r["decode_tokens"] == 12 and r["decode_tokens_per_s"] > 0 for r in rows)
    assert err.count("tok/s") == 2 * 2  # one line per prompt: prefill and decode rates
    code, out, _ = _main(str(run_dir), "--prompt", "The sky", "--num_samples", "2", "--max_new_tokens", "6", "--seed", "3")
    assert code == 0
    assert out == "".join(f"=== prompt 1, sample {r['sample']} ===\nThe sky{r['text']}\n" for r in rows[:2])


@pytest.mark.parametrize("argv, message", [
    (["--prompt", ""], "empty"),
    (["--prompt", "x", "--max_new_tokens", "64"], "max_seq_len=64"),
    (["--prompt", "x", "--top_p", "1.5"], "top_p"),
    (["--prompt", "x", "--max_new_tokens", "many"], "invalid int"),
    (["--prompt", "x", "--prompt_file", "p.txt"], "not allowed"),
    (["--prompt_file", "/nonexistent/prompts.txt"], "not found"),
    (["--prompt", "x", "--device", "cuda:0" if not torch.cuda.is_available() else "tpu"], "--device"),
])
def test_cli_bad_input_is_one_error_line(run_dir, argv, message):
    code, out, err = _main(str(run_dir), *argv)
    assert code == 2 and out == ""
    assert err.startswith("error: ") and err.count("\n") == 1 and message in err


def test_cli_decodes_over_static_caches_and_refuses_graphs_without_cuda(run_dir):
    args = ["--prompt", "Hello", "--max_new_tokens", "12", "--temperature", "0", "--device", "cpu", "--json"]
    code, caches, err = _main(str(run_dir), *args)
    assert code == 0, err
    code, static, err = _main(str(run_dir), *args, "--decode", "static")
    assert code == 0, err
    assert [json.loads(line)["ids"] for line in static.splitlines()] == [
        json.loads(line)["ids"] for line in caches.splitlines()]
    for mode in ("graphs", "compiled"):
        code, out, err = _main(str(run_dir), *args, "--decode", mode)
        assert code == 2 and out == "" and err.count("\n") == 1
        assert err.startswith(f"error: --decode {mode} replays CUDA graphs: it needs a CUDA device")


def test_cli_names_the_checkpoint_it_loaded(run_dir):
    for given in (run_dir, run_dir / "latest.pt", run_dir / "checkpoint_step2.pt"):
        code, _, err = _main(str(given), "--prompt", "Hi", "--max_new_tokens", "2", "--device", "cpu")
        assert code == 0, err
        assert err.splitlines()[0] == f"checkpoint: {(run_dir / 'checkpoint_step2.pt').resolve()} (step 2)"


def test_cli_help_is_whole_sentences_and_covers_every_option():
    proc = subprocess.run([sys.executable, "-m", "train.generate", "--help"], cwd=REPO, capture_output=True, text=True,
                          timeout=120, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert proc.returncode == 0, proc.stderr
    flat = " ".join(proc.stdout.split())
    for paragraph in cli.__doc__.split("\n\n")[1:]:  # the whole docstring after its usage line
        assert " ".join(paragraph.split()) in flat
    assert "its newest valid checkpoint), using the checkpoint's own tokenizer" in flat
    options = proc.stdout.split("\noptions:\n")[1].split("\n\n")[0]
    entries = re.split(r"\n(?=  -)", options)
    assert len(entries) == 14  # -h and the 13 options
    for entry in entries:  # invocation, then two spaces or a new line, then the help
        assert re.fullmatch(r"  -\S+(?: [A-Z_]+)?(?:, --\S+)?(?: {2,}|\n +)\S.*", entry, re.S), f"no help: {entry!r}"


def test_cli_missing_checkpoint_exits_2(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "train.generate", str(tmp_path / "none.pt"), "--prompt", "x"],
                          cwd=REPO, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(REPO)})
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.startswith("error: ") and proc.stderr.count("\n") == 1 and "not found" in proc.stderr


# ---- samples during training -----------------------------------------------------------------------
def test_training_writes_samples_at_the_sampling_steps(tmp_path):
    out = tmp_path / "run"
    cfg = tiny_config(out, "--data.tokenizer=byte", "--train.steps=4", "--train.sample_every=2",
                      "--train.eval_every=2", "--train.sample_prompts=ab|cd", "--train.sample_tokens=8")
    assert run_training(cfg) == 0
    rows = read_jsonl(out / "samples.jsonl")
    assert [(r["step"], r["prompt"]) for r in rows] == [(2, "ab"), (2, "cd"), (4, "ab"), (4, "cd")]
    assert all(isinstance(r["text"], str) and len(r["tokens"]) <= 8 for r in rows)
    # greedy with the final weights: what generate() gives from the step-4 checkpoint
    model, _ = model_from_checkpoint(out / "latest.pt")
    for row in rows[2:]:
        assert row["tokens"] == generate(model, list(row["prompt"].encode()), 8, temperature=0.0, eos_id=256).ids[0]
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(out / "tb"), size_guidance={"tensors": 0}).Reload()
    assert {"samples/0/text_summary", "samples/1/text_summary"} <= set(events.Tags()["tensors"])
    assert [e.step for e in events.Tensors("samples/0/text_summary")] == [2, 4]


def test_resume_moves_later_samples_aside_like_the_csv_rows(tmp_path):
    """A run samples at steps 2, 4, 6 and saves at 2 and 4, then resumes from step 2: the samples of steps 4
    and 6 move to samples.jsonl.superseded (kept, not lost) and the live file has each step once."""
    out = tmp_path / "run"
    args = ["--data.tokenizer=byte", "--train.sample_every=2", "--train.sample_prompts=ab", "--train.sample_tokens=4",
            "--train.save_every=2", "--train.keep_all_checkpoints=true"]
    assert run_training(tiny_config(out, *args, "--train.steps=6")) == 0
    assert [r["step"] for r in read_jsonl(out / "samples.jsonl")] == [2, 4, 6]
    assert run_training(tiny_config(out, *args, "--train.steps=6", f"--train.resume={out / 'checkpoint_step2.pt'}")) == 0
    assert [r["step"] for r in read_jsonl(out / "samples.jsonl")] == [2, 4, 6]
    assert [r["step"] for r in read_jsonl(out / "samples.jsonl.superseded")] == [4, 6]


def test_training_refuses_prompts_that_do_not_fit(tmp_path):
    cfg = tiny_config(tmp_path / "run", "--data.tokenizer=byte", "--train.sample_every=2",
                      f"--train.sample_prompts={'x' * 60}", "--train.sample_tokens=8")
    with pytest.raises(ConfigError, match="max_seq_len=64"):
        run_training(cfg)


def test_a_distance_capped_model_samples_and_generates(tmp_path):
    """nsa.sel_distance_cap decodes with its caches (far keys read at the cap in the steps too): training samples
    and the CLI generates from its checkpoint (both were refused before); each greedy token is the best one of a full
    forward without caches. That the steps read far keys at the cap: tests/nsa/test_distance_cap.py, in float64."""
    nsa = ["--model.attention=nsa", "--nsa.l=8", "--nsa.d=4", "--nsa.l_sel=8", "--nsa.n_sel=3", "--nsa.w=8",
           "--nsa.sel_distance_cap=16", "--data.tokenizer=byte"]
    out = tmp_path / "run"
    cfg = tiny_config(out, *nsa, "--train.steps=2", "--train.sample_every=2", "--train.sample_prompts=ab",
                      "--train.sample_tokens=40")
    assert run_training(cfg) == 0
    rc, text, err = _main(str(out), "--prompt", "ab", "--max_new_tokens", "40", "--temperature", "0", "--device",
                          "cpu", "--json")
    assert rc == 0, err
    model, _ = model_from_checkpoint(out / "latest.pt")
    for tokens in (read_jsonl(out / "samples.jsonl")[0]["tokens"], json.loads(text)["ids"]):
        ids = torch.tensor([list(b"ab") + tokens])
        with torch.no_grad():
            logits = model(ids)[0, 1:-1]  # [n, V]: what one full forward (no caches) predicts for each new token
        chosen = logits.gather(1, ids[0, 2:, None])[:, 0]
        assert len(tokens) > 16  # positions beyond the cap (16)
        # greedy up to float32 near-ties between two code paths (cached steps against one forward)
        assert (chosen >= logits.max(1).values - 1e-4).all()
