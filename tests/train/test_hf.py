"""Hugging Face export / import (train/hf/convert.py, train/hf/export.py, train/hf/importer.py) and
train.init_from: transformers computes what our model computes, round trips are bitwise, refusals
are one line. Tiny models on CPU; transformers models are built from configs only (no network)."""
from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from nsa.config import ModelConfig, NSAConfig
from nsa.model import Transformer
from tests.train.helpers import TINY_MODEL, read_csv, tiny_config
from train.checkpoint.io import FORMAT_VERSION, atomic_save, model_from_checkpoint, rng_state
from train.core.config import RunConfig
from train.core.data_config import DataConfig
from train.core.errors import CheckpointError, ConfigError, ConversionError
from train.hf.export import export
from train.export_hf import main as export_main
from train.hf.convert import family, from_hf_config, to_hf_config
from train.hf.importer import import_checkpoint, init_state_dict, read_model_dir
from train.trainer.runner import run_training

REPO = Path(__file__).resolve().parents[2]
BASE = tiny_config(Path("unused")).model  # vocab 320, dim 32, 2 layers, 4 heads, 2 KV heads, ffn 64: LLaMA style
GPT2_STYLE = dict(norm="layernorm", mlp="gelu", pos_emb="learned", n_kv_heads=4)
FAMILIES = {  # name -> (our config, expected transformers class)
    "gpt2_nobias_untied": (dataclasses.replace(BASE, **GPT2_STYLE, bias=False, tie_embeddings=False), "GPT2LMHeadModel"),
    "llama_gqa_untied": (BASE, "LlamaForCausalLM"),
    "llama_bias_rope_scale_2": (dataclasses.replace(BASE, bias=True, rope_scale=2.0, rope_theta=5e5, head_dim=16),
                                "LlamaForCausalLM"),
    "qwen3_qknorm_gqa_tied": (dataclasses.replace(BASE, qk_norm=True, norm_eps=1e-6, tie_embeddings=True), "Qwen3ForCausalLM"),
}
TINY_NSA = dataclasses.replace(BASE, attention="nsa", nsa=NSAConfig(l=8, d=4, l_sel=16, n_sel=3, w=16))


