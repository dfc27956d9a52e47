"""Streamed text (``TextDataModule`` on local files, ``sample`` and hub ids): packing into blocks, the validation
split or hash hold-out, rank- and worker-disjoint reading under DDP, exact resume from stream positions, and each
data error's one line."""

import json
import os
import random
from types import SimpleNamespace

import pytest
import torch
from torch.utils.data import DataLoader

from helpers import assert_mentions, unit_docs
from ltcx.data import DataError, TextDataModule, in_holdout, in_test_holdout, pack_blocks
from ltcx.errors import ConfigError, LtcxError
from ltcx.tokenizers import get_tokenizer

B = 16  # block_size in most tests; blocks hold B + 1 tokens
TEST_FRACTION = 0.005  # data.test_fraction's default: a source without a test split trains without these documents


def trains_on(doc: str, holdout_fraction: float) -> bool:
    """Whether a document of a source with no validation or test split is a training document."""
    return not in_holdout(doc, holdout_fraction) and not in_test_holdout(doc, TEST_FRACTION)


# ---------------------------------------------------------------- helpers
def varied_docs(n: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    words = ["the", "cat", "sat", "on", "a", "mat", "héllo", "wörld", "日本", "🙂", "and", "then", "slept"]
    return [" ".join(rng.choice(words) for _ in range(rng.randint(1, 30))) + f" #{i}" for i in range(n)]


def write_txt(path, docs):
    path.write_text("\n\n".join(docs), encoding="utf-8")
    return path


def write_jsonl(path, docs, column="text"):
    with open(path, "w", encoding="utf-8") as f:
        for i, d in enumerate(docs):
            f.write(json.dumps({"id": i, column: d}) + "\n")
    return path


def write_parquet(path, docs, column="text"):
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"id": list(range(len(docs))), column: docs}), path)
    return path


def expected_blocks(docs, tokenizer="bytes", block_size=B):
    tok = get_tokenizer(tokenizer)
    return list(pack_blocks((tok.encode(d) + [tok.eot_id] for d in docs), block_size + 1))


def blocks_of(item):
    """The block(s) of a training item or batch (which also carries its stream position), or of a validation one."""
    return item["idx"] if isinstance(item, dict) else item


def as_lists(tensors):
    return [blocks_of(t).tolist() for t in tensors]


def doc_of(block) -> str:
    """The document of a one-block document (bytes tokenizer)."""
    block = blocks_of(block)
    ids = block.tolist() if hasattr(block, "tolist") else block
    assert ids[-1] == 256
    return bytes(ids[:-1]).decode()


def make_dm(path, **kw):
    kw.setdefault("tokenizer", "bytes")
    kw.setdefault("block_size", B)
    kw.setdefault("batch_size", 2)
    kw.setdefault("val_batches", 2)
    kw.setdefault("shuffle_buffer", 0)
    dm = TextDataModule(path=str(path), **kw)
    dm.setup("fit")
    return dm


def collect(dataset, num_workers=0):
    """Every sample of a single-pass dataset, through a DataLoader with `num_workers` workers."""
    if num_workers == 0:
        return list(dataset)
    return list(DataLoader(dataset, batch_size=None, num_workers=num_workers))


# ---------------------------------------------------------------- packing
def test_pack_blocks_loses_and_duplicates_nothing():
    rng = random.Random(0)
    for block_len in (1, 2, 7, 17, 100):
        docs = [[rng.randrange(1000) for _ in range(rng.randrange(0, 40))] + [999] for _ in range(rng.randrange(0, 30))]
        stream = [t for d in docs for t in d]
        blocks = list(pack_blocks(docs, block_len))
        assert all(len(b) == block_len for b in blocks)
        used = len(blocks) * block_len
        assert len(stream) - used < block_len
        assert [t for b in blocks for t in b] + stream[used:] == stream


def test_pack_blocks_exact_multiple_and_empty():
    assert list(pack_blocks([[1, 2], [3, 4]], 2)) == [[1, 2], [3, 4]]
    assert list(pack_blocks([[1, 2, 3, 4, 5]], 2)) == [[1, 2], [3, 4]]
    assert list(pack_blocks([], 3)) == []
    assert list(pack_blocks([[1]], 3)) == []


