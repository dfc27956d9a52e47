"""scripts/benchmark.py runs end to end on tiny overrides of two configs and reports every column it names; nanoGPT's
model.py (a local copy, here a stand-in with its interface) is timed in the same rounds; peak memory per model."""

from __future__ import annotations

import json
import runpy
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from ltcx.models import titans

ROOT = Path(__file__).resolve().parents[1]
GPT = "gpt:n_layer=1,n_embd=32,n_head=2,n_kv_head=1"

# nanoGPT's interface (GPTConfig's fields, GPT(config), forward(idx, targets) -> (logits, loss), its
# configure_optimizers, which prints); it records the shape it was given beside itself.
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

    def configure_optimizers(self, weight_decay, learning_rate, betas, device_type):
        print("using fused AdamW: False")
        return torch.optim.AdamW(self.parameters(), lr=learning_rate, betas=betas, weight_decay=weight_decay)
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


def test_profile_reports_each_models_op_calls_and_top_ops(tmp_path):
    out = tmp_path / "profile.json"
    run = _run("--archs", GPT, "--batch_size", "2", "--seq_len", "16", "--threads", "1", "--profile", "3",
               "--out", str(out))
    assert run.returncode == 0, run.stderr
    [result] = json.loads(out.read_text())["results"]
    assert result["arch"] == GPT and result["op_calls"] > 0 and len(result["top_ops"]) == 3
    shares = [op["self_share"] for op in result["top_ops"]]
    assert shares == sorted(shares, reverse=True) and 0 < sum(shares) <= 1
    assert "mm" in {op["op"] for op in result["top_ops"]} and "op calls" in run.stdout


def test_free_memory_op_times_titans_with_its_memory_op_replaced(tmp_path, monkeypatch):
    """--free_memory_op: a row for each Titans model (none for the GPT), whose step runs the stand-in instead of
    neural_memory, and only while that step runs."""
    out = tmp_path / "free.json"
    mag = "titans_mag:n_layer=1,n_embd=32,n_head=2,n_kv_head=1,mem_heads=2,mem_head_dim=16,mem_hidden=32,window=8"
    run = _run("--archs", GPT, mag, "--batch_size", "2", "--seq_len", "16", "--repeats", "1", "--threads", "1",
               "--free_memory_op", "--out", str(out))
    assert run.returncode == 0, run.stderr
    results = json.loads(out.read_text())["results"]
    assert [r["arch"] for r in results] == [GPT, mag, mag + " (free memory op)"]
    assert results[2]["train_tokens_per_s"] > 0 and results[2]["mfu"] is None  # not the model's FLOPs: no MFU
    benchmark = runpy.run_path(str(ROOT / "scripts/benchmark.py"), run_name="benchmark")
    saved_s = results[1]["train_step_s"] - results[2]["train_step_s"]
    backbone = benchmark["build_backbone"](mag, SimpleNamespace(width=None, vocab_size=64), 16)
    op_flops = 2 * 16 * backbone.memory_op_flops_per_token(16)  # the op's FLOPs over the time freeing it saves
    assert results[2]["memory_op_flop_rate"] == (pytest.approx(op_flops / saved_s) if saved_s > 0 else None)
    assert "memory_op_flop_rate" in run.stdout and "memory_op_flop_rate" not in results[1]
    assert results[2]["memory_op_s"] == pytest.approx(saved_s)
    assert results[2]["memory_op_products_s"] > 0 and results[2]["memory_op_alone_s"] > 0

    calls = []
    real = titans.neural_memory

    def counting(*a, **k):
        calls.append(1)
        return real(*a, **k)

    monkeypatch.setattr(titans, "neural_memory", counting)
    args = SimpleNamespace(width=None, vocab_size=64, seq_len=16, generate_tokens=0, batch_size=2, dtype="float32",
                           compile=False, free_memory_op=True)
    _, (eager, free) = benchmark["build_arch"](mag, args, torch.device("cpu"))
    free.step()
    assert calls == [] and titans.neural_memory is counting  # the stand-in ran, and the op is back after
    eager.step()
    assert calls == [1]


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
    assert "using fused AdamW" not in run.stdout  # nanoGPT's own optimizer, its print kept out of the table


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


XLSTM = "xlstm:n_embd=32,n_layer=2,n_head=2,slstm_n_head=2,chunk_size=8,slstm_at=[1]"

