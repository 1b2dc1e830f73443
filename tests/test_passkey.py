"""The passkey training recipe (issue 48, item 2): rows that start with whole passkey documents in the evaluation's
format (nsa/data/passkey.py; one per row, or packed with only the answers scored), the loss skipping what a packed row
does not score, the same rows after a resume, the data.passkey_* validation, the profiles, and
pipelines/configs/passkey_cpu.yaml trained a few dozen steps then evaluated into a passkey table."""
from __future__ import annotations

import json
import random
import re

import numpy as np
import pytest

from conftest import PIPELINES, load_entry_point
from evaltools import write_data
from nsa.config import ConfigError, resolve_config
from nsa.data import passkey as PK
from nsa.data import position as P
from nsa.data.tokenizers import get_tokenizer
from nsa.evaluation import core

TOK = get_tokenizer("byte")
SEQ, BATCH = 320, 4
CPU_PROFILE = str(PIPELINES / "configs" / "passkey_cpu.yaml")


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return write_data(tmp_path_factory.mktemp("passkey") / "data", docs=120)


def _epoch(data, *, rank=0, world=1, start=None, seed=7, fraction=0.5, mode="one"):
    from nsa.data.shards import check_data_path
    files = check_data_path(data)
    ep = P.rank_epoch(files, P.row_group_rows(files), epoch=0, rank=rank, world=world, seq_len=SEQ,
                      batch_size=BATCH, source=lambda units: P.iter_local_units(files, units, TOK), start=start)
    return PK.PasskeyEpoch(ep, TOK, fraction, seed, rank, mode)


def _text(ids) -> str:
    return bytes(int(i) for i in ids).decode("utf-8")


def _check_document(row: np.ndarray, original: np.ndarray) -> str:
    """A passkey row: one whole document in the evaluation's format, EOS, then the original row's own tokens.
    Returns the key."""
    end = int(np.flatnonzero(row == TOK.eos_id)[0])           # the text rows of write_data hold no EOS before it
    doc = _text(row[:end])
    assert doc.startswith(core.PREFIX) and end <= SEQ
    key = doc[len(doc) - PK.DIGITS:]
    assert re.fullmatch(r"[1-9]\d{4}", key) and doc.endswith(core.QUESTION + key)
    assert doc.count(core.NEEDLE.format(key=key)) == 1                 # planted once ...
    assert re.findall(r"\d+", doc) == [key, key, key]                  # ... (twice in its sentence), asked once
    np.testing.assert_array_equal(row[end + 1:], original[end + 1:])   # the rest of the row: text, untouched
    return key


def test_rows_start_with_whole_documents_in_the_evaluation_format(data):
    plain = list(PK.PasskeyEpoch(_epoch(data).inner, TOK, 0.0, 7, 0))   # fraction 0: the text stream itself
    mixed = list(_epoch(data))
    assert len(mixed) == len(plain) > 10
    keys, changed, lengths = [], 0, []
    for m, p in zip(mixed, plain):
        assert m.shape == p.shape == (BATCH, SEQ + 1) and m.dtype == np.int64
        for rm, rp in zip(m, p):
            if np.array_equal(rm, rp):
                assert bytes(rp[:len(core.PREFIX)].tolist()) != core.PREFIX.encode()   # text, not a document
                continue
            changed += 1
            keys.append(_check_document(rm, rp))
            lengths.append(int(np.flatnonzero(rm == TOK.eos_id)[0]))
    rows = len(mixed) * BATCH
    assert 0.3 * rows < changed < 0.7 * rows                     # about data.passkey_fraction of the rows
    assert len(set(keys)) == len(keys)                           # a fresh key per document
    assert min(lengths) >= core.passkey_overhead(TOK, PK.DIGITS) and max(lengths) <= SEQ and len(set(lengths)) > 5
    every = list(_epoch(data, fraction=1.0))
    for m, p in zip(every, plain):
        for rm, rp in zip(m, p):
            _check_document(rm, rp)