def test_holdout_is_deterministic_and_proportional():
    docs = varied_docs(4000)
    held = [d for d in docs if in_holdout(d, 0.1)]
    assert held == [d for d in docs if in_holdout(d, 0.1)]
    assert 250 < len(held) < 550
    assert not any(in_holdout(d, 0.0) for d in docs)


# ---------------------------------------------------------------- formats
@pytest.mark.parametrize("fmt", ["txt", "jsonl", "parquet"])
@pytest.mark.parametrize("tokenizer", ["bytes", "gpt2"])
def test_formats_produce_expected_blocks(tmp_path, fmt, tokenizer):
    docs = varied_docs(120)
    writer = {"txt": write_txt, "jsonl": write_jsonl, "parquet": write_parquet}[fmt]
    path = writer(tmp_path / f"corpus.{fmt}", docs)
    dm = make_dm(path, tokenizer=tokenizer, holdout_fraction=0.1)
    train_docs = [d for d in docs if trains_on(d, 0.1)]
    val_docs = [d for d in docs if in_holdout(d, 0.1)]
    assert 0 < len(val_docs) < len(docs)
    got = as_lists(dm.train_dataset(infinite=False))
    assert got == expected_blocks(train_docs, tokenizer)
    assert all(len(b) == B + 1 for b in got)
    val = as_lists(dm.val_dataset())
    want_val = expected_blocks(val_docs, tokenizer)
    assert len(val) == dm.val_batches * dm.batch_size
    assert val == (want_val * len(val))[: len(val)]


def test_txt_sample_by_line(tmp_path):
    path = tmp_path / "lines.txt"
    path.write_text("first line\nsecond line\n\nthird\n", encoding="utf-8")
    dm = make_dm(path, txt_sample_by="line", holdout_fraction=0.0, val_batches=0, block_size=4)
    docs = ["first line", "second line", "third"]
    assert as_lists(dm.train_dataset(infinite=False)) == expected_blocks(docs, block_size=4)


def test_folder_with_train_and_validation_files(tmp_path):
    train_docs, val_docs = unit_docs(10), unit_docs(3, start=100)
    (tmp_path / "data" / "sub").mkdir(parents=True)
    write_txt(tmp_path / "data" / "train.txt", train_docs[:6])
    write_txt(tmp_path / "data" / "sub" / "more.txt", train_docs[6:])
    write_txt(tmp_path / "data" / "validation.txt", val_docs)
    (tmp_path / "data" / "README.md").write_text("ignored")
    dm = make_dm(tmp_path / "data", holdout_fraction=0.5, val_batches=2, batch_size=2)
    assert sorted(doc_of(b) for b in dm.train_dataset(infinite=False)) == train_docs  # no hold-out applied
    assert [doc_of(b) for b in dm.val_dataset()] == val_docs + val_docs[:1]  # 4 blocks, cycled


def test_glob_and_test_named_files(tmp_path):
    write_jsonl(tmp_path / "train-000.jsonl", unit_docs(4))
    write_jsonl(tmp_path / "test-000.jsonl", unit_docs(2, start=50))
    dm = make_dm(tmp_path / "*.jsonl", val_batches=1)
    assert sorted(doc_of(b) for b in dm.train_dataset(infinite=False)) == unit_docs(4)
    assert [doc_of(b) for b in dm.val_dataset()] == unit_docs(2, start=50)


def test_single_file_holdout_is_disjoint_and_stable(tmp_path):
    docs = unit_docs(300)
    path = write_txt(tmp_path / "valid_looking_name.txt", docs)  # a single file is always training data

    def split(dm):
        train = [doc_of(b) for b in dm.train_dataset(infinite=False)]
        val = [doc_of(b) for b in dm.val_dataset()]
        return train, val

    dm = make_dm(path, holdout_fraction=0.05, val_batches=40, batch_size=1, shuffle_buffer=50)
    train, val = split(dm)
    held = [d for d in docs if in_holdout(d, 0.05)]
    tested = [d for d in docs if in_test_holdout(d, TEST_FRACTION)]
    assert held and set(val) == set(held)
    assert not set(train) & set(val)
    assert sorted(train + held + tested) == sorted(docs)
    assert split(make_dm(path, holdout_fraction=0.05, val_batches=40, batch_size=1, shuffle_buffer=50)) == (train, val)


