"""scripts/benchmark.py runs end to end on tiny overrides of two configs and reports every column it names; nanoGPT's
model.py (a local copy, here a stand-in with its interface) is timed in the same rounds; peak memory per model."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
GPT = "gpt:n_layer=1,n_embd=32,n_head=2,n_kv_head=1"

# nanoGPT's interface (GPTConfig's fields, GPT(config), forward(idx, targets) -> (logits, loss)); it records the
# shape it was given beside itself.
NANOGPT_STANDIN = '''
import json, pathlib
from dataclasses import asdict, dataclass
import torch, torch.nn as nn, torch.nn.functional as F

@dataclass
class GPTConfig:
    block_size: int = 1024
    vocab_size: int = 50304
    n_layer: int = 12
    n_head: int = 12
    n_embd: int = 768
    dropout: float = 0.0
    bias: bool = True

class GPT(nn.Module):
    def __init__(self, config):
        super().__init__()
        pathlib.Path(__file__).with_name("config.json").write_text(json.dumps(asdict(config)))
        self.wte = nn.Embedding(config.vocab_size, config.n_embd)
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)

    def forward(self, idx, targets=None):
        logits = self.lm_head(self.wte(idx))
        return logits, F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1), ignore_index=-1)
'''


def _run(*arguments: str, timeout: int = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(ROOT / "scripts/benchmark.py"), *arguments], capture_output=True,
                          text=True, timeout=timeout)


def test_benchmark_reports_training_decode_and_cache_columns(tmp_path):
    out = tmp_path / "bench.json"
    gta = "gta:n_layer=1,n_embd=32,n_head=2,key_dim=8,latent_dim=8"
    archs = [GPT, GPT, gta]  # the same architecture twice is allowed: its copies measure the noise
    run = _run("--archs", *archs, "--batch_size", "2", "--seq_len", "16", "--repeats", "1", "--decode_at", "8",
               "--decode_batch", "3", "--threads", "1", "--peak_flops", "1e9", "--out", str(out))
    assert run.returncode == 0, run.stderr
    data = json.loads(out.read_text())
    results = data["results"]
    assert [r["arch"] for r in results] == [GPT, GPT + "'", gta]
    for r in results:
        assert r["train_tokens_per_s"] > 0 and r["decode_ms_per_token"] > 0 and r["decode_ms_at_8"] > 0
    assert results[0]["vs_first"] == 1.0
    # cache bytes per token: GPT 2 (k, v) x 1 KV head x 16 wide; GTA 1 key head x 8 + 1 latent head x 8; float32
    assert [r["state_bytes_per_token"] for r in results] == [2 * 16 * 4, 2 * 16 * 4, (8 + 8) * 4]
    assert "decode_ms_at_8" in run.stdout
    # the stamp: commit, command, machine, load
    assert data["meta"]["command"].startswith("python scripts/benchmark.py --archs")
    assert data["meta"]["commit"] and data["meta"]["machine"] and "load average" in run.stdout


def test_nanogpt_is_timed_in_the_same_rounds_at_the_gpts_shape(tmp_path):
    model_py = tmp_path / "model.py"
    model_py.write_text(NANOGPT_STANDIN)
    out = tmp_path / "bench.json"
    run = _run("--archs", GPT, "--nanogpt", str(model_py), "--batch_size", "2", "--seq_len", "16", "--repeats", "1",
               "--threads", "1", "--vocab_size", "96", "--out", str(out))
    assert run.returncode == 0, run.stderr
    results = json.loads(out.read_text())["results"]
    assert [r["arch"] for r in results] == [GPT, "nanogpt"]
    assert results[1]["train_tokens_per_s"] > 0 and results[1]["vs_first"] > 0
    config = json.loads((tmp_path / "config.json").read_text())
    assert config == {"block_size": 16, "vocab_size": 96, "n_layer": 1, "n_head": 2, "n_embd": 32, "dropout": 0.0,
                      "bias": False}


@pytest.mark.parametrize("case", ["missing", "not_nanogpt", "no_gpt"])
def test_nanogpt_problems_are_one_line_and_write_nothing(tmp_path, case):
    model_py = tmp_path / "model.py"
    archs = [GPT]
    if case == "not_nanogpt":
        model_py.write_text("x = 1\n")
    elif case == "no_gpt":
        model_py.write_text(NANOGPT_STANDIN)
        archs = ["gta:n_layer=1,n_embd=32,n_head=2,key_dim=8,latent_dim=8"]
    out = tmp_path / "bench.json"
    run = _run("--archs", *archs, "--nanogpt", str(model_py), "--out", str(out), timeout=120)
    expected = {"missing": "no such file", "not_nanogpt": "no GPT and GPTConfig", "no_gpt": "name gpt among --archs"}
    assert run.returncode == 2
    assert run.stderr.strip().count("\n") == 0 and run.stderr.startswith("benchmark: error: ")
    assert expected[case] in run.stderr
    assert not out.exists()


def test_peak_memory_runs_each_model_and_loss_path_in_its_own_process(tmp_path):
    out = tmp_path / "memory.json"
    run = _run("--archs", GPT, "--peak_memory", "--memory_loss", "fused", "full", "--batch_size", "2",
               "--seq_len", "16", "--threads", "1", "--out", str(out))
    assert run.returncode == 0, run.stderr
    results = json.loads(out.read_text())["results"]
    assert [(r["arch"], r["loss"]) for r in results] == [(GPT, "fused"), (GPT, "full")]
    for r in results:
        assert r["peak_rss_mb"] >= r["rss_before_mb"] > 0
