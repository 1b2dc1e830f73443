"""pipelines/export.py and nsa.hf: a checkpoint in the pipeline's format (trained a few steps with the library,
saved with the checkpoint helpers) exported to a Hugging Face directory and loaded through transformers'
Auto classes gives TinyLM's logits, TinyLM.generate's greedy tokens (through the NSA decode caches), and
the project's byte-tokenizer ids; NSA and the dense twin alike. Skipped without transformers (.[hf])."""
from __future__ import annotations

import json

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("safetensors")

from conftest import PIPELINES, load_entry_point  # noqa: E402
from nsa.config import RunConfig  # noqa: E402
from nsa.data.tokenizers import ByteTokenizer  # noqa: E402
from nsa.launch.cli import guarded  # noqa: E402
from nsa.model import TinyLM  # noqa: E402
from nsa.train.checkpoint import build_state, save_checkpoint  # noqa: E402

import nsa.hf  # noqa: E402,F401  (registers the Auto classes)
from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402

CLI = load_entry_point(PIPELINES / "export.py")
PROMPTS = [list(b"Hello NSA! klm"), list(b"def f(x): ret")[:14] + [0xC3]]   # equal lengths, one non-ASCII byte
NEW = 24   # prompt 14 + 24 tokens: past the window (w=16) and through three compression blocks (l=16, d=8)


def _train_checkpoint(root, attention: str):
    """A 2-layer model trained 3 AdamW steps, saved as the pipeline saves it: (run dir, model)."""
    cfg = RunConfig()
    cfg.model.n_layers, cfg.model.dim, cfg.model.attention = 2, 32, attention
    cfg.nsa.l, cfg.nsa.d, cfg.nsa.l_sel, cfg.nsa.n_sel, cfg.nsa.w = 16, 8, 16, 2, 16
    torch.manual_seed(0)
    model = TinyLM.from_config(cfg.model, cfg.nsa)
    # a wide init: greedy decoding then walks many different bytes (the default init's first steps
    # emit one byte over and over, which would let a wrong cache pass the comparison)
    model.reset_parameters(init_std=0.3)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    data = torch.randint(0, 256, (2, 33))
    for _ in range(3):
        loss = torch.nn.functional.cross_entropy(model(data[:, :-1]).flatten(0, 1), data[:, 1:].flatten())
        opt.zero_grad()
        loss.backward()
        opt.step()
    state = build_state(model=model, optimizer=opt, scheduler=torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0),
                        scaler=torch.amp.GradScaler("cpu", enabled=False), step=3,
                        data={"epoch": 0, "batches_in_epoch": 3, "samples_seen": 6}, config=cfg.to_dict())
    run = root / f"run_{attention}"
    save_checkpoint(run / "checkpoint_00000003", state)
    return run, model.eval()


@pytest.fixture(scope="module", params=["nsa", "dense"])
def exported(request, tmp_path_factory):
    """(TinyLM, HF model loaded through AutoModelForCausalLM, export dir) per attention kind."""
    root = tmp_path_factory.mktemp(f"hf_{request.param}")
    run, model = _train_checkpoint(root, request.param)
    out = root / "export"
    assert CLI.main(["--checkpoint", str(run), "--out", str(out)]) == 0
    hf = AutoModelForCausalLM.from_pretrained(out).eval()
    return model, hf, out


def test_export_layout_and_config(exported):
    model, hf, out = exported
    assert {"config.json", "model.safetensors", "tokenizer_config.json"} <= {p.name for p in out.iterdir()}
    assert not [p for p in out.parent.iterdir() if p.name.startswith(".export")]   # no temp dir left
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["model_type"] == "nsa_tinylm" and cfg["architectures"] == ["NSAForCausalLM"]
    assert cfg["attention"] == model.attention and cfg["n_layers"] == 2 and cfg["vocab_size"] == 256
    assert type(hf).__name__ == "NSAForCausalLM" and hf.model.attention == model.attention
    assert hf.config.hidden_size == 32 and hf.config.num_hidden_layers == 2
    for name, p in model.state_dict().items():
        assert torch.equal(hf.model.state_dict()[name], p), name