# ---------------------------------------------------------------- ranks and workers
@pytest.mark.parametrize("layout", ["one_file", "four_files"])
@pytest.mark.parametrize("num_workers", [0, 2])
def test_ranks_and_workers_partition_the_data(tmp_path, layout, num_workers):
    docs = unit_docs(41)
    if layout == "one_file":
        write_txt(tmp_path / "all.txt", docs)
    else:
        for k in range(4):
            write_txt(tmp_path / f"part{k}.txt", docs[k::4])
    dm = make_dm(tmp_path, val_batches=0, shuffle_buffer=8, num_workers=num_workers)
    single = [doc_of(b) for b in dm.train_dataset(0, 1, infinite=False)]
    assert sorted(single) == docs
    per_rank = [[doc_of(b) for b in collect(dm.train_dataset(r, 2, infinite=False), num_workers)] for r in (0, 1)]
    assert all(per_rank)
    assert not set(per_rank[0]) & set(per_rank[1])
    assert sorted(per_rank[0] + per_rank[1]) == sorted(single)


def test_training_stream_is_endless_and_reshuffled(tmp_path):
    docs = unit_docs(8)
    dm = make_dm(write_txt(tmp_path / "a.txt", docs), val_batches=0, shuffle_buffer=100)
    stream = [doc_of(b) for b, _ in zip(dm.train_dataset(), range(24))]
    epochs = [stream[i : i + 8] for i in (0, 8, 16)]
    assert all(sorted(e) == docs for e in epochs)
    assert len({tuple(e) for e in epochs}) > 1  # each pass has its own order


# ---------------------------------------------------------------- validation
@pytest.mark.parametrize("num_workers", [0, 2])
def test_validation_has_exact_batches_on_every_rank(tmp_path, num_workers):
    write_txt(tmp_path / "train.txt", unit_docs(10))
    write_txt(tmp_path / "val.txt", unit_docs(3, start=100))  # rank 0 gets 2 documents, rank 1 gets 1
    dm = make_dm(tmp_path, val_batches=3, batch_size=2, num_workers=num_workers)
    seen = []
    for rank in (0, 1):
        loader = DataLoader(dm.val_dataset(rank, 2), batch_size=2, num_workers=num_workers)
        assert len(loader) == 3
        batches = list(loader)
        assert len(batches) == 3
        assert all(b.shape == (2, B + 1) and b.dtype == torch.long for b in batches)
        seen.append([doc_of(row) for b in batches for row in b])
    assert len(set(seen[0])) == 2 and len(set(seen[1])) == 1
    assert not set(seen[0]) & set(seen[1])
    # the same batches whatever the number of workers
    ref = make_dm(tmp_path, val_batches=3, batch_size=2, num_workers=0)
    assert [doc_of(row) for row in ref.val_dataset(0, 2)] == seen[0]


def test_val_dataloader_and_disabled_validation(tmp_path):
    path = write_txt(tmp_path / "a.txt", unit_docs(50))
    dm = make_dm(path, holdout_fraction=0.2, val_batches=2, batch_size=3)
    assert [b.shape for b in dm.val_dataloader()] == [torch.Size([3, B + 1])] * 2
    assert make_dm(path, val_batches=0).val_dataloader() == []


# ---------------------------------------------------------------- resume
@pytest.mark.parametrize("num_workers", [0, 2])
def test_resume_continues_exactly(tmp_path, num_workers):
    path = write_txt(tmp_path / "a.txt", unit_docs(11))
    kw = dict(val_batches=0, batch_size=2, shuffle_buffer=100, num_workers=num_workers)

    def batches(dm, n):
        return [blocks_of(b).tolist() for b, _ in zip(dm.train_dataloader(), range(n))]

    reference = batches(make_dm(path, **kw), 14)  # crosses several passes
    for n in (0, 3, 5, 9):  # a checkpoint without stream positions (older ltcx): re-tokenize and drop
        dm = make_dm(path, **kw)
        dm.load_state_dict({"train_batches_consumed": n})
        assert batches(dm, 14 - n) == reference[n:], n