# NX-AI's xlstm package's interface (the config classes, xLSTMLMModel(config), reset_parameters, step(idx, state));
# it records the config it was given and holds ltcx's model of that shape, so the parameter counts agree.
NX_STANDIN = '''
import json, pathlib
from dataclasses import asdict, dataclass, field
import torch

@dataclass
class mLSTMLayerConfig:
    conv1d_kernel_size: int = 4
    qkv_proj_blocksize: int = 4
    num_heads: int = 4
    proj_factor: float = 2.0
    round_proj_up_to_multiple_of: int = 64

@dataclass
class sLSTMLayerConfig:
    backend: str = "cuda"
    num_heads: int = 4
    conv1d_kernel_size: int = 4
    bias_init: str = "powerlaw_blockdependent"

@dataclass
class FeedForwardConfig:
    proj_factor: float = 1.3
    act_fn: str = "gelu"
    round_proj_up_to_multiple_of: int = 64

@dataclass
class mLSTMBlockConfig:
    mlstm: mLSTMLayerConfig = None

@dataclass
class sLSTMBlockConfig:
    slstm: sLSTMLayerConfig = None
    feedforward: FeedForwardConfig = None

@dataclass
class xLSTMLMModelConfig:
    mlstm_block: mLSTMBlockConfig = None
    slstm_block: sLSTMBlockConfig = None
    context_length: int = -1
    num_blocks: int = 1
    embedding_dim: int = 128
    bias: bool = False
    slstm_at: list = field(default_factory=list)
    vocab_size: int = -1
    tie_weights: bool = False

class xLSTMLMModel(torch.nn.Module):
    def __init__(self, config):
        super().__init__()
        pathlib.Path(__file__).parents[1].joinpath("nx_config.json").write_text(json.dumps(asdict(config)))
        from ltcx.models.xlstm import XLSTM
        self.inner = XLSTM(n_embd=config.embedding_dim, n_layer=config.num_blocks,
                           slstm_at=config.slstm_at, n_head=config.mlstm_block.mlstm.num_heads,
                           slstm_n_head=config.slstm_block.slstm.num_heads, vocab_size=config.vocab_size)

    def reset_parameters(self):
        pass

    def step(self, idx, state=None):
        return self.inner(idx, state)
'''


def test_nx_ai_xlstm_is_timed_in_the_decode_rounds_at_the_xlstms_shape(tmp_path):
    (tmp_path / "nx/xlstm").mkdir(parents=True)
    (tmp_path / "nx/xlstm/__init__.py").write_text(NX_STANDIN)
    out = tmp_path / "bench.json"
    run = _run("--archs", XLSTM, "--nx_xlstm", str(tmp_path / "nx"), "--batch_size", "1", "--seq_len", "16",
               "--decode_at", "8", "--repeats", "1", "--threads", "1", "--vocab_size", "96", "--out", str(out))
    assert run.returncode == 0, run.stderr
    results = json.loads(out.read_text())["results"]
    assert [r["arch"] for r in results] == [XLSTM, "nx-ai xlstm"]
    assert results[1]["decode_ms_at_8"] > 0 and results[1]["params"] == results[0]["params"]
    config = json.loads((tmp_path / "nx/nx_config.json").read_text())
    assert (config["embedding_dim"], config["num_blocks"], config["slstm_at"], config["vocab_size"]) == (32, 2, [1], 96)
    assert config["slstm_block"]["slstm"]["backend"] == "vanilla" and config["context_length"] == 9
    assert config["mlstm_block"]["mlstm"]["num_heads"] == 2 and config["tie_weights"] is True


@pytest.mark.parametrize("case", ["missing", "no_xlstm", "no_decode"])
def test_nx_ai_problems_are_one_line_and_write_nothing(tmp_path, case):
    archs, decode = ([GPT] if case == "no_xlstm" else [XLSTM]), ([] if case == "no_decode" else ["--decode_at", "8"])
    if case != "missing":
        (tmp_path / "nx/xlstm").mkdir(parents=True)
        (tmp_path / "nx/xlstm/__init__.py").write_text(NX_STANDIN)
    out = tmp_path / "bench.json"
    run = _run("--archs", *archs, "--nx_xlstm", str(tmp_path / "nx"), *decode, "--out", str(out), timeout=120)
    expected = {"missing": "no xlstm package in it", "no_xlstm": "name xlstm among --archs",
                "no_decode": "give --decode_at"}
    assert run.returncode == 2
    assert run.stderr.strip().count("\n") == 0 and run.stderr.startswith("benchmark: error: "), run.stderr
    assert expected[case] in run.stderr
    assert not out.exists()