def _split_docs(stored: list[int]) -> list[tuple[str, list[int]]]:
    """A packed head (every document and its EOS) -> (decoded document, its stored ids) per document."""
    ends = [i for i, t in enumerate(stored) if t == ~TOK.eos_id]
    docs, start = [], 0
    for e in ends:
        ids = stored[start:e]
        docs.append((_text([~t if t < 0 else t for t in ids]), ids))
        start = e + 1
    assert start == len(stored)                                  # the head ends with a document's EOS
    return docs


def _check_packed(doc: str, ids: list[int]) -> None:
    key = doc[-PK.DIGITS:]
    assert doc.startswith(core.PREFIX) and doc.endswith(core.QUESTION + key) and re.fullmatch(r"[1-9]\d{4}", key)
    assert re.findall(r"\d+", doc) == [key, key, key]
    scored = [i for i, t in enumerate(ids) if t >= 0]          # the key's repeat in the needle, and the answer
    repeat = doc.index(f"Remember it. {key}") + len("Remember it. ")
    assert scored == [*range(repeat, repeat + PK.DIGITS), *range(len(ids) - PK.DIGITS, len(ids))]
    assert [ids[i] for i in scored] == list(key.encode()) * 2


def test_packed_rows_hold_several_documents_and_score_only_their_answers(data):
    lo, counts, lengths = core.passkey_overhead(TOK, PK.DIGITS), [], []
    for seed in range(6):
        stored = PK.packed_docs(TOK, 4096, random.Random(seed))
        assert stored.dtype == np.int64 and 4097 - lo < len(stored) <= 4097   # filled until no document fits
        docs = _split_docs(stored.tolist())
        for doc, ids in docs:
            _check_packed(doc, ids)
            lengths.append(len(ids))
        counts.append(len(docs))
    assert max(counts) > 1 and len(set(lengths)) > 5 and min(lengths) >= lo
    plain = list(PK.PasskeyEpoch(_epoch(data).inner, TOK, 0.0, 7, 0))
    for m, p in zip(_epoch(data, fraction=1.0, mode="packed"), plain):   # a 320-token row fits one document
        for rm, rp in zip(m, p):
            n = int(np.flatnonzero(rm == ~TOK.eos_id)[-1]) + 1
            [(doc, ids)] = _split_docs(rm[:n].tolist())
            _check_packed(doc, ids)
            np.testing.assert_array_equal(rm[n:], rp[n:])         # the text after it: untouched, scored


def test_the_loss_skips_stored_targets_and_nothing_else():
    """nsa/train/step.py: a negative entry ~id feeds id to the model and drops that target from the token mean."""
    import torch
    import torch.nn.functional as F
    from nsa.model import TinyLM
    from nsa.train.precision import setup_precision
    from nsa.train.step import lm_loss
    torch.manual_seed(0)
    model = TinyLM(vocab=256, dim=32, n_layers=1, n_heads=2, n_kv_groups=1, d_k=16, d_v=16, l=8, d=4, l_sel=8,
                   n_sel=2, w=16, attention="dense")
    prec = setup_precision("fp32", torch.device("cpu"))
    batch = torch.randint(0, 256, (2, 41))
    keep = torch.rand(2, 41) < 0.3
    stored = torch.where(keep, batch, ~batch)
    logits = model(batch[:, :-1])
    want = F.cross_entropy(logits[keep[:, 1:]], batch[:, 1:][keep[:, 1:]])
    torch.testing.assert_close(lm_loss(model, stored, prec), want, rtol=1e-6, atol=1e-6)
    plain = F.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten())
    torch.testing.assert_close(lm_loss(model, batch, prec), plain, rtol=1e-6, atol=1e-6)
    assert not torch.allclose(want, plain)