@pytest.mark.parametrize("num_workers", [0, 2])
def test_resume_from_stream_positions_tokenizes_only_what_follows(tmp_path, num_workers, monkeypatch):
    """Each batch carries the stream position after it; resuming there reads the documents before it without
    tokenizing them, and continues exactly, also mid-document and across passes."""
    from ltcx.tokenizers import ByteTokenizer

    docs = [d * 3 for d in unit_docs(11)]  # 3 blocks a document (plus end-of-text): blocks end mid-document
    path = write_txt(tmp_path / "a.txt", docs)
    kw = dict(val_batches=0, batch_size=2, shuffle_buffer=100, num_workers=num_workers)
    dm = make_dm(path, **kw)
    reference, saved = [], []
    for step, (batch, _) in enumerate(zip(dm.train_dataloader(), range(30)), 1):  # about 3 passes
        reference.append(dm.on_before_batch_transfer(batch, 0).tolist())
        dm.trainer = SimpleNamespace(global_step=step, accumulate_grad_batches=1, global_rank=0, world_size=1)
        saved.append(dm.state_dict())
    import ltcx.data.text_stream as text_stream

    monkeypatch.setattr(text_stream, "_READ_BATCH", 1)  # tokenize document by document, to count them
    encoded = []
    encode_batch = ByteTokenizer.encode_batch
    monkeypatch.setattr(ByteTokenizer, "encode_batch",
                        lambda tok, texts: encoded.extend(texts) or encode_batch(tok, texts))
    for n in (1, 4, 17, 25):
        encoded.clear()
        dm = make_dm(path, **kw)
        dm.load_state_dict(saved[n - 1])
        got = [dm.on_before_batch_transfer(b, 0).tolist() for b, _ in zip(dm.train_dataloader(), range(2))]
        assert got == reference[n : n + 2], n
        if num_workers == 0:  # 2 batches of 2 blocks need at most 3 documents (plus one read ahead)
            assert len(encoded) <= 4, (n, len(encoded))
    dm = make_dm(path, **{**kw, "num_workers": num_workers + 2})
    dm.load_state_dict(saved[3])
    with pytest.raises(ConfigError) as info:
        dm.train_dataloader()
    assert_mentions(str(info.value), "same devices x num_nodes", "data.num_workers")


def test_state_dict_counts_consumed_batches(tmp_path):
    dm = make_dm(write_txt(tmp_path / "a.txt", unit_docs(4)), val_batches=0)
    assert dm.state_dict() == {"train_batches_consumed": 0}
    dm.trainer = SimpleNamespace(global_step=7, accumulate_grad_batches=3, global_rank=0, world_size=1)
    assert dm.state_dict() == {"train_batches_consumed": 21, "stream_positions": [[[-1, -1, -1]]],
                               "test_holdout": TEST_FRACTION}


def test_vocab_properties(tmp_path):
    dm = TextDataModule(path=str(tmp_path), tokenizer="gpt2")  # no setup needed
    assert (dm.vocab_size, dm.padded_vocab_size, dm.tokenizer_obj.eot_id) == (50257, 50304, 50256)
    assert TextDataModule(tokenizer="bytes", pad_vocab_to_multiple_of=1).padded_vocab_size == 257


# ---------------------------------------------------------------- errors
def one_line(exc_info) -> str:
    msg = str(exc_info.value)
    assert "\n" not in msg
    return msg


def test_error_missing_path(tmp_path):
    for path in (tmp_path / "nope.txt", tmp_path / "*.jsonl", tmp_path):
        with pytest.raises(LtcxError) as info:
            make_dm(path)
        assert_mentions(one_line(info), f"no data files match '{path}'", "--data.path", ".txt/.jsonl/.parquet")


def test_error_empty_file_and_blank_text(tmp_path):
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    with pytest.raises(LtcxError) as info:
        make_dm(empty)
    assert one_line(info).startswith(f"data file '{empty}' is empty")
    blank = tmp_path / "blank.jsonl"
    write_jsonl(blank, ["", "   ", "\n"])
    with pytest.raises(LtcxError) as info:
        make_dm(blank)
    assert_mentions(one_line(info), "no text", "train split", "column 'text'", "empty")


def test_error_unknown_column(tmp_path):
    path = write_jsonl(tmp_path / "a.jsonl", ["some text"], column="content")
    with pytest.raises(LtcxError) as info:
        make_dm(path)
    assert_mentions(one_line(info), "column 'text' not found", "train split", f"data files '{path}'",
                    "columns: 'id', 'content'", "--data.text_column")
    assert make_dm(path, text_column="content", val_batches=0)  # and the fix works


def test_error_mixed_types(tmp_path):
    write_txt(tmp_path / "a.txt", ["x"])
    write_jsonl(tmp_path / "b.jsonl", ["y"])
    with pytest.raises(LtcxError, match=r"different types.*\(\.jsonl, \.txt\)"):
        make_dm(tmp_path)


