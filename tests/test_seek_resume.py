"""Resume seeks to the checkpoint's data position (shard, row group, offset, packing carry) per rank
instead of re-reading and re-tokenizing every consumed batch (nsa/data/position.py)."""
from __future__ import annotations

import csv
import json
import os

import numpy as np
import pytest

from conftest import local_cfg, run_local
from nsa.data import position as P
from nsa.data.tokenizers import get_tokenizer

SEQ, BATCH = 64, 8


@pytest.fixture(scope="module")
def small_rg_data(tmp_path_factory):
    """Two train shards of short real documents in row groups of 3 docs (plus a val shard): a run of a
    few steps crosses many row groups, so re-reading them would show in the read counter."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    from nsa.data.local_corpus import iter_local_corpus
    out = tmp_path_factory.mktemp("seek") / "data"
    out.mkdir()
    texts = [d["text"][:300 + 37 * (i % 11)] for i, d in enumerate(iter_local_corpus(max_docs=120, shuffle_seed=0))]
    texts[5] = None                                          # a null text is skipped, as in FineWeb
    for name, part in (("train-00000-of-00002", texts[:50]), ("train-00001-of-00002", texts[50:110]),
                       ("val-00000", texts[110:])):
        pq.write_table(pa.table({"text": pa.array(part, pa.string())}), out / f"{name}.parquet", row_group_size=3)
    return out


def _files(d):
    from nsa.data.shards import check_data_path
    return check_data_path(d)


def _epoch(files, rg, rank=0, world=1, start=None, epoch=0, seed=None):
    tok = get_tokenizer("byte")
    return P.rank_epoch(files, rg, epoch=epoch, rank=rank, world=world, seq_len=SEQ, batch_size=BATCH,
                        source=lambda units: P.iter_local_units(files, units, tok), shuffle_seed=seed, start=start)


@pytest.mark.parametrize("world", [1, 2])
def test_seek_continues_with_the_same_batches_and_reads_only_what_is_left(small_rg_data, world):
    files = _files(small_rg_data)
    rg = P.row_group_rows(files)
    for rank in range(world):
        full = list(_epoch(files, rg, rank, world, seed=3))           # one uninterrupted epoch
        assert len(full) > 6
        for k in (1, 3, len(full) - 2):                              # stop after batch k, resume there
            ep = _epoch(files, rg, rank, world, seed=3)
            it = iter(ep)
            head = [next(it) for _ in range(k)]
            pos = ep.position()
            assert pos.batches_in_epoch == k and pos.carry.size < 1000          # at most one short document
            before = dict(P.READ_COUNTER)
            rest = list(_epoch(files, rg, rank, world, seed=3, start=P.DataPosition.from_state(pos.to_state())))
            read = P.READ_COUNTER["docs"] - before["docs"]
            assert len(head) + len(rest) == len(full)
            for a, b in zip(head + rest, full):
                np.testing.assert_array_equal(a, b)
            # docs the remaining batches need (counted from the uninterrupted epoch) + at most one row group
            need = _docs_needed(files, rg, rank, world, pos)
            assert read <= need + 3, (read, need)


def _docs_needed(files, rg, rank, world, pos):
    """Docs of this rank's epoch from the recorded offset on (what any reader must read to finish it)."""
    units = P.seek_units(P.plan_units(rg, 0, rank, world, 3), pos, files)
    return sum(u.hi - u.lo for u in units)


def test_fast_forward_would_read_everything(small_rg_data):
    """The counter sees the difference: reading from the start reads the consumed documents too."""
    files = _files(small_rg_data)
    rg = P.row_group_rows(files)
    before = P.READ_COUNTER["docs"]
    n = len(list(_epoch(files, rg)))
    assert P.READ_COUNTER["docs"] - before == sum(map(sum, rg)) and n > 0


def test_ranks_read_disjoint_units_and_a_position_from_another_dataset_is_refused(small_rg_data):
    files = _files(small_rg_data)
    rg = P.row_group_rows(files)
    u0, u1 = P.plan_units(rg, 0, 0, 2), P.plan_units(rg, 0, 1, 2)
    assert not set(u0) & set(u1) and len(u0) + len(u1) == sum(len(r) for r in rg)
    e0, e1 = P.plan_units(rg, 0, 0, 1, 5), P.plan_units(rg, 1, 0, 1, 5)    # seeded file order per epoch
    assert sorted(e0, key=lambda u: (u.shard, u.row_group)) == sorted(e1, key=lambda u: (u.shard, u.row_group))
    assert P.plan_units(rg, 1, 0, 1, 5) == e1
    one = P.plan_units([[4]], 0, 1, 3)                         # fewer row groups than ranks: doc ranges
    assert [(u.lo, u.hi) for u in one] == [(1, 2)]
    bad = P.DataPosition(0, 2, 0, "train-99999.parquet", 0, 1)
    with pytest.raises(P.SeekError, match="train-99999"):
        P.seek_units(u0, bad, files)