@pytest.mark.parametrize("variant", ["mag", "mac"])
def test_memory_op_products_are_every_product_the_op_runs_forward_and_backward(variant):
    """memory_op_times: the FLOPs of the products it times alone are those FlopCounterMode sees in the same op
    calls, forward and backward (MAC: one call per segment piece, the first from M_0), none counted twice."""
    from torch.utils.flop_counter import FlopCounterMode

    benchmark = runpy.run_path(str(ROOT / "scripts/benchmark.py"), run_name="benchmark")
    arch = (f"titans_{variant}:n_layer=1,n_embd=32,n_head=2,n_kv_head=1,mem_heads=2,mem_head_dim=16,mem_hidden=24,"
            "window=8,segment=8,memory_chunk_size=4")
    backbone = benchmark["build_backbone"](arch, SimpleNamespace(width=None, vocab_size=64), 19)
    batch = torch.randint(0, 64, (2, 20), generator=torch.Generator().manual_seed(0))
    step = benchmark["loss_step"](benchmark["trainable"](backbone), batch, benchmark["contextlib"].nullcontext())
    times = benchmark["memory_op_times"](step, torch.device("cpu"))

    real, counted = titans.neural_memory, []

    def counting(*args, **kwargs):  # the op's calls of the same step, each with its backward, counted
        args, kwargs = benchmark["_detached_copies"]((args, kwargs), {})
        with FlopCounterMode(display=False, custom_mapping={torch.ops.aten.baddbmm_: _baddbmm_flops}) as counter:
            y, _ = real(*args, **kwargs)
            y.backward(torch.ones_like(y))
        counted.append(counter.get_total_flops())
        return real(*args, **kwargs)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(titans, "neural_memory", counting)
        step()
    assert len(counted) == (3 if variant == "mac" else 1) and times["memory_op_products_flops"] == sum(counted)
    assert times["memory_op_products_s"] > 0 and times["memory_op_alone_s"] > 0  # timings: no comparison


def _baddbmm_flops(input_shape, batch1_shape, batch2_shape, *_, **__) -> int:
    b, m, k = batch1_shape
    return 2 * b * m * k * batch2_shape[-1]


def test_products_alone_times_every_product_of_a_training_step(tmp_path):
    """--products_alone: each eager model's step gets its products' time alone and their share of the step; their
    FLOPs are the matrix products FlopCounterMode sees in a step (the fused head's included)."""
    from torch.utils.flop_counter import FlopCounterMode

    out = tmp_path / "products.json"
    run = _run("--archs", GPT, "--batch_size", "2", "--seq_len", "16", "--repeats", "1", "--threads", "1",
               "--vocab_size", "96", "--products_alone", "--out", str(out))
    assert run.returncode == 0, run.stderr
    [result] = json.loads(out.read_text())["results"]
    assert 0 < result["products_alone_s"] and result["products_share"] == pytest.approx(
        result["products_alone_s"] / result["train_step_s"]) and "products_share" in run.stdout

    benchmark = runpy.run_path(str(ROOT / "scripts/benchmark.py"), run_name="benchmark")
    args = SimpleNamespace(width=None, vocab_size=96, seq_len=16, generate_tokens=0, batch_size=2, dtype="float32",
                           compile=False, free_memory_op=False)
    _, (trainee,) = benchmark["build_arch"](GPT, args, torch.device("cpu"))
    flops, _ = benchmark["products_alone"](trainee.step, torch.device("cpu"))
    with FlopCounterMode(display=False, custom_mapping={torch.ops.aten.baddbmm_: _baddbmm_flops}) as counter:
        trainee.step()
    products = {torch.ops.aten.mm, torch.ops.aten.bmm, torch.ops.aten.addmm, torch.ops.aten.baddbmm,
                torch.ops.aten.baddbmm_}
    counted = sum(n for op, n in counter.get_flop_counts()["Global"].items() if op in products)
    assert counted > 0 and flops == counted