def test_error_unreachable_hub(hf_offline, no_backoff):
    with pytest.raises(LtcxError) as info:
        TextDataModule(path="no-such-user/no-such-dataset").setup("fit")
    msg = one_line(info)
    assert msg.startswith("cannot load data set 'no-such-user/no-such-dataset' from the Hugging Face hub (")
    assert msg.endswith(
        "); offline? use --data.path sample (a TinyStories sample shipped with ltcx) or point --data.path at local "
        ".txt/.jsonl/.parquet files"
    )


def test_error_unknown_tokenizer(tmp_path, hf_offline):
    path = write_txt(tmp_path / "a.txt", ["hello"])
    with pytest.raises(LtcxError) as info:
        make_dm(path, tokenizer="no-such-tokenizer-xyz")
    assert one_line(info).startswith(
        "unknown tokenizer 'no-such-tokenizer-xyz': use 'gpt2', 'bytes', "
        "or a Hugging Face tokenizer name/local folder ("
    )


@pytest.mark.parametrize("num_workers", [0, 2])
def test_error_data_too_small_for_a_rank(tmp_path, num_workers):
    dm = make_dm(write_txt(tmp_path / "a.txt", unit_docs(1)), val_batches=0, num_workers=num_workers)
    assert len(next(iter(dm.train_dataset(0, 2)))["idx"]) == B + 1  # rank 0 has the one document

    def first_batch_error():
        it = iter(DataLoader(dm.train_dataset(1, 2), batch_size=2, num_workers=num_workers))
        try:
            next(it)
        except Exception as exc:  # noqa: BLE001
            # Drop the traceback: it holds the loader iterator in a reference cycle, and torch's shutdown of
            # workers collected by gc (not by refcount) waits 5 s per worker.
            exc.__traceback__ = None
            return type(exc), str(exc)
        return None, ""

    kind, msg = first_batch_error()
    assert kind is DataError and issubclass(kind, LtcxError)
    assert_mentions(msg, "data set too small", "rank 1 of 2", f"block of {B + 1} tokens", "more data", "block_size",
                    "fewer devices/workers", *(["dataloader worker 0 of 2"] if num_workers else []))
    assert num_workers or "worker 0" not in msg


def test_error_validation_too_small(tmp_path):
    dm = make_dm(write_txt(tmp_path / "a.txt", ["tiny"]), holdout_fraction=0.999999, test_fraction=0.0,
                 val_batches=1)
    with pytest.raises(DataError, match="validation data too small") as info:
        list(dm.val_dataset())
    assert_mentions(str(info.value), "rank 0 of 1", "block of 17 tokens")


def test_error_bad_arguments():
    with pytest.raises(ConfigError) as info:
        TextDataModule(block_size=0)
    assert_mentions(str(info.value), "data.block_size=0", ">= 1", "--data.block_size")
    with pytest.raises(ConfigError, match="txt_sample_by"):
        TextDataModule(txt_sample_by="sentence")


# ---------------------------------------------------------------- with a Lightning Trainer
class _Recorder:
    """A tiny LightningModule that records the batches it trains and validates on."""

    @staticmethod
    def make():
        import lightning as L

        class Recorder(L.LightningModule):
            def __init__(self):
                super().__init__()
                self.emb = torch.nn.Embedding(257, 8)
                self.head = torch.nn.Linear(8, 257)
                self.train_seen, self.val_seen = [], []

            def loss(self, block):
                x, y = block[:, :-1], block[:, 1:]
                return torch.nn.functional.cross_entropy(self.head(self.emb(x)).flatten(0, 1), y.flatten())

            def training_step(self, block, i):
                self.train_seen.append(block.tolist())
                return self.loss(block)

            def validation_step(self, block, i):
                self.val_seen.append(block.tolist())
                return self.loss(block)

            def configure_optimizers(self):
                return torch.optim.SGD(self.parameters(), lr=0.1)

        return Recorder()


