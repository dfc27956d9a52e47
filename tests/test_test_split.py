"""The test split, which plays no part in training or choosing: streamed text (a source's own test split, else a hash
hold-out at the other end of the hash's range from validation's, left out of training), token shards (``ltcx prepare``
writes one, ``meta.json`` records it) and MQAR (a seed stream of its own); the training stream a resume continues,
and each missing or disabled test split's one line."""

import json
from types import SimpleNamespace

import pytest
import torch

from helpers import assert_mentions, unit_docs
from ltcx.data import RecallDataModule, TextDataModule, in_holdout, in_test_holdout
from ltcx.data.prepare import prepare
from ltcx.errors import ConfigError, LtcxError

B = 16  # block_size: a unit_docs document plus end-of-text is one block (bytes tokenizer)


def write_txt(path, docs):
    path.write_text("\n\n".join(docs), encoding="utf-8")
    return path


def doc_of(block) -> str:
    ids = (block["idx"] if isinstance(block, dict) else block).tolist()
    assert ids[-1] == 256
    return bytes(ids[:-1]).decode()


def make_dm(path, **kw) -> TextDataModule:
    kw = {"tokenizer": "bytes", "block_size": B, "batch_size": 1, "val_batches": 2, "shuffle_buffer": 0, **kw}
    dm = TextDataModule(path=str(path), **kw)
    dm.setup("fit")
    return dm


def splits(dm) -> tuple[list[str], list[str], list[str]]:
    return ([doc_of(b) for b in dm.train_dataset(infinite=False)], [doc_of(b) for b in dm.val_dataset()],
            [doc_of(b) for b in dm.test_dataset()])


# ---------------------------------------------------------------- streamed text
def test_hash_hold_outs_are_disjoint_and_cover_every_document():
    docs = unit_docs(4000)
    val = {d for d in docs if in_holdout(d, 0.3)}
    test = {d for d in docs if in_test_holdout(d, 0.3)}
    assert 900 < len(val) < 1500 and 900 < len(test) < 1500 and not val & test
    assert {d for d in docs if in_test_holdout(d, 0.1)} < test  # a smaller fraction keeps a subset: no document moves
    assert not any(in_test_holdout(d, 0.0) for d in docs)


def test_a_single_file_holds_out_test_documents_training_never_reads(tmp_path):
    docs = unit_docs(300)
    path = write_txt(tmp_path / "corpus.txt", docs)
    dm = make_dm(path, holdout_fraction=0.1, test_fraction=0.1, val_batches=40, test_batches=40)
    train, val, test = splits(dm)
    held_val, held_test = [d for d in docs if in_holdout(d, 0.1)], [d for d in docs if in_test_holdout(d, 0.1)]
    assert held_test and set(test) == set(held_test) and set(val) == set(held_val)
    assert not set(train) & set(test) and not set(val) & set(test)
    assert sorted(train + held_val + held_test) == sorted(docs)
    assert splits(make_dm(path, holdout_fraction=0.1, test_fraction=0.1, val_batches=40, test_batches=40)) == (
        train, val, test)  # the same in every run
    # test_batches defaults to val_batches; the test blocks cycle like validation's when the split is shorter
    assert len(list(make_dm(path, val_batches=3, batch_size=2).test_dataset())) == 3 * 2


def test_test_named_files_are_the_test_split_and_leave_training_as_it_was(tmp_path):
    train_docs, val_docs, test_docs = unit_docs(40), unit_docs(3, start=100), unit_docs(4, start=200)
    write_txt(tmp_path / "train.txt", train_docs)
    write_txt(tmp_path / "validation.txt", val_docs)
    write_txt(tmp_path / "test.txt", test_docs)
    dm = make_dm(tmp_path, test_fraction=0.3, val_batches=3, test_batches=4)
    assert splits(dm) == (train_docs, val_docs, test_docs)  # no hash hold-out: training reads every training file
    assert dm.state_dict() == {"train_batches_consumed": 0}
    dm.trainer = SimpleNamespace(global_step=1, accumulate_grad_batches=1, global_rank=0, world_size=1)
    assert dm.state_dict()["test_holdout"] == 0.0
    # --data.test_split null: the test-named files stay out of training, the test split is held out by hash
    dm = make_dm(tmp_path, test_split=None, test_fraction=0.3, val_batches=3, test_batches=4)
    train, _, test = splits(dm)
    assert train == [d for d in train_docs if not in_test_holdout(d, 0.3)] and set(test) <= set(train_docs)


