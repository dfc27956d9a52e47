"""`ltcx prepare` and the token-shard data mode: dedup, document-disjoint validation, checksums, resume after a kill,
rank/worker-disjoint epochs without replacement, O(1) exact resume, and a fit on prepared shards."""

import errno
import hashlib
import json
import os
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader

import ltcx.data.prepare as prepare_module
from helpers import assert_mentions, lean_fit_args, one_error_line, read_events, unit_docs
from ltcx.cli import main
from ltcx.data import TextDataModule, in_holdout, in_test_holdout
from ltcx.data.prepare import prepare
from ltcx.data.shard_format import HEADER_BYTES, token_dtype, verify_shards, write_shard
from ltcx.errors import LtcxError

B = 16  # block_size; blocks hold B + 1 tokens
ROOT = Path(__file__).resolve().parents[1]


def write_jsonl(path: Path, docs: list[str]) -> Path:
    path.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs), encoding="utf-8")
    return path


def shard_docs(folder: Path, meta: dict, split: str) -> list[str]:
    """The documents stored in a split's shards, in order (bytes tokenizer: end-of-text is 256)."""
    ids = np.concatenate([np.fromfile(folder / s["file"], dtype=meta["dtype"], offset=HEADER_BYTES)
                          for s in meta["shards"][split]])
    cuts = np.flatnonzero(ids == 256)
    return [bytes(ids[a + 1 : b].tolist()).decode() for a, b in zip(np.r_[-1, cuts[:-1]], cuts)]


def shard_dm(folder: Path, **kw) -> TextDataModule:
    kw = {"tokenizer": "bytes", "block_size": B, "batch_size": 2, "val_batches": 1, **kw}
    dm = TextDataModule(path=str(folder), **kw)
    dm.setup("fit")
    return dm


def block_ids(batches) -> list[str]:
    return [bytes(row[:-1].tolist()).decode() for batch in batches for row in batch]


@pytest.fixture
def corpus(tmp_path) -> tuple[Path, list[str]]:
    """300 distinct one-block documents, plus 25 exact and whitespace-variant duplicates and 5 blank ones."""
    docs = unit_docs(300)
    dups = [docs[i] for i in range(0, 50, 5)] + [f"  {docs[i]}\n" for i in range(1, 75, 5)]
    lines = docs[:150] + dups + ["", "  ", "\n", "", " "] + docs[150:]
    return write_jsonl(tmp_path / "corpus.jsonl", lines), docs


def prepared(tmp_path, corpus, name="prep", **kw) -> tuple[Path, dict]:
    kw = {"tokenizer": "bytes", "val_fraction": 0.1, "shard_tokens": 40 * (B + 1), "num_proc": 1, "batch_docs": 16,
          **kw}
    out = tmp_path / name
    return out, prepare(str(corpus[0]), str(out), **kw)


# ---------------------------------------------------------------- prepare
def test_prepare_dedups_splits_by_document_and_checksums(tmp_path, corpus):
    out, meta = prepared(tmp_path, corpus)
    docs = corpus[1]
    val = [d for d in docs if in_holdout(d, 0.1)]
    test = [d for d in docs if in_test_holdout(d, 0.001)]  # --test_fraction's default (none of these 300)
    assert 10 < len(val) < 50
    train = 300 - len(val) - len(test)
    assert meta["counts"] == {
        "documents_read": 330, "empty": 5, "duplicates": 25, "train_documents": train,
        "validation_documents": len(val), "train_tokens": train * (B + 1),
        "validation_tokens": len(val) * (B + 1), "test_documents": len(test), "test_tokens": len(test) * (B + 1),
    }
    assert shard_docs(out, meta, "train") == [d for d in docs if d not in val + test]  # first copies, in order
    assert shard_docs(out, meta, "validation") == val
    assert meta["dtype"] == "uint16" and meta["complete"] and len(meta["shards"]["train"]) > 3
    for shard in meta["shards"]["train"] + meta["shards"]["validation"]:
        data = (out / shard["file"]).read_bytes()
        assert hashlib.sha256(data).hexdigest() == shard["sha256"]
        assert len(data) == HEADER_BYTES + 2 * shard["tokens"] and data[:8] == b"LTCXTOK\0"
    verify_shards(str(out), meta, "full")
    assert not [f for f in os.listdir(out) if ".tmp" in f]


