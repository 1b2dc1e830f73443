"""Decoding defaults of pipelines/generate.py and TinyLM.generate's repetition penalty (CPU, tiny model).

The degenerate model below predicts the same distribution at every position, the space byte 2 nats above
the runner-up: the state of the tiny CPU profile's model after indentation (p=0.55 for a space, 0.08 for
the next byte), where greedy decoding printed "Hello NSA!" and 64 spaces. The default decoding must not
print that loop; --greedy still does."""
from __future__ import annotations

import pytest
import torch

from conftest import PIPELINES, load_entry_point
from nsa.launch.cli import UserError
from nsa.model import TinyLM

SPACE = ord(" ")
CLI = load_entry_point(PIPELINES / "generate.py")


def _cfg():
    from nsa.config import RunConfig
    cfg = RunConfig()
    cfg.model.n_layers, cfg.model.dim = 1, 32
    cfg.nsa.l, cfg.nsa.d, cfg.nsa.l_sel, cfg.nsa.n_sel, cfg.nsa.w = 16, 8, 16, 2, 32
    return cfg


def _degenerate(margin: float = 2.0, seed: int = 0) -> TinyLM:
    """Blocks that add nothing and one embedding for every byte: the logits are the same at every step,
    space `margin` above the best of the others (drawn once, in [0, 1))."""
    cfg = _cfg()
    torch.manual_seed(seed)
    m = TinyLM.from_config(cfg.model, cfg.nsa).eval()
    with torch.no_grad():
        for p in m.blocks.parameters():
            p.zero_()
        m.embed.weight.fill_(1.0)
        bias = torch.rand(m.vocab)
        bias[SPACE] = 1.0 + margin
        m.lm_head.weight.copy_(bias[:, None].expand(m.vocab, m.dim) / m.dim)   # norm(ones) = ones
    return m


def test_degenerate_state_is_a_loop_under_greedy_only():
    model, prompt = _degenerate(), torch.tensor([list(b"Hello NSA!")])
    greedy = model.generate(prompt, 64)                                 # the old default, unchanged
    assert (greedy[0, 10:] == SPACE).all()
    kw = dict(temperature=CLI.TEMPERATURE, top_k=CLI.TOP_K, repetition_penalty=CLI.PENALTY)
    out = model.generate(prompt, 64, generator=torch.Generator().manual_seed(CLI.SEED), **kw)[0, 10:]
    assert int((out == SPACE).sum()) < 32 and len(set(out.tolist())) > 8
    again = model.generate(prompt, 64, generator=torch.Generator().manual_seed(CLI.SEED), **kw)[0, 10:]
    assert torch.equal(out, again)                                      # a fixed seed: the same text


def test_repetition_penalty_is_ctrl_style_and_off_by_default():
    logits = torch.tensor([[2.0, -1.0, 1.9, 0.5]])
    seen = torch.tensor([[True, True, False, False]])
    assert int(TinyLM.sample(logits)) == 0 and int(TinyLM.sample(logits, seen=seen)) == 0
    assert int(TinyLM.sample(logits, repetition_penalty=1.1, seen=seen)) == 2     # 2.0 / 1.1 < 1.9
    # negative logits are multiplied: a penalised negative token gets less likely, not more
    neg = torch.tensor([[-0.5, -0.6]])
    assert int(TinyLM.sample(neg, repetition_penalty=1.5, seen=torch.tensor([[True, False]]))) == 1
    model = _degenerate(margin=0.05)     # space barely on top: greedy + penalty moves off it at once
    out = model.generate(torch.tensor([[65, 66]]), 4, repetition_penalty=1.2)[0, 2:].tolist()
    assert out[0] == SPACE and out[1] != SPACE and len(set(out)) == 4
    with pytest.raises(ValueError, match="repetition_penalty"):
        model.generate(torch.tensor([[65]]), 2, repetition_penalty=0.0)


def _decoding(*argv: str) -> dict:
    return CLI.decoding(CLI._parser().parse_args(["--checkpoint", "x", *argv]))


def test_cli_defaults_and_greedy():
    assert _decoding() == dict(temperature=CLI.TEMPERATURE, top_k=CLI.TOP_K, repetition_penalty=CLI.PENALTY)
    assert CLI.TEMPERATURE > 0 and CLI.PENALTY > 1
    assert _decoding("--greedy") == dict(temperature=0.0, top_k=None, repetition_penalty=1.0)
    assert _decoding("--top-k", "0", "--temperature", "0")["top_k"] is None
    text = CLI._parser().format_help()
    for flag, value in (("--temperature", CLI.TEMPERATURE), ("--top-k", CLI.TOP_K),
                        ("--repetition-penalty", CLI.PENALTY)):
        assert flag in text and f"default: {value}" in " ".join(text.split())
    assert "--greedy" in text


@pytest.mark.parametrize("argv, flag", [
    (["--temperature", "-1"], "--temperature=-1.0: must be >= 0"),
    (["--temperature", "nan"], "--temperature=nan"),
    (["--top-k", "-3"], "--top-k=-3: must be >= 1, or 0"),
    (["--repetition-penalty", "0"], "--repetition-penalty=0.0: must be > 0"),
    (["--max-new-tokens", "-1"], "--max-new-tokens=-1: must be >= 0"),
    (["--greedy", "--top-k", "5"], "--greedy: leave out --top-k"),
])
def test_cli_rejects_bad_decoding_flags(argv, flag):
    with pytest.raises(UserError) as exc:
        _decoding(*argv)
    assert str(exc.value).startswith(flag) and "\n" not in str(exc.value)


def test_cli_default_output_on_a_degenerate_checkpoint(tmp_path, capsys):
    from nsa.train.checkpoint import build_state, save_checkpoint
    from nsa.train.precision import setup_precision
    from nsa.train.schedule import build_optimizer, build_scheduler
    cfg, model = _cfg(), _degenerate()
    opt = build_optimizer(model, cfg.train)
    save_checkpoint(tmp_path / "ck", build_state(
        model=model, optimizer=opt, scheduler=build_scheduler(opt, cfg.train),
        scaler=setup_precision("fp32", torch.device("cpu")).scaler, step=3,
        data={"epoch": 0, "batches_in_epoch": 0, "samples_seen": 0}, config=cfg.to_dict()))
    assert CLI.main(["--checkpoint", str(tmp_path / "ck"), "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    assert f"decoding: sampling, temperature {CLI.TEMPERATURE}, top-k {CLI.TOP_K}" in out
    text = out.split("-" * 60 + "\n", 1)[1].rstrip("\n")
    assert text.startswith("Hello NSA!") and text.count(" ") < 42 and len(set(text[10:])) > 8
    assert CLI.main(["--checkpoint", str(tmp_path / "ck"), "--device", "cpu", "--greedy"]) == 0
    out = capsys.readouterr().out
    assert "decoding: greedy" in out and out.split("-" * 60 + "\n", 1)[1] == "Hello NSA!" + " " * 64 + "\n"