def test_position_round_trip_through_checkpoint(tmp_path):
    import torch
    from nsa.train.checkpoint import build_state, load_checkpoint, rank_positions, save_checkpoint
    ranks = [P.DataPosition(1, 7, 0, "train-00000-of-00002.parquet", 4, 2, np.arange(5, dtype=np.int64) + 300),
             P.DataPosition(1, 7, 1, "train-00001-of-00002.parquet", 0, 3)]
    model = torch.nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    data = {"epoch": 1, "batches_in_epoch": 7, "samples_seen": 112, "ranks": ranks}
    state = build_state(model=model, optimizer=opt, scheduler=sched, scaler=torch.amp.GradScaler("cpu", enabled=False),
                        step=9, data=data, config={})
    save_checkpoint(tmp_path, state)
    back = load_checkpoint(tmp_path)
    assert {k: back["data"][k] for k in ("epoch", "batches_in_epoch", "samples_seen")} == \
        {"epoch": 1, "batches_in_epoch": 7, "samples_seen": 112}
    got, note = rank_positions(back["data"], world_size=2)
    assert note is None and len(got) == 2
    for a, b in zip(got, ranks):
        assert (a.epoch, a.batches_in_epoch, a.shard, a.shard_name, a.row_group, a.offset) == \
            (b.epoch, b.batches_in_epoch, b.shard, b.shard_name, b.row_group, b.offset)
        np.testing.assert_array_equal(a.carry, b.carry)
    meta = json.loads((tmp_path / "meta.json").read_text())
    assert meta["data"]["ranks"][0] == {"epoch": 1, "batches_in_epoch": 7, "shard": "train-00000-of-00002.parquet",
                                        "row_group": 4, "offset": 2, "carry_tokens": 5}
    _, note = rank_positions(back["data"], world_size=4)
    assert note and "2 ranks" in note and "4" in note
    old = {k: v for k, v in back["data"].items() if k != "ranks"}        # a checkpoint from before seeking
    none, note = rank_positions(old, world_size=2)
    assert none is None and "no data position" in note


def _losses(rd):
    with open(os.path.join(rd, "training.csv"), newline="") as fh:
        return {r["step"]: float(r["loss"]) for r in csv.DictReader(fh)}


def _start(rd):
    from nsa.telemetry import read_heartbeat
    return [r for r in read_heartbeat(os.path.join(rd, "heartbeat_rank0.jsonl")) if r["kind"] == "start"][-1]


@pytest.fixture(scope="module")
def halted(small_rg_data, tmp_path_factory):
    """An uninterrupted 8-step run (its losses and the docs it read) and a run halted after step 4."""
    root = tmp_path_factory.mktemp("resume")
    before = P.READ_COUNTER["docs"]
    _, rd_ref = run_local(local_cfg(small_rg_data, root / "a"))
    ref_read = P.READ_COUNTER["docs"] - before
    s, rd = run_local(local_cfg(small_rg_data, root / "b", runtime__fault="halt@4"))
    assert s["status"] == "halted" and s["checkpoints"] == [4]
    os.remove(os.path.join(rd, ".HALT"))
    return {"ref": _losses(rd_ref), "ref_read": ref_read, "root": root / "b"}


def _resume(small_rg_data, halted, tmp_path, edit=None):
    import shutil
    root = tmp_path / "b"
    shutil.copytree(halted["root"], root)
    if edit is not None:
        edit(root / "r" / "checkpoint_00000004")
    before = P.READ_COUNTER["docs"]
    s, rd = run_local(local_cfg(small_rg_data, root))
    assert s["status"] == "completed" and s["start_step"] == 4 and s["step"] == 8
    return rd, P.READ_COUNTER["docs"] - before


def test_exact_resume_matches_uninterrupted(small_rg_data, halted, tmp_path):
    rd, read = _resume(small_rg_data, halted, tmp_path)
    a, b = halted["ref"], _losses(rd)
    for step in ("5", "6", "8"):   # same weights, optimizer state and data position -> same losses
        assert b[step] == pytest.approx(a[step], rel=1e-5), step
    seek = _start(rd)["data_seek"]
    assert seek["batches_in_epoch"] == 4 and seek["shard"]
    # the uninterrupted run read every doc up to what step 8 used; the resumed one reads none of the
    # docs the first 4 steps consumed (they came from the checkpoint's carry) beyond one row group (3)
    consumed = _consumed_docs(small_rg_data, seek)
    assert consumed > 3 and read <= halted["ref_read"] - consumed + 3, (read, halted["ref_read"], consumed)