def test_prepare_resumes_after_a_kill(tmp_path, corpus, monkeypatch):
    _, reference = prepared(tmp_path, corpus, name="reference")
    write_json, commits = prepare_module.write_json, []

    def killed_at_third_commit(path, data):
        commits.append(path)
        if len(commits) == 4:  # meta.json at creation, then commits: this one's shards and hashes are written
            raise KeyboardInterrupt
        write_json(path, data)

    monkeypatch.setattr(prepare_module, "write_json", killed_at_third_commit)
    with pytest.raises(KeyboardInterrupt):
        prepared(tmp_path, corpus, num_proc=2)
    monkeypatch.setattr(prepare_module, "write_json", write_json)
    out = tmp_path / "prep"
    half = json.loads((out / "meta.json").read_text())
    assert not half["complete"] and len(half["shards"]["train"]) == 2
    assert (out / "train_000002.bin").exists()  # written by the killed commit: not in meta.json, so redone
    (out / "train_000003.bin.tmp-1").write_bytes(b"half-written")
    with pytest.raises(LtcxError, match="did not finish") as info:
        shard_dm(out)
    assert_mentions(str(info.value), "run the same ltcx prepare command again")
    _, resumed = prepared(tmp_path, corpus, num_proc=2)

    def outcome(meta):  # settings, counts, every shard's SHA-256 (the stream position's spelling may differ)
        return {k: v for k, v in meta.items() if k != "resume"}

    assert outcome(resumed) == outcome(reference)
    assert outcome(prepared(tmp_path, corpus)[1]) == outcome(reference)  # finished: nothing to do
    with pytest.raises(LtcxError, match="other settings") as info:
        prepared(tmp_path, corpus, val_fraction=0.2)
    assert_mentions(str(info.value), "val_fraction: 0.1 there, 0.2 now")
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "x").write_text("mine")
    with pytest.raises(LtcxError, match=r"not empty.*no meta\.json"):
        prepared(tmp_path, corpus, name="other")


@pytest.fixture
def split_corpus(tmp_path) -> tuple[Path, list[str], list[str]]:
    """A folder of train.jsonl (200 one-block documents, one of them also a validation document) and
    validation.jsonl (30 others): (folder, the training documents kept, the validation documents)."""
    folder = tmp_path / "split_corpus"
    folder.mkdir()
    train, val = unit_docs(200), unit_docs(30, start=1000)
    write_jsonl(folder / "train.jsonl", train[:100] + [val[3]] + train[100:])
    write_jsonl(folder / "validation.jsonl", val)
    return folder, train, val


def test_prepare_takes_the_sources_validation_files_and_shards_validate_on_them(tmp_path, split_corpus):
    """Validation is the validation-named file, read first and in full (a training document that repeats one is
    dropped), not a hash hold-out of everything; the shard data module validates on exactly those documents."""
    folder, train, val = split_corpus
    meta = prepare(str(folder), str(tmp_path / "out"), tokenizer="bytes", shard_tokens=10 * (B + 1), num_proc=1,
                   batch_docs=8)  # the defaults otherwise: val_split "validation", val_fraction 0.001
    out = tmp_path / "out"
    assert meta["validation"] == {"split": "validation", "holdout": 0.0}
    assert shard_docs(out, meta, "validation") == val and shard_docs(out, meta, "train") == train
    assert meta["counts"] == {"documents_read": 231, "empty": 0, "duplicates": 1, "train_documents": 200,
                              "validation_documents": 30, "train_tokens": 200 * (B + 1),
                              "validation_tokens": 30 * (B + 1),
                              "test_documents": 0, "test_tokens": 0}  # no document in --test_fraction 0.001's slice
    assert len(meta["shards"]["validation"]) == 2  # committed at shard_tokens like the training shards
    dm = shard_dm(out, val_batches=15, batch_size=2)
    assert sorted(block_ids(dm.val_dataset(0, 1))) == sorted(val)
    main(["prepare", "--source", str(folder), "--out", str(tmp_path / "holdout"), "--tokenizer", "bytes",
          "--val_split", "none", "--val_fraction", "0.1", "--num_proc", "1"])  # every file one stream, held out by hash
    held_out = json.loads((tmp_path / "holdout" / "meta.json").read_text())
    assert held_out["validation"] == {"split": None, "holdout": 0.1}
    both = [doc for split in ("train", "validation") for doc in shard_docs(tmp_path / "holdout", held_out, split)]
    assert sorted(both) == sorted(train + val)


@pytest.mark.parametrize("killed_at", [2, 3, 7])  # commits 1-2 end validation shards, 3 onwards training shards
def test_prepare_with_a_validation_split_resumes_after_a_kill(tmp_path, split_corpus, monkeypatch, killed_at):
    folder = split_corpus[0]
    kw = dict(tokenizer="bytes", shard_tokens=10 * (B + 1), num_proc=1, batch_docs=8)
    reference = prepare(str(folder), str(tmp_path / "reference"), **kw)
    write_json, calls = prepare_module.write_json, []

    def killed(path, data):
        calls.append(path)
        if len(calls) == killed_at + 1:  # meta.json at creation, then one per commit
            raise KeyboardInterrupt
        write_json(path, data)

    monkeypatch.setattr(prepare_module, "write_json", killed)
    with pytest.raises(KeyboardInterrupt):
        prepare(str(folder), str(tmp_path / "out"), **kw)
    monkeypatch.setattr(prepare_module, "write_json", write_json)
    half = json.loads((tmp_path / "out" / "meta.json").read_text())
    assert half["resume"]["stream"]["split"] == ("validation" if killed_at <= 3 else "train")  # the last commit's
    resumed = prepare(str(folder), str(tmp_path / "out"), **kw)
    assert {k: v for k, v in resumed.items() if k != "resume"} == {k: v for k, v in reference.items() if k != "resume"}