def test_context_parallel_shares_sum_to_the_loss_over_scored_targets(monkeypatch):
    """nsa/train/cp.py under CP=2 on packed-style targets: each rank's share (its shard's CE over the rows' scored
    count) sums to the single-process loss. A per-token model, so sharding cannot change a logit; only the CP
    groups' creation (a collective) is stubbed, no processes."""
    import torch
    import torch.distributed as dist
    from nsa.train.cp import ContextParallel
    from nsa.train.precision import setup_precision
    from nsa.train.step import lm_loss
    monkeypatch.setattr(dist, "new_group", lambda ranks: tuple(ranks))
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(256, 16), torch.nn.Linear(16, 256))
    prec = setup_precision("fp32", torch.device("cpu"))
    batch = torch.randint(0, 256, (2, 41))
    stored = torch.where(torch.rand(2, 41) < 0.3, batch, ~batch)
    shares = [lm_loss(model, stored, prec, ContextParallel(2, r, 2, 40, torch.device("cpu"))) for r in (0, 1)]
    torch.testing.assert_close(shares[0] + shares[1], lm_loss(model, stored, prec), rtol=1e-6, atol=1e-6)
    assert all(s > 0 for s in shares)


@pytest.mark.parametrize("mode", ["one", "packed"])
def test_same_rows_after_a_resume_and_other_rows_per_seed_and_rank(data, mode):
    for rank, world in ((0, 1), (1, 2)):
        full = list(_epoch(data, rank=rank, world=world, mode=mode))
        for k in (1, len(full) // 2):
            ep = _epoch(data, rank=rank, world=world, mode=mode)
            it = iter(ep)
            head = [next(it) for _ in range(k)]
            pos = P.DataPosition.from_state(ep.position().to_state())
            assert pos.batches_in_epoch == k
            rest = list(_epoch(data, rank=rank, world=world, start=pos, mode=mode))
            assert len(head) + len(rest) == len(full)
            for a, b in zip(head + rest, full):
                np.testing.assert_array_equal(a, b)
    base = list(_epoch(data, mode=mode))
    assert any(not np.array_equal(a, b) for a, b in zip(base, _epoch(data, seed=8, mode=mode)))
    r0, r1 = list(_epoch(data, rank=0, world=2, mode=mode)), list(_epoch(data, rank=1, world=2, mode=mode))
    assert any(not np.array_equal(a[:, :40], b[:, :40]) for a, b in zip(r0, r1))


def test_passkey_fraction_is_validated_with_one_line_naming_the_field(data, tmp_path, run_train):
    tiny = str(PIPELINES / "configs" / "tiny_cpu.yaml")
    for over, words in ((["data.passkey_fraction=1.5"], "data.passkey_fraction=1.5 must be in [0, 1]"),
                        (["data.passkey_fraction=-0.1"], "data.passkey_fraction=-0.1 must be in [0, 1]"),
                        (["data.passkey_fraction=0.5", "data.source=synthetic"], "needs data.source=parquet"),
                        (["data.passkey_mode=many"], "data.passkey_mode")):
        with pytest.raises(ConfigError, match=re.escape(words)) as e:
            resolve_config(tiny, over, env={})
        assert "\n" not in str(e.value)
    # a document longer than a row: refused before Ray starts (run_train fails the test if Ray is reached)
    code, err, _ = run_train("--config", CPU_PROFILE, f"data.path={data}", f"logging.root={tmp_path}", "train.seq_len=200")
    lines = [ln for ln in err.splitlines() if "train.seq_len=200" in ln]
    assert code == 2 and len(lines) == 1 and "shorter than a passkey document (249 tokens" in lines[0], err
    from nsa.launch.preflight import check_passkey
    cfg, _ = resolve_config(tiny, ["train.seq_len=200"], env={})     # off (the default): no constraint
    assert cfg.data.passkey_fraction == 0.0 and check_passkey(cfg) is None
    cfg, src = resolve_config(str(PIPELINES / "configs" / "passkey.yaml"), env={})
    assert (cfg.train.seq_len, cfg.model.dim, cfg.model.n_layers, cfg.model.attention) == (8192, 768, 12, "nsa")
    assert cfg.data.passkey_fraction == 1.0 and cfg.runtime.use_gpu and src["data.passkey_fraction"].startswith("yaml")
    assert cfg.data.passkey_mode == "packed" and src["data.passkey_mode"].startswith("yaml")
    dense, _ = resolve_config(str(PIPELINES / "configs" / "passkey.yaml"), ["model.attention=dense"], env={})
    assert dense.model.attention == "dense" and dense.data == cfg.data and dense.train == cfg.train


def test_passkey_cpu_profile_trains_then_evaluates_into_a_passkey_table(data, tmp_path, monkeypatch):
    """pipelines/configs/passkey_cpu.yaml cut to a few dozen steps on the loop without Ray (conftest.run_local),
    every row it trained on a passkey row (the profile's fraction 1.0; 0.75 mixes text rows in), then
    pipelines/evaluate.py on its checkpoint: the JSON's passkey table covers every (length, depth)."""
    from conftest import run_local
    seen, mix = [], PK.mix_rows

    def spy(*args, **kw):
        out = mix(*args, **kw)
        seen.extend(bytes(np.where(r < 0, ~r, r)[:len(core.PREFIX)].tolist()) == core.PREFIX.encode() for r in out)
        return out
    monkeypatch.setattr(PK, "mix_rows", spy)
    cfg, _ = resolve_config(CPU_PROFILE, [f"data.path={data}", f"logging.root={tmp_path / 'runs'}", "logging.name=pk",
                                          "logging.mlflow=false", "logging.csv=false", "train.steps=24",
                                          "train.batch_size=2"], env={})
    assert cfg.data.passkey_fraction == 1.0 and cfg.data.passkey_mode == "packed"
    result, run_dir = run_local(cfg)
    assert result["status"] == "completed" and result["step"] == cfg.train.steps, result
    assert len(seen) >= cfg.train.steps * cfg.train.batch_size and all(seen)
    cli = load_entry_point(PIPELINES / "evaluate.py")
    assert cli.main(["--checkpoint", run_dir, "--lengths", "320", "--max-tokens", "640", "--passkey-lengths", "256",
                     "320", "--depths", "0", "1", "--trials", "2", "--device", "cpu", "--no-mlflow"]) == 0
    res = json.loads((tmp_path / "runs" / "pk" / "eval" / f"eval_step_{cfg.train.steps:08d}.json").read_text())
    pk = res["passkey"]
    assert {(c["length"], c["depth"]) for c in pk["cells"]} == {(n, d) for n in (256, 320) for d in (0.0, 1.0)}
    assert all(c["trials"] == 2 and 0 <= c["accuracy"] <= 1 for c in pk["cells"])
    assert pk["table"].splitlines()[0] == "| depth \\ length | 256 | 320 |" and "| mean |" in pk["table"]
    assert res["step"] == cfg.train.steps and res["attention"] == "nsa"


def test_gpu_passkey_subcommand_resolves_both_configs_on_cpu(tmp_path):
    """DRY_RUN=1 bash bench/gpu.sh passkey: the NSA and dense-twin configs it would train resolve (the profile with
    model.attention and the run name from the command line), and the evaluation it would run is printed."""
    import os
    import subprocess
    from conftest import REPO
    env = dict(os.environ, DRY_RUN="1", OUT=str(tmp_path), PYTHONPATH=str(REPO))
    out = subprocess.run(["bash", str(REPO / "bench" / "gpu.sh"), "passkey"], capture_output=True, text=True, cwd=REPO,
                         env=env, timeout=300)
    log = (tmp_path / "passkey.log").read_text()
    assert out.returncode == 0 and "passkey rc=0" in log, log[-3000:]
    heads = [ln for ln in log.splitlines() if ln.startswith("== train: resolved config (profile pipelines/configs/"
                                                            "passkey.yaml)")]
    attention = re.findall(r"model\.attention\s+= '(\w+)'\s+\[cli\]", log)
    fraction = re.findall(r"data\.passkey_fraction\s+= ([\d.]+)\s+\[yaml:pipelines/configs/passkey\.yaml\]", log)
    assert len(heads) == 2 and attention == ["nsa", "dense"] and len(fraction) == 2 and float(fraction[0]) > 0, log
    assert re.findall(r"^evaluate (\w+): .*--passkey-lengths 4096 8192 16384 32768", log, re.M) == ["nsa", "dense"]