def test_logits_equal_tinylm(exported):
    model, hf, _ = exported
    ids = torch.tensor(PROMPTS)
    with torch.no_grad():
        want = model(ids)
        got = hf(ids).logits
        cached = hf(ids, use_cache=True)                      # the prefill path generate() takes
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(cached.logits, want, rtol=1e-5, atol=1e-5)
    cache = cached.cache if hasattr(cached, "cache") else cached.past_key_values   # transformers 5 vs 4 name
    assert type(cache) is nsa.hf.NSACache and cache.get_seq_length() == ids.shape[1]
    # labels: the next-token loss training computes
    with torch.no_grad():
        loss = hf(ids, labels=ids).loss
    ref = torch.nn.functional.cross_entropy(want[:, :-1].flatten(0, 1), ids[:, 1:].flatten())
    torch.testing.assert_close(loss, ref)


def test_generate_greedy_equals_tinylm_through_the_cache(exported, monkeypatch):
    model, hf, _ = exported
    ids = torch.tensor(PROMPTS)
    want = model.generate(ids, NEW, cuda_graph=False, eos_id=0)
    steps = []
    real = TinyLM.decode_step
    monkeypatch.setattr(TinyLM, "decode_step", lambda self, x, caches: steps.append(x.shape) or real(self, x, caches))
    got = hf.generate(ids, max_new_tokens=NEW, do_sample=False)
    n = got.shape[1]
    # HF stops once every row emitted eos (id 0); TinyLM pads with eos to the requested length
    assert torch.equal(got, want[:, :n]) and bool((want[:, n:] == 0).all())
    assert len(set(got[:, ids.shape[1]:].flatten().tolist())) > 8          # a real walk, not one byte
    assert steps and all(s == (2, 1) for s in steps) and len(steps) == n - ids.shape[1] - 1   # cached decode


def test_tokenizer_ids_equal_the_projects(exported):
    _, _, out = exported
    tok = AutoTokenizer.from_pretrained(out)
    assert type(tok).__name__ == "NSAByteTokenizer" and tok.eos_token_id == 0 and len(tok) == 256
    text = "def f(x):\n\treturn 'héllo' + \u2603\x00 <0x00> <|endoftext|>"
    want = ByteTokenizer().encode(text)
    assert tok(text)["input_ids"] == want and tok.encode(text) == want
    assert tok.decode(want) == ByteTokenizer().decode(want)
    assert tok.decode([0xE2, 0x98]) == ByteTokenizer().decode([0xE2, 0x98])   # a cut UTF-8 sequence: U+FFFD


def test_cli_errors_are_one_line_and_overwrite_only_when_asked(exported, tmp_path, capsys):
    _, _, out = exported
    run = out.parent / next(p.name for p in out.parent.iterdir() if p.name.startswith("run_"))

    def cli(*argv: str) -> tuple[int, str]:
        with pytest.raises(SystemExit) as exc:
            guarded(lambda: CLI.main(list(argv)))()
        return exc.value.code, capsys.readouterr().err.strip()

    code, err = cli("--checkpoint", str(tmp_path / "nope"), "--out", str(tmp_path / "o"))
    assert code == 2 and err.startswith("error: ") and "does not exist" in err and "\n" not in err
    assert not (tmp_path / "o").exists()
    busy = tmp_path / "busy"
    busy.mkdir()
    (busy / "keep.txt").write_text("mine")
    code, err = cli("--checkpoint", str(run), "--out", str(busy))
    assert code == 2 and "not empty" in err and "--overwrite" in err and "\n" not in err
    assert [p.name for p in busy.iterdir()] == ["keep.txt"]
    # a failing export with --overwrite leaves the old directory as it was
    bad = tmp_path / "bad"
    (bad / "checkpoint_00000001").mkdir(parents=True)
    (bad / "checkpoint_00000001" / "checkpoint.pt").write_bytes(b"not a checkpoint")
    (bad / "checkpoint_00000001" / "meta.json").write_text('{"step": 1}')
    code, err = cli("--checkpoint", str(bad), "--out", str(busy), "--overwrite")
    assert code == 2 and "corrupt" in err and (busy / "keep.txt").read_text() == "mine"
    assert CLI.main(["--checkpoint", str(run), "--out", str(busy), "--overwrite"]) == 0
    assert not (busy / "keep.txt").exists() and (busy / "model.safetensors").is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad", "busy"]      # no temp or set-aside dirs


def test_unsupported_inputs_say_so(exported):
    _, hf, _ = exported
    ids = torch.tensor(PROMPTS)
    with pytest.raises(ValueError, match="padded batches"):
        hf(ids, attention_mask=torch.tensor([[0] + [1] * 13, [1] * 14]))
    with pytest.raises(ValueError, match="inputs_embeds"):
        hf(inputs_embeds=torch.zeros(1, 2, 32))