def randomized(cfg: ModelConfig, seed: int = 0) -> Transformer:
    """Every parameter random (biases and norm gains too, so a mis-mapped one shows), spread logits."""
    torch.manual_seed(seed)
    model = Transformer(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(torch.randn_like(p) * 0.3 + (1.0 if "norm" in name and name.endswith("weight") else 0.0))
    return model


def save_checkpoint(path: Path, model: Transformer, tokenizer: str = "byte") -> Path:
    """A checkpoint in our format, as the trainer writes it (optimizer state is not read by export)."""
    config = RunConfig(model=model.cfg, data=DataConfig(tokenizer=tokenizer)).to_dict()
    atomic_save({"format_version": FORMAT_VERSION, "step": 7, "model": model.state_dict(), "optimizer": {},
                 "rng": rng_state(), "config": config, "tokens_seen": 1234}, path)
    return path


def load_hf(out: Path):
    from transformers import AutoModelForCausalLM

    hf, info = AutoModelForCausalLM.from_pretrained(out, local_files_only=True, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    return hf.eval()


@torch.no_grad()
def greedy(model: Transformer, ids: torch.Tensor, n: int) -> torch.Tensor:
    """Argmax decoding by recomputing the full sequence each step (no caches)."""
    for _ in range(n):
        ids = torch.cat([ids, model(ids)[:, -1].argmax(-1, keepdim=True)], dim=1)
    return ids


def assert_same_function(ours: Transformer, hf, eos_id: int) -> None:
    ids = torch.randint(0, ours.cfg.vocab_size, (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(hf(ids).logits, ours(ids), atol=1e-4, rtol=0)
        prompt = ids[:1, :6]
        theirs = hf.generate(prompt, attention_mask=torch.ones_like(prompt), do_sample=False, max_new_tokens=8)
    mine = greedy(ours, prompt, 8)
    assert torch.equal(theirs, mine[:, :theirs.shape[1]])  # HF stops early only at EOS
    assert theirs.shape[1] == mine.shape[1] or theirs[0, -1] == eos_id


def assert_same_state(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), k


def one_error_line(stderr: str) -> str:
    lines = stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), stderr
    return lines[0]


def run_cli(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, cwd=REPO, env=env, timeout=120)


# ---- per family: same logits, same greedy tokens, bitwise round trip ---------------------------
@pytest.mark.parametrize("name", FAMILIES)
def test_export_matches_transformers_and_round_trips(tmp_path, name):
    cfg, architecture = FAMILIES[name]
    model = randomized(cfg)
    out = tmp_path / "hf"
    assert export(save_checkpoint(tmp_path / "ckpt.pt", model), out) == family(cfg)
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == [architecture] and config["torch_dtype"] == "float32"
    assert json.loads((out / "generation_config.json").read_text())["eos_token_id"] == 256  # byte tokenizer
    if cfg.tie_embeddings:
        assert "lm_head.weight" not in load_file(out / "model.safetensors")
    assert_same_function(model, load_hf(out), eos_id=256)
    back_cfg, back_state, _ = read_model_dir(out)
    assert back_cfg == cfg
    assert_same_state(back_state, model.state_dict())


def test_gpt2_without_bias_exports_exact_zero_biases(tmp_path):
    cfg, _ = FAMILIES["gpt2_nobias_untied"]
    export(save_checkpoint(tmp_path / "ckpt.pt", randomized(cfg)), tmp_path / "hf")
    tensors = load_file(tmp_path / "hf" / "model.safetensors")
    biases = [k for k in tensors if k.endswith(".bias")]
    assert len(biases) == 6 * cfg.n_layers + 1 and not any(tensors[k].any() for k in biases)


@pytest.fixture(scope="module")
def gpt2_run(tmp_path_factory):
    """A real (tiny) GPT-2 style training run: biases, tied embeddings, the gpt2 tokenizer."""
    out = tmp_path_factory.mktemp("gpt2_run")
    cfg = tiny_config(out, "--train.steps=4", "--train.eval_every=2", "--model.norm=layernorm", "--model.mlp=gelu",
                      "--model.pos_emb=learned", "--model.bias=true", "--model.tie_embeddings=true",
                      "--model.n_kv_heads=4", "--model.init_std=0.3")
    assert run_training(cfg) == 0
    return out


def test_trained_gpt2_run_exports_with_tokenizer_and_card(tmp_path, gpt2_run):
    from transformers import AutoTokenizer

    from train.data.tokenizers import load_tokenizer

    out = tmp_path / "hf"
    assert export_main([str(gpt2_run), str(out)]) == 0  # a run directory: its newest checkpoint
    model, _ = model_from_checkpoint(gpt2_run)
    assert model.cfg.bias and model.cfg.tie_embeddings
    hf = load_hf(out)
    assert type(hf).__name__ == "GPT2LMHeadModel"
    assert_same_function(model, hf, eos_id=50256)
    back_cfg, back_state, _ = read_model_dir(out)
    assert back_cfg == model.cfg
    assert_same_state(back_state, model.state_dict())

    tok = AutoTokenizer.from_pretrained(out, local_files_only=True)
    text = "Hello world, it's a test:\n\n  12345 tokens, naïve café 日本語 -- done."
    assert tok(text)["input_ids"] == load_tokenizer("gpt2").encode_batch([text])[0]
    assert tok.eos_token_id == 50256

    card = (out / "README.md").read_text()
    last_train, last_val = read_csv(gpt2_run / "training.csv")[-1], read_csv(gpt2_run / "val.csv")[-1]
    assert "GPT2LMHeadModel" in card and "step 4, 512 tokens" in card
    assert f"Final train loss: {float(last_train['loss']):.4f} (step 4" in card
    assert f"Final validation loss: {float(last_val['val_loss']):.4f} (step 4" in card
    assert f"Parameters: {model.num_params():,}" in card and "vocab_size: 320" in card


# ---- transformers -> ours --------------------------------------------------------------------
def _hf_models():
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

    small = dict(vocab_size=320, bos_token_id=0, eos_token_id=0)
    rope = dict(small, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=64)
    return {
        "gpt2": lambda: GPT2LMHeadModel(GPT2Config(**small, n_embd=32, n_layer=2, n_head=4, n_positions=64)),
        "llama": lambda: LlamaForCausalLM(LlamaConfig(**rope, rope_theta=5e5, rope_scaling={"rope_type": "linear", "factor": 4.0})),
        "qwen3": lambda: Qwen3ForCausalLM(Qwen3Config(**rope, head_dim=16, tie_word_embeddings=True)),
    }


@pytest.mark.parametrize("kind", ["gpt2", "llama", "qwen3"])
def test_import_of_a_transformers_model_computes_its_logits(tmp_path, kind):
    torch.manual_seed(0)
    hf = _hf_models()[kind]().eval()
    with torch.no_grad():
        for p in hf.parameters():  # random biases and norm gains, not transformers' zeros and ones
            p.add_(torch.randn_like(p) * 0.1)
    hf.save_pretrained(tmp_path / "hf")
    ckpt = tmp_path / "imported.pt"
    import_checkpoint(tmp_path / "hf", ckpt)
    ours, _ = model_from_checkpoint(ckpt)
    assert ours.cfg.bias == (kind == "gpt2") and ours.cfg.rope_scale == (4.0 if kind == "llama" else 1.0)
    ids = torch.randint(0, 320, (2, 20))
    with torch.no_grad():
        torch.testing.assert_close(ours(ids), hf(ids).logits, atol=1e-4, rtol=0)
    with pytest.raises(CheckpointError, match="never overwrites"):
        import_checkpoint(tmp_path / "hf", ckpt)


def test_bf16_export(tmp_path):
    model = randomized(BASE)
    export(save_checkpoint(tmp_path / "ckpt.pt", model), tmp_path / "hf", dtype="bf16")
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["torch_dtype"] == "bfloat16"
    assert {t.dtype for t in load_file(tmp_path / "hf" / "model.safetensors").values()} == {torch.bfloat16}
    _, state, _ = read_model_dir(tmp_path / "hf")
    assert_same_state(state, {k: v.bfloat16().float() for k, v in model.state_dict().items()})


# ---- NSA and refusals ------------------------------------------------------------------------
@pytest.mark.parametrize("selector", ["pooled", "indexer"])
def test_nsa_exports_safetensors_and_our_config_only(tmp_path, selector):
    cfg = dataclasses.replace(TINY_NSA, nsa=dataclasses.replace(TINY_NSA.nsa, selector=selector))
    model = randomized(cfg)
    out = tmp_path / "nsa"
    assert export(save_checkpoint(tmp_path / "ckpt.pt", model), out) == "nsa"
    assert sorted(p.name for p in out.iterdir()) == ["README.md", "model.safetensors", "nsa_config.json"]
    assert "NSA checkpoints export to safetensors + our own config only" in (out / "README.md").read_text()
    with pytest.raises(ConversionError, match="NSA checkpoints export to safetensors"):
        to_hf_config(TINY_NSA, "float32", {})
    ckpt = tmp_path / "back.pt"
    import_checkpoint(out, ckpt)
    back, config = model_from_checkpoint(ckpt)
    assert back.cfg == cfg and config["model"]["attention"] == "nsa"
    assert_same_state(back.state_dict(), model.state_dict())
    assert any(".indexer." in name for name in back.state_dict()) == (selector == "indexer")


@pytest.mark.parametrize("overrides, reason", [
    (dict(norm="layernorm"), "need norm=rmsnorm and mlp=swiglu"),  # RoPE + LayerNorm
    (dict(mlp="gelu"), "need norm=rmsnorm and mlp=swiglu"),  # RoPE + GELU
    (dict(pos_emb="learned"), "needs norm=layernorm and mlp=gelu"),  # learned positions + RMSNorm/SwiGLU
    (dict(GPT2_STYLE, n_kv_heads=2), "no grouped-query attention"),
    (dict(GPT2_STYLE, head_dim=16), "head_dim = dim / n_heads"),
    (dict(GPT2_STYLE, rope_scale=2.0), "learned-position model"),
    (dict(qk_norm=True, bias=True), "Qwen3 has no MLP biases"),
])
def test_unsupported_models_refuse_with_a_reason(overrides, reason):
    with pytest.raises(ConversionError, match=reason):
        family(dataclasses.replace(BASE, **overrides))


def test_a_yarn_model_refuses_export_with_a_reason():
    """transformers' YaRN ramps over whole dimensions (floor / ceil of the correction range), ours over rotations:
    not the same model, so no config claims it is."""
    with pytest.raises(ConversionError, match="has no exact transformers equivalent"):
        to_hf_config(dataclasses.replace(BASE, rope_scale=2.0, rope_scaling="yarn"), "float32", {})


def test_refused_export_writes_nothing(tmp_path, capsys):
    ckpt = save_checkpoint(tmp_path / "ckpt.pt", randomized(dataclasses.replace(BASE, norm="layernorm")))
    assert export_main([str(ckpt), str(tmp_path / "out")]) == 2
    assert "norm=layernorm" in one_error_line(capsys.readouterr().err)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt.pt"]


LLAMA_HF = {"model_type": "llama", "vocab_size": 320, "hidden_size": 32, "num_hidden_layers": 2,
            "num_attention_heads": 4, "intermediate_size": 64}


@pytest.mark.parametrize("changes, reason", [
    ({"model_type": "mistral"}, "model_type 'mistral' is not supported"),
    ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, "rope type 'llama3'"),
    ({"rope_parameters": {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e4}}, "rope type 'dynamic'"),
    ({"attention_bias": True, "mlp_bias": False}, "attention_bias=True differs from mlp_bias"),
    ({"hidden_act": "gelu"}, "only silu"),
    ({"model_type": "qwen3", "attention_bias": True}, "qwen3 attention_bias=true"),
    ({"hidden_size": None}, "lacks hidden_size"),
])
def test_import_refuses_configs_we_cannot_represent(changes, reason):
    with pytest.raises(ConversionError, match=reason):
        from_hf_config(LLAMA_HF | changes)


def test_import_reads_transformers_4_rope_keys():
    cfg = from_hf_config(LLAMA_HF | {"rope_theta": 5e5, "rope_scaling": {"type": "linear", "factor": 2.0}})
    assert (cfg.rope_theta, cfg.rope_scale, cfg.head_dim, cfg.n_kv_heads) == (5e5, 2.0, 8, 4)


def test_import_cli_refuses_unknown_model_type(tmp_path):
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "config.json").write_text(json.dumps(LLAMA_HF | {"model_type": "bert"}))
    proc = run_cli("-m", "train.import_hf", str(tmp_path / "hf"), str(tmp_path / "out.pt"))
    assert proc.returncode == 2
    assert "model_type 'bert' is not supported" in one_error_line(proc.stderr)
    assert not (tmp_path / "out.pt").exists()


# ---- OUT_DIR safety --------------------------------------------------------------------------
def test_export_cli_refuses_a_non_empty_out_dir(tmp_path):
    ckpt = save_checkpoint(tmp_path / "ckpt.pt", randomized(BASE))
    out = tmp_path / "out"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    proc = run_cli("-m", "train.export_hf", str(ckpt), str(out))
    assert proc.returncode == 2 and "--overwrite" in one_error_line(proc.stderr)
    assert [p.name for p in out.iterdir()] == ["notes.txt"] and (out / "notes.txt").read_text() == "mine"
    with pytest.raises(ConversionError, match="not a previous export"):  # --overwrite replaces exports only
        export(ckpt, out, overwrite=True)
    (out / "notes.txt").unlink()
    export(ckpt, out)
    export(ckpt, out, overwrite=True)  # a previous export is replaced
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt.pt", "out"]  # no temporary directories left


@pytest.mark.parametrize("umask", [0o022, 0o027])
def test_export_cli_writes_every_file_with_the_umask_mode(tmp_path, umask):
    """model.safetensors too (safetensors itself writes a private 0600 file): 0644 under umask 022."""
    ckpt = save_checkpoint(tmp_path / "ckpt.pt", randomized(BASE))
    proc = subprocess.run([sys.executable, "-m", "train.export_hf", str(ckpt), str(tmp_path / "out")], cwd=REPO,
                          env={**os.environ, "PYTHONPATH": str(REPO)}, capture_output=True, text=True, timeout=120,
                          umask=umask)
    assert proc.returncode == 0, proc.stderr
    modes = {p.name: oct(p.stat().st_mode & 0o777) for p in (tmp_path / "out").iterdir()}
    assert "model.safetensors" in modes and set(modes.values()) == {oct(0o666 & ~umask)}, modes


# ---- train.init_from -------------------------------------------------------------------------
@pytest.fixture(scope="module")
def llama_export(tmp_path_factory):
    """The run's own architecture (tiny_config's model), random weights, exported to HF."""
    where = tmp_path_factory.mktemp("llama_export")
    export(save_checkpoint(where / "ckpt.pt", randomized(BASE, seed=3)), where / "hf")
    return where / "hf"


def test_init_from_hf_starts_from_those_weights(tmp_path, llama_export, capsys):
    from train.data import build_data

    cfg = tiny_config(tmp_path / "run", f"--train.init_from=hf:{llama_export}", "--train.steps=1",
                      "--train.eval_every=1", "--train.eval_at_start=true")
    assert run_training(cfg) == 0
    assert f"init: weights from hf:{llama_export}" in capsys.readouterr().out
    step0 = [r for r in read_csv(tmp_path / "run" / "val.csv") if r["step"] == "0"][0]
    # the same held-out batches through the transformers model
    hf = load_hf(llama_export)
    data = build_data(cfg.data, seq_len=cfg.train.seq_len, batch_size=cfg.train.batch_size,
                      vocab_size=cfg.model.vocab_size, seed=cfg.train.seed)
    with torch.no_grad():
        losses = [torch.nn.functional.cross_entropy(hf(x).logits.flatten(0, 1), y.flatten())
                  for x, y in data.val_batches(cfg.train.eval_steps)]
    data.close()
    assert float(step0["val_loss"]) == pytest.approx(float(torch.stack(losses).mean()), abs=1e-4)

    # a resumed run keeps its checkpoint's weights and says init_from is ignored
    assert run_training(tiny_config(tmp_path / "run", f"--train.init_from=hf:{llama_export}", "--train.steps=2")) == 0
    assert f"note: train.init_from=hf:{llama_export} ignored: resuming from" in capsys.readouterr().out


def test_init_from_checks_the_architecture(tmp_path, llama_export):
    with pytest.raises(ConfigError, match=r"n_layers: 2 in the source vs 3 in the run; ffn_dim: 64 in the source vs 96"):
        init_state_dict(f"hf:{llama_export}", dataclasses.replace(BASE, n_layers=3, ffn_dim=96))
    state = init_state_dict(f"hf:{llama_export}", dataclasses.replace(BASE, rope_scale=4.0, max_seq_len=256))
    assert state.keys() == Transformer(BASE).state_dict().keys()  # context extension may start from these
    proc = run_cli("-m", "train", *TINY_MODEL, "--model.n_layers=3", f"--train.out_dir={tmp_path / 'run'}",
                   "--runtime.device=cpu", f"--train.init_from=hf:{llama_export}")
    assert proc.returncode == 2 and "n_layers: 2 in the source vs 3 in the run" in one_error_line(proc.stderr)


def test_imported_checkpoint_starts_runs_but_is_not_resumed(tmp_path, llama_export):
    ckpt = tmp_path / "imported.pt"
    import_checkpoint(llama_export, ckpt)
    assert_same_state(init_state_dict(str(ckpt), BASE), randomized(BASE, seed=3).state_dict())
    with pytest.raises(CheckpointError, match="imported weights only.*train.init_from"):
        run_training(tiny_config(tmp_path / "run", f"--train.resume={ckpt}"))