def test_folders_prepared_before_validation_splits_load_and_resume(tmp_path, corpus, monkeypatch):
    """meta.json without val_split, validation, or a split in its stream position (as ltcx wrote them before
    validation splits were read): a finished folder trains and reruns as prepared; an interrupted one resumes."""
    def as_before(meta: dict) -> dict:
        settings = {k: v for k, v in meta["settings"].items() if k != "val_split"}
        old = {**{k: v for k, v in meta.items() if k != "validation"}, "settings": settings}
        if old["resume"]["stream"] is not None:
            old["resume"] = {**old["resume"], "stream": old["resume"]["stream"]["stream"]}
        return old

    out, reference = prepared(tmp_path, corpus, name="reference", val_split=None)
    (out / "meta.json").write_text(json.dumps(as_before(reference)))
    shard_dm(out).val_dataset(0, 1)
    assert prepared(tmp_path, corpus, name="reference", val_split=None)[1]["complete"]  # "already prepared"
    write_json, calls = prepare_module.write_json, []

    def killed_at_third_commit(path, data):
        calls.append(path)
        if len(calls) == 4:
            raise KeyboardInterrupt
        write_json(path, as_before(data))

    monkeypatch.setattr(prepare_module, "write_json", killed_at_third_commit)
    with pytest.raises(KeyboardInterrupt):
        prepared(tmp_path, corpus, val_split=None)
    monkeypatch.setattr(prepare_module, "write_json", write_json)
    resumed = prepared(tmp_path, corpus, val_split=None)[1]
    assert resumed["shards"] == reference["shards"] and resumed["counts"] == reference["counts"]


def test_too_little_validation_names_the_flag(tmp_path, corpus, capsys):
    """Fewer validation blocks than ranks, or no validation document: one line naming --val_fraction (or
    --val_split for a source's own split too small) and --data.block_size; prepare says so when it finishes."""
    out, meta = prepared(tmp_path, corpus, val_fraction=0.005)
    assert meta["counts"]["validation_tokens"] == 4 * (B + 1)
    assert_mentions(capsys.readouterr().err, "ltcx: only 68 validation tokens", "--val_fraction 0.005",
                    "a larger --val_fraction")
    with pytest.raises(LtcxError) as info:
        shard_dm(out, block_size=128).val_dataset(0, 1)
    assert_mentions(str(info.value), f"validation shards in '{out}'", "68 tokens", "--val_fraction 0.005",
                    "0 blocks of 129 tokens", "1 rank", "a larger --val_fraction", "lower --data.block_size")
    shard_dm(out).val_dataset(3, 4)  # 4 blocks of 17: one for each of 4 ranks
    with pytest.raises(LtcxError) as info:
        shard_dm(out).val_dataset(4, 5)
    assert_mentions(str(info.value), "4 blocks of 17 tokens", "5 rank")
    folder = tmp_path / "tiny_val"
    folder.mkdir()
    write_jsonl(folder / "train.jsonl", unit_docs(40))
    write_jsonl(folder / "val.jsonl", unit_docs(1, start=99))
    prepare(str(folder), str(tmp_path / "tiny"), tokenizer="bytes", num_proc=1)
    with pytest.raises(LtcxError) as info:
        shard_dm(tmp_path / "tiny", block_size=32).val_dataset(0, 1)
    assert_mentions(str(info.value), "17 tokens", "validation-named files", "0 blocks", "--val_split none",
                    "--val_fraction")
    none, _ = prepared(tmp_path, corpus, name="none", val_fraction=0.0)
    with pytest.raises(LtcxError, match="no validation documents") as info:
        shard_dm(none)
    assert_mentions(str(info.value), "--val_fraction 0.0", "--data.val_batches 0", "prepare again")


