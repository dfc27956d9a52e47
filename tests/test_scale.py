"""Beyond one machine: the FSDP config builds ltcx's FSDP2Strategy for several nodes; 2 nodes x 2 devices read
disjoint data. (FSDP2 training itself: tests/test_sharding.py.)"""

import sys
from pathlib import Path
from types import SimpleNamespace

import lightning as L
import pytest
import yaml
from lightning.pytorch.strategies import ModelParallelStrategy

from ltcx.cli import main
from ltcx.data import TextDataModule
from ltcx.sharding import FSDP2Strategy

ROOT = Path(__file__).resolve().parents[1]


def test_fsdp_config_builds_ltcx_fsdp2_strategy(monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["ltcx"])
    with pytest.raises(SystemExit):
        main(["fit", "--config", str(ROOT / "configs/gpt.yaml"), "--config", str(ROOT / "configs/trainer/fsdp.yaml"),
              "--trainer.num_nodes", "2", "--print_config"])
    trainer = yaml.safe_load(capsys.readouterr().out)["trainer"]
    assert (trainer["accelerator"], trainer["devices"], trainer["num_nodes"]) == ("gpu", -1, 2)
    assert trainer["strategy"]["class_path"] == "ltcx.sharding.FSDP2Strategy"
    strategy = FSDP2Strategy(**trainer["strategy"]["init_args"])
    assert isinstance(strategy, ModelParallelStrategy) and not strategy._save_distributed_checkpoint
    assert strategy._tensor_parallel_size == 1
    # Unlike Lightning's FSDPStrategy (FSDP1), it runs on CPUs: tests/test_sharding.py trains with it over gloo.
    trainer = L.Trainer(accelerator="cpu", devices=2, num_nodes=2, strategy=strategy, logger=False)
    assert trainer.world_size == 4 and trainer.strategy is strategy


def test_two_nodes_of_two_devices_read_disjoint_text(tmp_path):
    docs = [f"document number {i:05d} of the corpus" for i in range(203)]
    (tmp_path / "corpus.txt").write_text("\n\n".join(docs))
    trainer = L.Trainer(accelerator="cpu", devices=2, num_nodes=2, strategy="ddp", logger=False)
    assert trainer.world_size == 4  # what each process's data module is told, with global ranks 0..3
    dm = TextDataModule(path=str(tmp_path / "corpus.txt"), tokenizer="bytes", block_size=7, val_batches=0,
                        shuffle_buffer=16, batch_size=2)
    per_rank = []
    for node in range(2):
        for local_rank in range(2):
            dm.trainer = SimpleNamespace(global_rank=node * 2 + local_rank, world_size=4)
            stream = [t for b in dm.train_dataset(infinite=False) for t in b["idx"].tolist()]
            *whole, _tail = bytes(t if t != 256 else 0 for t in stream).split(b"\0")  # the tail was cut short
            per_rank.append({d.decode() for d in whole})
    assert all(per_rank) and sum(map(len, per_rank)) == len(set().union(*per_rank))  # no document on two ranks
    assert len(set().union(*per_rank)) >= len(docs) - 4 and set().union(*per_rank) <= set(docs)