def test_trainer_fit_validate_and_resume(tmp_path):
    import lightning as L

    path = write_txt(tmp_path / "a.txt", unit_docs(30))
    ckpt = tmp_path / "step3.ckpt"

    class SaveAtStep3(L.Callback):
        def on_train_batch_end(self, trainer, *args):
            if trainer.global_step == 3 and not ckpt.exists():
                trainer.save_checkpoint(ckpt)  # mid-run, as ModelCheckpoint(every_n_train_steps=3) would

    def fit(ckpt_path=None, callbacks=()):
        trainer = L.Trainer(
            max_steps=8, accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
            enable_progress_bar=False, enable_model_summary=False, val_check_interval=4,
            check_val_every_n_epoch=None, num_sanity_val_steps=0, accumulate_grad_batches=2,
            default_root_dir=tmp_path, callbacks=list(callbacks),
        )
        model = _Recorder.make()
        dm = TextDataModule(
            path=str(path), tokenizer="bytes", block_size=B, val_batches=2, batch_size=2, shuffle_buffer=100,
            holdout_fraction=0.2,
        )
        trainer.fit(model, datamodule=dm, ckpt_path=ckpt_path)
        return model

    full = fit(callbacks=[SaveAtStep3()])
    assert len(full.train_seen) == 16  # 8 optimizer steps of 2 accumulated batches
    assert len(full.val_seen) == 2 * 4  # val_batches per validation run, a run every 4 training batches
    assert full.val_seen[:2] == full.val_seen[2:4]  # the same validation batches every time
    saved = torch.load(ckpt, weights_only=False)["TextDataModule"]
    assert saved["train_batches_consumed"] == 6 and len(saved["stream_positions"][0]) == 1
    resumed = fit(ckpt_path=str(ckpt))
    assert resumed.train_seen == full.train_seen[6:]


def test_hub_code_path_splits(tmp_path, monkeypatch, hf_offline):
    """The hub branch (load_dataset(path, name)) on a local repository-like folder: split selection and hold-out."""
    import ltcx.data.text_datasets as text_datasets

    monkeypatch.setattr(text_datasets, "looks_local", lambda path: False)
    monkeypatch.setattr(text_datasets, "hub_unreachable", lambda: None)  # the "hub" is this folder: reachable
    repo = tmp_path / "repo"
    repo.mkdir()
    write_parquet(repo / "train-00000-of-00001.parquet", unit_docs(40))
    write_parquet(repo / "validation-00000-of-00001.parquet", unit_docs(2, start=100))
    dm = make_dm(repo, val_batches=1)
    assert [doc_of(b) for b in dm.val_dataset()] == unit_docs(2, start=100)
    assert sorted(doc_of(b) for b in dm.train_dataset(infinite=False)) == unit_docs(40)
    # a split the set lacks: validate on a hold-out of the training documents
    dm = make_dm(repo, val_split="dev", val_batches=1, batch_size=1, holdout_fraction=0.2)
    held = [d for d in unit_docs(40) if in_holdout(d, 0.2)]
    assert held and [doc_of(b) for b in dm.val_dataset()] == held[:1]
    assert sorted(doc_of(b) for b in dm.train_dataset(infinite=False)) == sorted(
        d for d in unit_docs(40) if trains_on(d, 0.2))
    with pytest.raises(ConfigError) as info:
        make_dm(repo, train_split="training")
    assert_mentions(str(info.value), "no split 'training'", "splits: train, validation", "--data.train_split")


# ---------------------------------------------------------------- the built-in sample
def test_sample_path_is_the_shipped_tinystories_sample(tmp_path, monkeypatch):
    from ltcx.data.files import SAMPLE_DIR, resolve_local_files

    monkeypatch.chdir(tmp_path)
    files = resolve_local_files("sample")
    assert [os.path.basename(f) for f in files.train + files.validation] == ["train.txt", "validation.txt"]
    assert all(os.path.dirname(f) == SAMPLE_DIR for f in files.train + files.validation)
    assert 250_000 < os.path.getsize(files.train[0]) < 400_000
    assert 40_000 < os.path.getsize(files.validation[0]) < 60_000
    dm = make_dm("sample", tokenizer="gpt2", block_size=128, batch_size=4, val_batches=2)
    block = next(iter(dm.train_dataset()))["idx"]
    text = dm.tokenizer_obj.decode(block.tolist())
    assert block.shape == (129,) and text.isascii() and " the " in text
    assert len(as_lists(dm.val_dataset())) == 8
    # a folder named "sample" in the working directory is the user's data and wins
    (tmp_path / "sample").mkdir()
    write_txt(tmp_path / "sample" / "mine.txt", unit_docs(3))
    assert sorted(doc_of(b) for b in make_dm("sample", val_batches=0).train_dataset(infinite=False)) == unit_docs(3)