def _consumed_docs(d, seek):
    """Docs of the rank-0 epoch before the recorded offset (the first 4 steps read them)."""
    files = _files(d)
    units = P.plan_units(P.row_group_rows(files), 0, 0, 1, 0)
    names = [os.path.basename(f) for f in files]
    i = next(i for i, u in enumerate(units) if names[u.shard] == seek["shard"] and u.row_group == seek["row_group"])
    return sum(u.hi - u.lo for u in units[:i]) + seek["offset"] - units[i].lo


def test_checkpoint_without_position_falls_back_to_fast_forward(small_rg_data, halted, tmp_path, capsys):
    """A checkpoint written before positions were recorded still resumes exactly, by re-reading."""
    import shutil
    from nsa.train.checkpoint import load_checkpoint, save_checkpoint

    def strip(ck):
        state = load_checkpoint(ck)
        state["data"] = {k: state["data"][k] for k in ("epoch", "batches_in_epoch", "samples_seen")}
        shutil.rmtree(ck)
        save_checkpoint(ck, state)

    capsys.readouterr()
    rd, read = _resume(small_rg_data, halted, tmp_path, strip)
    out = capsys.readouterr().out
    assert sum("no data position" in line for line in out.splitlines()) == 1
    assert "data_seek" not in _start(rd)
    assert read == halted["ref_read"]                    # the fast-forward re-reads what was consumed
    a, b = halted["ref"], _losses(rd)
    for step in ("5", "6", "8"):
        assert b[step] == pytest.approx(a[step], rel=1e-5), step


@pytest.mark.ray
@pytest.mark.parametrize("url", [False, True], ids=["path", "file_url"])
def test_ray_stream_is_the_local_stream_and_seeks(ray_session, small_rg_data, url):
    """Under Ray each rank streams its units through Ray Data tasks: the same batches as in process, and
    from a recorded position only the units left are handed to Ray Data. url: data.path as a file://
    URL, the hub route's code path (hf:// differs only in the fsspec filesystem)."""
    from nsa.data.ray_data import iter_ray_units
    from nsa.data.shards import check_data_path
    files = check_data_path(f"file://{small_rg_data}") if url else _files(small_rg_data)
    assert all(str(f).startswith("file://") for f in files) == url
    rg = P.row_group_rows(files)
    tok = get_tokenizer("byte")
    handed: list = []

    def ray_source(units):
        handed.append(list(units))
        return iter_ray_units(files, units, tok, prefetch_batches=2)

    def ray_epoch(start=None):
        return P.rank_epoch(files, rg, epoch=0, rank=1, world=2, seq_len=SEQ, batch_size=BATCH,
                            source=ray_source, shuffle_seed=3, start=start)

    local = list(_epoch(_files(small_rg_data), rg, 1, 2, seed=3))
    ep = ray_epoch()
    it = iter(ep)
    head = [next(it) for _ in range(3)]
    pos = ep.position()
    it.close()                                    # ends the first pipeline (as a finished run does)
    rest = list(ray_epoch(pos))
    assert len(head) + len(rest) == len(local)
    for a, b in zip(head + rest, local):
        np.testing.assert_array_equal(a, b)
    resumed, mine = handed[-1], P.plan_units(rg, 0, 1, 2, 3)
    assert resumed == P.seek_units(mine, pos, files) and resumed[-1] == mine[-1]
    assert sum(u.hi - u.lo for u in resumed) < sum(u.hi - u.lo for u in mine)


def test_a_position_that_does_not_fit_the_data_falls_back_in_the_stream(small_rg_data, tmp_path, capsys):
    """Data replaced under a checkpoint: the stream says so in one line and re-reads to the batch count."""
    from nsa.train.local_env import LocalEnv
    from nsa.train.loop import BatchStream
    cfg = local_cfg(small_rg_data, tmp_path)
    env = LocalEnv(cfg, tmp_path / "r")
    ref = BatchStream(env)
    want = [b for _ in range(6) for b in ref.next(1)[0]]
    pos = ref.rank_position()
    assert pos.batches_in_epoch == 6
    good = BatchStream(env, pos.epoch, 0, seek=P.DataPosition.from_state(pos.to_state()))
    bad = BatchStream(env, pos.epoch, 0, seek=P.DataPosition(0, 3, 0, "train-77777.parquet", 0, 1))
    assert bad.position(1)["batches_in_epoch"] == 3
    more = ref.next(2)[0]
    for a, b in zip(good.next(2)[0], more):
        assert (a == b).all()
    capsys.readouterr()
    got = bad.next(3)[0]
    out = capsys.readouterr().out
    assert "cannot seek" in out and "train-77777" in out
    for a, b in zip(got, want[3:6]):
        assert (a == b).all()