def hub_repo(tmp_path: Path, monkeypatch, **splits: list[str]) -> Path:
    """A repository-like folder of one parquet file per split that prepare reads as the hub (load_dataset(source,
    name), split selection)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    import ltcx.data.text_datasets as text_datasets

    for module in (text_datasets, prepare_module):
        monkeypatch.setattr(module, "looks_local", lambda path: False)
    monkeypatch.setattr(text_datasets, "hub_unreachable", lambda: None)  # the "hub" is this folder: reachable
    repo = tmp_path / "repo"
    repo.mkdir()
    for split, docs in splits.items():
        pq.write_table(pa.table({"text": docs}), repo / f"{split}-00000-of-00001.parquet")
    return repo


def test_prepare_reads_a_hub_data_sets_validation_split(tmp_path, monkeypatch):
    repo = hub_repo(tmp_path, monkeypatch, train=unit_docs(40), validation=unit_docs(6, start=500))
    meta = prepare(str(repo), str(tmp_path / "out"), name=None, tokenizer="bytes", num_proc=1)
    assert meta["validation"] == {"split": "validation", "holdout": 0.0}
    assert shard_docs(tmp_path / "out", meta, "validation") == unit_docs(6, start=500)
    assert shard_docs(tmp_path / "out", meta, "train") == unit_docs(40)
    with pytest.raises(LtcxError) as info:
        prepare(str(repo), str(tmp_path / "out2"), name=None, split="validation", tokenizer="bytes", num_proc=1)
    assert_mentions(str(info.value), "--val_split 'validation'", "--split", "--val_split none")
    assert not (tmp_path / "out2").exists()


def test_prepare_the_sample_with_its_defaults_then_fit_validates_on_its_validation_file(tmp_path, monkeypatch,
                                                                                       capsys):
    """The documented example, `ltcx prepare --source sample` with every default (gpt2, val_fraction 0.001) then
    `fit` with the smoke config's data settings: validation is the sample's validation.txt, not read as training."""
    from ltcx.tokenizers import get_tokenizer

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "argv", ["ltcx"])
    main(["prepare", "--source", "sample", "--out", "data/sample", "--num_proc", "1"])
    assert "validation: the source's validation-named files" in capsys.readouterr().err
    meta = json.loads((tmp_path / "data/sample/meta.json").read_text())
    tokenizer, sample = get_tokenizer("gpt2"), ROOT / "ltcx/data/sample"

    def documents(split: str) -> list[str]:
        ids = np.concatenate([np.fromfile(tmp_path / "data/sample" / s["file"], dtype=meta["dtype"],
                                          offset=HEADER_BYTES) for s in meta["shards"][split]]).tolist()
        return tokenizer.decode(ids).split("<|endoftext|>")[:-1]

    validation_text, validation = (sample / "validation.txt").read_text(encoding="utf-8"), documents("validation")
    assert len(validation) == meta["counts"]["validation_documents"] > 100
    assert all(document in validation_text for document in validation)
    assert not set(validation) & set(documents("train"))
    assert meta["counts"]["validation_tokens"] > 0.9 * len(tokenizer.encode(validation_text))
    main(["fit", "--config", str(ROOT / "configs/gpt.yaml"), "--config", str(ROOT / "configs/trainer/smoke.yaml"),
          "--data.path", "data/sample", "--trainer.max_steps", "2", "--trainer.val_check_interval", "2",
          "--trainer.enable_progress_bar", "false", "--data.batch_size", "2",
          "--model.backbone.init_args.n_layer", "1", "--model.backbone.init_args.n_embd", "32",
          "--model.backbone.init_args.n_head", "2", "--model.backbone.init_args.n_kv_head", "1",
          "--model.backbone.init_args.block_size", "128", "--model.warmup_steps", "2"])
    events = read_events(tmp_path / "lightning_logs/gpt/version_0")
    assert [e.step for e in events.Scalars("val/loss")]


def test_token_dtype_and_uint32_shards(tmp_path):
    assert token_dtype(50257) == np.uint16 and token_dtype(65536) == np.uint16 and token_dtype(100277) == np.uint32
    ids = np.array([0, 70000, 100276], dtype=np.uint32)
    record = write_shard(str(tmp_path / "t.bin"), ids, documents=1)
    assert record["max_id"] == 100276
    meta = {"dtype": "uint32", "tokenizer": "cl100k_base", "shards": {"train": [record], "validation": []}}
    verify_shards(str(tmp_path), meta, "full", vocab_size=100277)
    del record["max_id"]  # only the full check reads the ids themselves
    verify_shards(str(tmp_path), meta, "fast", vocab_size=70000)
    with pytest.raises(LtcxError) as info:
        verify_shards(str(tmp_path), meta, "full", vocab_size=70000)
    assert_mentions(str(info.value), "id 100276", "tokenizer 'cl100k_base'", "70000 ids, 0-69999")
    assert np.fromfile(tmp_path / "t.bin", dtype="<u4", offset=HEADER_BYTES).tolist() == ids.tolist()


def test_checksum_mismatch_is_one_line(tmp_path, corpus):
    out, meta = prepared(tmp_path, corpus)
    shard = out / meta["shards"]["train"][1]["file"]
    data = bytearray(shard.read_bytes())
    data[-1] ^= 1  # same size, same header: only the full check sees it
    shard.write_bytes(bytes(data))
    shard_dm(out)
    with pytest.raises(LtcxError) as info:
        shard_dm(out, verify="full")
    assert_mentions(str(info.value), f"token shard '{shard}'", "meta.json", "SHA-256", "prepare the data again")
    shard.write_bytes(bytes(data[:-2]))
    with pytest.raises(LtcxError, match=r"\(\d+ bytes, expected \d+\)"):
        shard_dm(out)


def test_ids_outside_the_vocabulary_are_named(tmp_path, corpus):
    out, meta = prepared(tmp_path, corpus)
    records = meta["shards"]["train"] + meta["shards"]["validation"]
    assert {r["max_id"] for r in records} == {256}  # end-of-text, the bytes tokenizer's largest id
    record = meta["shards"]["train"][1]
    shard = out / record["file"]
    ids = np.fromfile(shard, dtype="<u2", offset=HEADER_BYTES)
    ids[5] = 300
    record.update(write_shard(str(shard), ids, record["documents"]))  # size, header, max_id, SHA-256: all consistent
    (out / "meta.json").write_text(json.dumps(meta))
    message = (f"token shard '{shard}' holds id 300, outside the vocabulary of tokenizer 'bytes' (257 ids, 0-256): "
               "it was changed after ltcx prepare or made with another tokenizer; prepare the data again into a new "
               "folder")
    for verify in ("fast", "full"):
        with pytest.raises(LtcxError) as info:
            shard_dm(out, verify=verify)
        assert str(info.value) == message
    for r in records:  # a folder prepared before max_id was recorded: loads, and only the full check reads the ids
        del r["max_id"]
    (out / "meta.json").write_text(json.dumps(meta))
    shard_dm(out, verify="fast")
    with pytest.raises(LtcxError) as info:
        shard_dm(out, verify="full")
    assert str(info.value) == message


def test_ids_outside_the_vocabulary_stop_fit_before_training(tmp_path, monkeypatch, capsys):
    """Not `IndexError: index out of range in self` mid-run (exit 1, no shard named): one line, nothing written."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "argv", ["ltcx"])
    corpus = write_jsonl(tmp_path / "corpus.jsonl", [f"{d} {d}" for d in unit_docs(80)])
    meta = prepare(str(corpus), str(tmp_path / "shards"), tokenizer="gpt2", val_fraction=0.2, num_proc=1)
    record = meta["shards"]["train"][0]
    shard = tmp_path / "shards" / record["file"]
    ids = np.fromfile(shard, dtype="<u2", offset=HEADER_BYTES)
    ids[3] = 60000  # past gpt2's 50257 ids and the model's padded 50304
    record.update(write_shard(str(shard), ids, record["documents"]))
    (tmp_path / "shards" / "meta.json").write_text(json.dumps(meta))
    line = one_error_line(lean_fit_args(tmp_path, tmp_path / "shards", "--trainer.max_steps", "2"), capsys)
    assert_mentions(line, f"token shard '{shard}'", "id 60000", "tokenizer 'gpt2' (50257 ids, 0-50256)",
                    "prepare the data again")
    assert not (tmp_path / "lightning_logs").exists() and not (tmp_path / "checkpoints").exists()