def test_without_validation_files_test_named_files_validate_as_before(tmp_path):
    write_txt(tmp_path / "train.txt", unit_docs(40))
    write_txt(tmp_path / "test.txt", unit_docs(2, start=50))
    dm = make_dm(tmp_path, test_fraction=0.2, val_batches=1, batch_size=2)
    train, val, test = splits(dm)
    assert val == unit_docs(2, start=50)
    assert train == [d for d in unit_docs(40) if not in_test_holdout(d, 0.2)] and set(test) < set(unit_docs(40))


def test_hub_test_split(tmp_path, monkeypatch, hf_offline):
    """The hub branch on a repository-like folder: its test split is the test split; one that is the training or
    validation split is one line."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    import ltcx.data.text_datasets as text_datasets

    monkeypatch.setattr(text_datasets, "looks_local", lambda path: False)
    monkeypatch.setattr(text_datasets, "hub_unreachable", lambda: None)
    repo = tmp_path / "repo"
    repo.mkdir()
    for split, docs in (("train", unit_docs(30)), ("validation", unit_docs(2, start=100)),
                        ("test", unit_docs(3, start=200))):
        pq.write_table(pa.table({"text": docs}), repo / f"{split}-00000-of-00001.parquet")
    assert splits(make_dm(repo, val_batches=2, test_batches=3)) == (
        unit_docs(30), unit_docs(2, start=100), unit_docs(3, start=200))
    for split, which in (("train", "training split"), ("validation", "validation split (--data.val_split)")):
        with pytest.raises(ConfigError) as error:
            make_dm(repo, test_split=split)
        assert_mentions(str(error.value), f"--data.test_split '{split}'", which, "another split",
                        "null to hold out --data.test_fraction")


def test_a_missing_or_disabled_test_split_is_one_line_at_test_setup(tmp_path):
    path = write_txt(tmp_path / "corpus.txt", unit_docs(50))
    dm = TextDataModule(path=str(path), tokenizer="bytes", block_size=B, test_fraction=0.0)
    dm.setup("fit")  # training needs no test split
    with pytest.raises(ConfigError) as error:
        dm.setup("test")
    assert_mentions(str(error.value), f"data files '{path}'", "no test split", "data.test_fraction is 0",
                    "--data.test_fraction (e.g. 0.005)", "train again")
    with pytest.raises(ConfigError) as error:
        TextDataModule(path=str(path), tokenizer="bytes", block_size=B, test_batches=0).setup("test")
    assert_mentions(str(error.value), "test split is disabled", "data.test_batches=0", "--data.test_batches > 0")
    with pytest.raises(ConfigError) as error:
        TextDataModule(path=str(path), holdout_fraction=0.5, test_fraction=0.6)
    assert_mentions(str(error.value), "data.test_fraction=0.6", "[0, 0.5)", "--data.test_fraction")
    with pytest.raises(ConfigError, match=r"^data.test_batches=-1 must be >= 0"):
        TextDataModule(path=str(path), test_batches=-1)


def test_a_resume_continues_the_checkpoints_training_stream(tmp_path, capsys):
    """A checkpoint from before the test hold-out (no ``test_holdout`` in its state) trained on every document: its
    resume continues that stream exactly, and a notice says the test split may hold documents it trained on."""
    path = write_txt(tmp_path / "corpus.txt", [d * 2 for d in unit_docs(60)])  # 2 blocks a document
    kw = dict(val_batches=0, batch_size=2, shuffle_buffer=100)

    def batches(dm, n):
        return [dm.on_before_batch_transfer(b, 0).tolist() for b, _ in zip(dm.train_dataloader(), range(n))]

    old = make_dm(path, test_fraction=0.0, **kw)
    reference = batches(old, 40)
    old.trainer = SimpleNamespace(global_step=40, accumulate_grad_batches=1, global_rank=0, world_size=1)
    saved = old.state_dict()
    assert saved["test_holdout"] == 0.0
    del saved["test_holdout"]  # as an older ltcx saved it
    fresh = batches(make_dm(path, test_fraction=0.2, **kw), 40)
    assert fresh != reference  # the test documents are out of the new stream
    resumed = make_dm(path, test_fraction=0.2, **kw)
    capsys.readouterr()
    resumed.load_state_dict(saved)
    notice = capsys.readouterr().err
    assert notice.count("\n") == 1
    assert_mentions(notice, "held out 0.0", "data.test_fraction 0.2 here", "continues that stream",
                    "test split may hold documents it trained on")
    continued = batches(resumed, 20)
    again = make_dm(path, test_fraction=0.0, **kw)
    again.load_state_dict({**saved, "test_holdout": 0.0})
    assert continued == batches(again, 20)
    resumed.trainer = old.trainer
    assert resumed.state_dict()["test_holdout"] == 0.0  # and its own checkpoints say so
    same = make_dm(path, test_fraction=0.2, **kw)
    same.load_state_dict({"train_batches_consumed": 3, "test_holdout": 0.2})
    assert capsys.readouterr().err == ""


# ---------------------------------------------------------------- token shards
def write_jsonl(path, docs):
    path.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs), encoding="utf-8")
    return path


def shard_split(dm, split: str) -> list[str]:
    data = dm.val_dataset() if split == "validation" else dm.test_dataset()
    return [doc_of(row) for batch in data for row in batch]


def test_prepare_writes_a_test_split_by_hash_and_shards_test_on_it(tmp_path):
    docs = unit_docs(300)
    out = tmp_path / "prep"
    meta = prepare(str(write_jsonl(tmp_path / "corpus.jsonl", docs)), str(out), tokenizer="bytes", val_fraction=0.1,
                   test_fraction=0.1, shard_tokens=40 * (B + 1), num_proc=1, batch_docs=16)
    val, test = [d for d in docs if in_holdout(d, 0.1)], [d for d in docs if in_test_holdout(d, 0.1)]
    assert test and meta["test"] == {"split": None, "holdout": 0.1}
    assert (meta["counts"]["test_documents"], meta["counts"]["test_tokens"]) == (len(test), len(test) * (B + 1))
    assert [s["file"] for s in meta["shards"]["test"]][0] == "test_000000.bin"
    dm = TextDataModule(path=str(out), tokenizer="bytes", block_size=B, batch_size=1, val_batches=len(val),
                        test_batches=len(test), verify="full")
    dm.setup("test")
    assert shard_split(dm, "test") == test and shard_split(dm, "validation") == val
    train = {doc_of(row) for row in dm.train_dataset(0, 1).batch(0)}
    assert not train & set(test)


def test_prepare_takes_the_sources_test_files(tmp_path):
    folder = tmp_path / "corpus"
    folder.mkdir()
    write_txt(folder / "train.txt", unit_docs(50))
    write_txt(folder / "validation.txt", unit_docs(3, start=100))
    write_txt(folder / "test.txt", unit_docs(4, start=200) + unit_docs(1))  # one training document repeated
    meta = prepare(str(folder), str(tmp_path / "prep"), tokenizer="bytes", num_proc=1)
    assert meta["test"] == {"split": "test", "holdout": 0.0}
    assert meta["counts"]["test_documents"] == 5 and meta["counts"]["train_documents"] == 49  # read before training
    dm = TextDataModule(path=str(tmp_path / "prep"), tokenizer="bytes", block_size=B, batch_size=1, val_batches=3,
                        test_batches=5)
    dm.setup("test")
    assert shard_split(dm, "test") == unit_docs(4, start=200) + unit_docs(1)


def test_shards_prepared_before_the_test_split_train_and_say_so_at_test(tmp_path):
    out = tmp_path / "prep"
    prepare(str(write_jsonl(tmp_path / "corpus.jsonl", unit_docs(100))), str(out), tokenizer="bytes",
            val_fraction=0.2, num_proc=1)
    meta = json.loads((out / "meta.json").read_text())
    for shard in meta["shards"].pop("test"):
        (out / shard["file"]).unlink()
    del meta["test"], meta["settings"]["test_split"], meta["settings"]["test_fraction"]
    (out / "meta.json").write_text(json.dumps(meta))
    dm = TextDataModule(path=str(out), tokenizer="bytes", block_size=B, batch_size=1, val_batches=2)
    dm.setup("fit")
    assert dm.train_dataset(0, 1).batch(0).shape == (1, B + 1)
    with pytest.raises(ConfigError) as error:
        dm.setup("test")
    assert_mentions(str(error.value), f"token shards in '{out}'", "no test documents", "prepare the data again",
                    "new --out", "--test_fraction")
    # rerun with the settings it was made with: already prepared, left as it is
    again = prepare(str(tmp_path / "corpus.jsonl"), str(out), tokenizer="bytes", val_fraction=0.2, num_proc=1,
                    test_split=None, test_fraction=0.0)
    assert "test" not in again["shards"]
    with pytest.raises(LtcxError, match="other settings") as error:
        prepare(str(tmp_path / "corpus.jsonl"), str(out), tokenizer="bytes", val_fraction=0.2, num_proc=1)
    assert_mentions(str(error.value), "test_split: None there, 'test' now", "test_fraction: 0.0 there, 0.001 now",
                    "another --out")


# ---------------------------------------------------------------- MQAR
def test_mqar_test_batches_come_from_their_own_seed_stream():
    dm = RecallDataModule(vocab_size=64, block_size=32, num_kv_pairs=4, batch_size=4, val_batches=3)
    dm.setup("test")
    test = [inputs for inputs, _ in dm.test_dataset()]
    assert len(test) == 3  # test_batches: val_batches unless set
    val = [inputs for inputs, _ in dm.val_dataset()]
    train = [inputs for (inputs, _), _ in zip(dm.train_dataset(), range(50))]
    rows = {tuple(row.tolist()) for batch in val + train for row in batch}
    assert not rows & {tuple(row.tolist()) for batch in test for row in batch}
    again = RecallDataModule(vocab_size=64, block_size=32, num_kv_pairs=4, batch_size=4, val_batches=3)
    assert all(torch.equal(a, b) for a, (b, _) in zip(test, again.test_dataset()))  # the same in every run
    assert torch.equal(dm._batches("test", 0, 1, num_batches=1).batch(0)[0], test[0])  # split="test"
    assert len(list(RecallDataModule(vocab_size=64, block_size=32, test_batches=5).test_dataset())) == 5
    with pytest.raises(ConfigError, match=r"disabled.*data\.test_batches=0"):
        RecallDataModule(vocab_size=64, block_size=32, test_batches=0).setup("test")


def test_ltcx_test_without_a_test_split_is_one_line_and_writes_nothing(tmp_path, monkeypatch, capsys):
    from helpers import ROOT, write_checkpoint
    from ltcx.cli import main

    monkeypatch.chdir(tmp_path)
    data = write_txt(tmp_path / "corpus.txt", unit_docs(40))
    checkpoint = write_checkpoint(tmp_path / "model.ckpt")
    with pytest.raises(SystemExit) as stop:
        main(["test", "--config", str(ROOT / "configs/gpt.yaml"), "--data.path", str(data), "--data.tokenizer",
              "bytes", "--data.block_size", "32", "--data.test_fraction", "0", "--ckpt_path", str(checkpoint)])
    assert stop.value.code == 2
    line = capsys.readouterr().err.splitlines()[-1]
    assert line.startswith("ltcx: error: ")
    assert_mentions(line, f"data files '{data}'", "no test split", "data.test_fraction is 0",
                    "--data.test_fraction (e.g. 0.005)", "train again")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["corpus.txt", "model.ckpt"]


def test_a_test_split_too_small_for_a_block_is_one_line(tmp_path):
    from ltcx.data import DataError

    docs = unit_docs(300)
    dm = make_dm(write_txt(tmp_path / "corpus.txt", docs), test_fraction=0.01, block_size=400)
    assert sum(in_test_holdout(d, 0.01) for d in docs) * (B + 1) < 401  # too few test tokens for one block
    with pytest.raises(DataError, match="test data too small") as error:
        list(dm.test_dataset())
    assert_mentions(str(error.value), "rank 0 of 1", "block of 401 tokens", "more test data", "test_fraction",
                    "block_size", "fewer devices")