@pytest.fixture
def gpt2_shards(tmp_path, monkeypatch) -> tuple[Path, dict]:
    """A gpt2 folder of 64 training documents (about 30 blocks of 33 tokens), in a working folder for `ltcx fit`."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "argv", ["ltcx"])
    corpus = write_jsonl(tmp_path / "corpus.jsonl", [f"{d} {d}" for d in unit_docs(80)])
    return tmp_path / "shards", prepare(str(corpus), str(tmp_path / "shards"), tokenizer="gpt2", val_fraction=0.2,
                                        num_proc=1)


@pytest.mark.parametrize("damage,workers", [("padding_id", 0), ("padding_id", 2), ("65535", 0), ("no_max_id", 2)])
def test_ids_edited_in_place_stop_fit_at_the_batch(tmp_path, gpt2_shards, capsys, damage, workers):
    """A shard edited in place passes the fast start-up check (size, header, meta.json's max_id); the batch holding
    the edit stops the run in one line naming the shard and the token, not training on a padding row of the
    embedding (50,257..50,303: exit 0) nor an IndexError mid-step; the steps before it are saved, nothing after
    (Lightning fetches a batch one step ahead: the bad batch 2 stops the run before step 2)."""
    folder, meta = gpt2_shards
    train = meta["shards"]["train"]
    assert len(train) == 1 and meta["vocab_size"] == 50257
    dm = TextDataModule(path=str(folder), tokenizer="gpt2", block_size=32, batch_size=4)
    dm.setup("fit")
    offset = int(dm.train_dataset().epoch_blocks(0)[2 * 4]) * 33 + 5  # in batch 2 (of 4 blocks of 33 tokens)
    if damage == "no_max_id":
        for record in train + meta["shards"]["validation"]:
            del record["max_id"]
        (folder / "meta.json").write_text(json.dumps(meta))
    bad = {"padding_id": 50300, "65535": 65535, "no_max_id": 50257}[damage]
    ids = np.memmap(folder / train[0]["file"], dtype="<u2", mode="r+", offset=HEADER_BYTES)
    ids[offset] = bad
    ids.flush()
    del ids
    args = lean_fit_args(tmp_path, folder, "--trainer.max_steps", "5", "--data.num_workers", str(workers), every=1)
    line = one_error_line(args, capsys)
    assert_mentions(line, f"token shard '{folder / train[0]['file']}'", f"id {bad} at token {offset:,}",
                    "tokenizer 'gpt2' (50257 ids, 0-50256)", "prepare the data again", "--data.verify full")
    runs = tmp_path / "checkpoints/gpt/version_0"
    assert sorted(p.name for p in runs.iterdir()) == ["epoch=0-step=1.ckpt", "last.ckpt"]
    assert torch.load(runs / "last.ckpt", weights_only=False)["global_step"] == 1
    with pytest.raises(LtcxError, match=r"meta\.json.*SHA-256"):  # the full check sees it
        verify_shards(str(folder), meta, "full", vocab_size=50257)


def test_folder_without_meta_json_is_named(tmp_path, corpus, capsys):
    out, _ = prepared(tmp_path, corpus)
    (out / "meta.json").unlink()
    with pytest.raises(LtcxError) as info:
        shard_dm(out)
    assert_mentions(str(info.value), f"'{out}'", "no meta.json", "restore meta.json", "ltcx prepare --out",
                    "--data.path")
    before = sorted(os.listdir(out))
    line = one_error_line(["prepare", "--source", str(corpus[0]), "--out", str(out), "--tokenizer", "bytes"], capsys)
    assert_mentions(line, f"'{out}'", "no meta.json", "restore meta.json", "--out a new or empty folder")
    assert sorted(os.listdir(out)) == before


def test_a_huge_line_is_tokenized_in_pieces(tmp_path, monkeypatch):
    """BPE's cost grows faster than one pre-tokenized piece: a line of 2 MB of letters (one piece for gpt2) is
    tokenized in pieces of at most PIECE_CHARS characters, and still decodes to itself; a long document with spaces
    is cut before a space only, where gpt2 cuts too, so its tokens are exactly the whole document's."""
    rng = np.random.default_rng(0)
    line = "".join(np.array(list("abcdefghijklmnopqrstuvwxyz"))[rng.integers(26, size=2_000_000)])
    words = " ".join(f"word{i} and, then.\nmore" for i in range(60_000))  # ~1.4 MB with spaces and newlines
    assert len(words) > prepare_module.LONG_CHARS
    corpus = write_jsonl(tmp_path / "corpus.jsonl", [line, words])
    pieces, real = [], prepare_module._pieces
    monkeypatch.setattr(prepare_module, "_pieces", lambda text: pieces.extend(real(text)) or real(text))
    meta = prepare(str(corpus), str(tmp_path / "out"), tokenizer="gpt2", val_fraction=0.0, num_proc=1)
    assert meta["counts"]["train_documents"] == 2
    assert max(len(p) for p in pieces) <= prepare_module.PIECE_CHARS
    assert len(pieces) > (len(line) + len(words)) // prepare_module.PIECE_CHARS
    from ltcx.tokenizers import get_tokenizer

    tok = get_tokenizer("gpt2")
    ids = np.fromfile(tmp_path / "out" / meta["shards"]["train"][0]["file"], dtype="<u2", offset=HEADER_BYTES)
    cut = np.flatnonzero(ids == tok.eot_id)
    assert cut.size == 2 and tok.decode(ids[: cut[0]].tolist()) == line
    assert ids[cut[0] + 1 : cut[1]].tolist() == tok.encode(words)


@pytest.mark.parametrize("first", [True, False])
@pytest.mark.parametrize("num_proc", ["1", "2"])
def test_prepare_names_a_file_that_is_not_utf8(tmp_path, capsys, first, num_proc):
    """Not UTF-8, the first file is found by the look before anything is written; a later one mid-stream (in the
    reading thread of the tokenizer pool, with --num_proc 2): the same one line naming it, and a re-run resumes."""
    folder = tmp_path / "texts"
    folder.mkdir()
    good = [f"paragraph {i} of good text" for i in range(6)]
    (folder / "a.txt").write_text("\n\n".join(good[:3]), encoding="utf-8")
    (folder / "b.txt").write_text("\n\n".join(good[3:]), encoding="utf-8")
    bad = folder / ("a.txt" if first else "b.txt")
    bad.write_bytes(bad.read_bytes() + b"\n\nbroken \xff\xfe bytes")
    out = tmp_path / "out"
    args = ["prepare", "--source", str(folder), "--out", str(out), "--tokenizer", "bytes", "--val_fraction", "0",
            "--num_proc", num_proc]
    line = one_error_line(args, capsys)
    assert_mentions(line, f"cannot read data file '{bad}'", "UnicodeDecodeError", "byte 0xff")
    assert_mentions(line, *(["fix or remove it"] if first else ["run the same ltcx prepare again", "resumes",
                                                                "prepare into a new --out"]))
    assert out.exists() != first  # the first file: nothing written
    bad.write_bytes(bad.read_bytes().replace(b"\xff\xfe", b"ok"))
    main(args)
    meta = json.loads((out / "meta.json").read_text())
    assert meta["complete"] and shard_docs(out, meta, "train") == [*good[:3], *(["broken ok bytes"] if first else []),
                                                                   *good[3:], *([] if first else ["broken ok bytes"])]


def test_prepare_onto_a_full_disk_is_one_line_and_resumes_exactly(tmp_path, monkeypatch, capsys):
    """ENOSPC while writing the second shard (after a commit), and while creating meta.json: one line, exit 2, no
    temp file left; after space is freed the same command resumes to exactly the preparation a full disk never hit."""
    corpus = write_jsonl(tmp_path / "corpus.jsonl", unit_docs(2500))  # 3 batches of 1024 documents: 3 commits
    args = ["prepare", "--source", str(corpus), "--tokenizer", "bytes", "--val_fraction", "0.1", "--shard_tokens", "1",
            "--num_proc", "1"]
    main([*args, "--out", str(tmp_path / "reference")])
    reference = json.loads((tmp_path / "reference/meta.json").read_text())
    real_fsync, full = os.fsync, {"name": "meta.json.tmp-"}

    def fsync(fd):
        if full["name"] in os.readlink(f"/proc/self/fd/{fd}"):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    out = tmp_path / "out"
    assert_mentions(one_error_line([*args, "--out", str(out)], capsys), f"cannot write to '{out}'", "disk full",
                    "free space", "run the same ltcx prepare command again", "nothing was written")
    assert not out.exists()
    full["name"] = "train_000001.bin.tmp-"
    assert_mentions(one_error_line([*args, "--out", str(out)], capsys), f"cannot write to '{out}'", "disk full",
                    "free space", "run the same ltcx prepare command again", "resumes")
    half = json.loads((out / "meta.json").read_text())
    assert not half["complete"] and len(half["shards"]["train"]) == 1
    assert not [f for f in os.listdir(out) if ".tmp" in f]
    monkeypatch.setattr(os, "fsync", real_fsync)
    main([*args, "--out", str(out)])
    resumed = json.loads((out / "meta.json").read_text())
    assert {k: v for k, v in resumed.items() if k != "resume"} == {
        k: v for k, v in reference.items() if k != "resume"}


@pytest.mark.parametrize("flag,value", [("--num_proc", "0"), ("--shard_tokens", "0"), ("--max_tokens", "-5")])
def test_prepare_refuses_counts_below_one(tmp_path, corpus, capsys, flag, value):
    out = tmp_path / "out"
    line = one_error_line(["prepare", "--source", str(corpus[0]), "--out", str(out), flag, value], capsys)
    assert line == f"ltcx: error: {flag} must be >= 1, not {value}"  # all facts: the flag, the rule, the value
    assert not out.exists()


def test_no_data_files_names_the_callers_flag(tmp_path, capsys):
    missing = tmp_path / "nope"
    with pytest.raises(LtcxError) as info:
        TextDataModule(path=str(missing), tokenizer="bytes").setup("fit")
    assert_mentions(str(info.value), f"no data files match '{missing}'", "--data.path", ".txt/.jsonl/.parquet")
    line = one_error_line(["prepare", "--source", str(missing), "--out", str(tmp_path / "out"), "--num_proc", "1"],
                          capsys)
    assert_mentions(line, f"no data files match '{missing}'", "--source", ".txt/.jsonl/.parquet")
    write_jsonl(tmp_path / "a.jsonl", ["some text"])
    line = one_error_line(["prepare", "--source", str(tmp_path / "a.jsonl"), "--out", str(tmp_path / "out"),
                           "--text_column", "body", "--tokenizer", "bytes"], capsys)
    assert_mentions(line, "'body'", "columns: 'text'", "--text_column")
    assert not (tmp_path / "out").exists()


# ---------------------------------------------------------------- the shard data mode
@pytest.mark.parametrize("num_workers", [0, 2])
@pytest.mark.parametrize("nodes,devices", [(1, 2), (2, 2)])
def test_epochs_are_disjoint_across_ranks_and_workers_without_replacement(tmp_path, corpus, nodes, devices,
                                                                           num_workers):
    out, meta = prepared(tmp_path, corpus)
    world = nodes * devices
    train_docs = shard_docs(out, meta, "train")
    dm = shard_dm(out, num_workers=num_workers, batch_size=3)
    epochs = []
    for rank in range(world):  # global rank = node * devices + local rank, as Lightning numbers them
        dm.trainer = SimpleNamespace(global_rank=rank, world_size=world)
        per_epoch = dm.train_dataset().blocks_per_rank
        assert per_epoch == len(train_docs) // world
        batches = list(zip(range(2 * per_epoch // 3 + 1), dm.train_dataloader()))
        seen = block_ids(b for _, b in batches)
        epochs.append((seen[:per_epoch], seen[per_epoch : 2 * per_epoch]))
    for e in (0, 1):
        blocks = [b for rank_epochs in epochs for b in rank_epochs[e]]
        assert len(blocks) == len(set(blocks)) == world * per_epoch  # disjoint, no block twice in an epoch
        assert set(blocks) <= set(train_docs)
    assert epochs[0][0] != epochs[0][1]  # each epoch has its own order


@pytest.mark.parametrize("sampling", ["blocks", "random"])
def test_resume_is_exact_and_reads_nothing_it_skips(tmp_path, corpus, sampling):
    out, _ = prepared(tmp_path, corpus)
    dm = shard_dm(out, sampling=sampling, num_workers=2)
    reference = [b for _, b in zip(range(40), dm.train_dataloader())]  # crosses several epochs
    for consumed in (1, 7, 33):
        resumed = shard_dm(out, sampling=sampling, num_workers=2)
        resumed.load_state_dict({"train_batches_consumed": consumed})
        got = [b for _, b in zip(range(40 - consumed), resumed.train_dataloader())]
        assert all(torch.equal(a, b) for a, b in zip(got, reference[consumed:]))
    far = shard_dm(out, sampling=sampling).train_dataset(skip_batches=10**9)
    start = time.perf_counter()
    batch = next(iter(far))
    # Position arithmetic, not a replay: replaying 10^9 batches would take days; a minute is slack for any load.
    assert time.perf_counter() - start < 60 and batch.shape == (2, B + 1)


def test_random_offsets_stay_inside_shards(tmp_path, corpus):
    out, meta = prepared(tmp_path, corpus)
    shards = [np.fromfile(out / s["file"], dtype="<u2", offset=HEADER_BYTES).tobytes() for s in meta["shards"]["train"]]
    dm = shard_dm(out, sampling="random")
    ranks = [dm.train_dataset(r, 2) for r in (0, 1)]
    for batch in (ranks[0].batch(0), ranks[0].batch(5), ranks[1].batch(0)):
        for row in batch:  # a window of one shard
            assert any(row.numpy().astype("<u2").tobytes() in shard for shard in shards)
    assert not torch.equal(ranks[0].batch(0), ranks[1].batch(0))  # ranks draw independently
    assert torch.equal(ranks[0].batch(3), shard_dm(out, sampling="random").train_dataset(0, 2).batch(3))


def test_validation_batches_are_fixed_and_disjoint(tmp_path, corpus):
    out, meta = prepared(tmp_path, corpus)
    dm = shard_dm(out, val_batches=3, batch_size=2, num_workers=2)
    per_rank = []
    for rank in (0, 1):
        loader = DataLoader(dm.val_dataset(rank, 2), batch_size=None, num_workers=2)
        assert len(loader) == 3
        per_rank.append(block_ids(loader))
        assert block_ids(dm.val_dataset(rank, 2)) == per_rank[-1]  # the same without workers
    assert not set(per_rank[0]) & set(per_rank[1])
    assert set(per_rank[0]) | set(per_rank[1]) <= set(shard_docs(out, meta, "validation"))


def test_shard_mode_errors(tmp_path, corpus):
    out, _ = prepared(tmp_path, corpus)
    with pytest.raises(LtcxError) as info:
        shard_dm(out, tokenizer="gpt2")
    assert_mentions(str(info.value), "tokenizer 'bytes'", "'gpt2'", "--data.tokenizer")
    meta = json.loads((out / "meta.json").read_text())
    (out / "meta.json").write_text(json.dumps({**meta, "vocab_size": 300}))  # same name, other ids
    with pytest.raises(LtcxError) as info:
        shard_dm(out)
    assert_mentions(str(info.value), "tokenizer 'bytes'", "300 ids", "257", "prepare the data again")
    (out / "meta.json").write_text(json.dumps(meta))
    with pytest.raises(LtcxError, match=r"training shards .* too small") as info:
        shard_dm(out, block_size=4096).train_dataset()
    assert_mentions(str(info.value), "blocks of 4097 tokens", "1 rank")


def test_prepare_and_fit_on_shards_through_the_cli(tmp_path, monkeypatch, capsys):
    """`ltcx prepare` on the built-in sample, then `fit` on the folder it wrote, then an exact-position resume."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "argv", ["ltcx"])
    main(["prepare", "--source", "sample", "--out", "shards", "--num_proc", "1", "--val_fraction", "0.05"])
    assert "ltcx: prepared 'shards': " in capsys.readouterr().err
    args = [
        "fit", "--config", str(ROOT / "configs/gpt.yaml"), "--config", str(ROOT / "configs/trainer/smoke.yaml"),
        "--data.path", "shards", "--data.block_size", "32", "--data.batch_size", "2", "--data.val_batches", "1",
        "--trainer.val_check_interval", "2", "--trainer.enable_progress_bar", "false",
        "--model.backbone.init_args.n_layer", "1", "--model.backbone.init_args.n_embd", "32",
        "--model.backbone.init_args.n_head", "2", "--model.backbone.init_args.n_kv_head", "1",
        "--model.backbone.init_args.block_size", "32", "--model.warmup_steps", "2",
    ]
    main([*args, "--trainer.max_steps", "2"])
    main([*args, "--trainer.max_steps", "3", "--ckpt_path", "last"])
    state = torch.load(tmp_path / "checkpoints/gpt/version_1/last.ckpt", weights_only=False)  # the resumed run's folder
    assert state["global_step"] == 3 and state["TextDataModule"]["train_batches_consumed"] == 3


def test_prepare_reads_the_hub_path(tmp_path, monkeypatch):
    """The hub branch of prepare on a source with a train split only."""
    repo = hub_repo(tmp_path, monkeypatch, train=unit_docs(40))
    meta = prepare(str(repo), str(tmp_path / "out"), name=None, tokenizer="bytes", val_fraction=0.0, num_proc=1)
    assert shard_docs(tmp_path / "out", meta, "train") == unit_docs(40)
    assert meta["settings"]["split"] == "train" and meta["shards"]["validation"] == []
    with pytest.raises(LtcxError) as info:
        prepare(str(repo), str(tmp_path / "out2"), name=None, split="validation", tokenizer="bytes", num_proc=1)
    assert_mentions(str(info.value), "no split 'validation'", "splits: train", "--split")


def test_prepare_offline_hub_names_the_fix(tmp_path):
    with pytest.raises(LtcxError) as info:
        prepare(out=str(tmp_path / "out"), num_proc=1)  # FineWeb-Edu sample-10BT, offline in the tests
    assert_mentions(str(info.value), "cannot load data set 'HuggingFaceFW/fineweb-edu'", "Hugging Face hub",
                    "--source sample", "local .txt/.jsonl/.parquet files")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("damage", ["meta_not_json", "meta_a_list", "out_a_file"])
def test_prepare_names_a_damaged_out(tmp_path, corpus, capsys, damage):
    out = tmp_path / "out"
    if damage == "out_a_file":
        out.write_text("not a folder")
    else:
        out.mkdir()
        (out / "meta.json").write_text("{ broken" if damage == "meta_not_json" else "[1, 2]")
    line = one_error_line(["prepare", "--source", str(corpus[0]), "--out", str(out), "--num_proc", "1"], capsys)
    assert "--out a new or empty folder" in line
    assert ("is a file, not a folder" if damage == "out_a_file" else "meta.json") in line
