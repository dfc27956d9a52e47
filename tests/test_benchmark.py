"""scripts/benchmark.py end to end at a tiny shape: every question writes its results file with its stamp and its
rows, ``tables`` regenerates a page's tables from them (replacing, never appending), and the tables in
docs/benchmarks.md are what the generator makes from docs/results/ (so they cannot drift). nanoGPT's model.py (a local
copy, here a stand-in with its interface) is timed in the training rounds."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts/benchmark.py"
TINY = ["--width", "32", "--n_layer", "1", "--head_dim", "16", "--batch_size", "2", "--seq_len", "16",
        "--vocab_size", "96", "--repeats", "2", "--threads", "1"]

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


def benchmark_module():
    spec = importlib.util.spec_from_file_location("benchmark", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def run(*arguments: str, timeout: int = 600) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), *arguments], capture_output=True, text=True, timeout=timeout)


def test_every_question_writes_its_results_file_and_tables_are_regenerated_in_place(tmp_path):
    out = tmp_path / "results"
    for question, extra in (("training", []), ("kernels", ["--batch_sizes", "1", "2"]), ("memory", []),
                            ("decode", ["--decode_at", "4", "8"])):
        archs = ["gpt", "titans_mag"] if question == "training" else ["gpt"]
        done = run(question, "--archs", *archs, *TINY, *extra, "--out", str(out))
        assert done.returncode == 0, done.stderr[-3000:]
        data = json.loads((out / f"{question}.json").read_text())
        stamp = data["stamp"]
        assert stamp["command"].startswith(f"python scripts/benchmark.py {question}")
        assert stamp["commit"] and stamp["date"] and stamp["machine"]["threads"] == 1
        assert {"cpu", "cores", "torch"} <= set(stamp["machine"])
        assert [row["arch"] for row in data["rows"]] == archs
    training = json.loads((out / "training.json").read_text())["rows"]
    assert training[0]["vs_gpt_cpu"] == 1.0 and training[0]["vs_gpt_wall"] == 1.0
    assert all(r["step_s"] > 0 and r["step_cpu_s"] > 0 and r["mfu"] > 0 for r in training)
    kernels = json.loads((out / "kernels.json").read_text())["rows"][0]
    assert kernels["tiny"] > 0 and kernels["recall"] > 0 and kernels["b1"] > 0 and kernels["b2"] > 0
    assert kernels["fused_backends"] == {} and kernels["fused"] == kernels["b1"]  # a GPT is its own fused form
    assert kernels["fused_recall"] == kernels["recall"]
    memory = json.loads((out / "memory.json").read_text())["rows"][0]
    assert memory["peak_rss_mb"] >= memory["rss_before_mb"] > 0
    decode = json.loads((out / "decode.json").read_text())["rows"][0]
    assert decode["cpu_ms_at_8"] > 0 and decode["state_kib_at_8"] == 2 * decode["state_kib_at_4"]  # a KV cache

    page = tmp_path / "page.md"
    page.write_text("intro\n<!-- table:training -->\nold text\n<!-- /table -->\nmiddle\n<!-- table:decode -->\n"
                    "<!-- /table -->\nend\n")
    for _ in range(2):  # the second run replaces the first run's tables: nothing appended
        done = run("tables", "--out", str(out), "--docs", str(page))
        assert done.returncode == 0, done.stderr
    text = page.read_text()
    assert "old text" not in text and text.count("| titans_mag |") == 1 and text.count("Measured: commit") == 2
    assert text.startswith("intro\n") and "\nmiddle\n" in text and text.endswith("end\n")


def test_tables_name_the_missing_results_file(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("<!-- table:memory -->\n<!-- /table -->\n")
    done = run("tables", "--out", str(tmp_path), "--docs", str(page), timeout=120)
    assert done.returncode == 2 and "memory.json" in done.stderr and "benchmark.py memory" in done.stderr


def test_docs_tables_are_generated_from_the_results_files():
    docs = (ROOT / "docs/benchmarks.md").read_text()
    benchmark = benchmark_module()
    assert "<!-- table:" in docs
    assert benchmark.render(docs, ROOT / "docs/results") == docs, \
        "docs/benchmarks.md's tables differ from docs/results/: run `python scripts/benchmark.py tables`"


def test_nanogpt_is_timed_in_the_same_rounds_at_the_gpts_shape(tmp_path):
    model_py = tmp_path / "model.py"
    model_py.write_text(NANOGPT_STANDIN)
    done = run("training", "--archs", "gpt", "--nanogpt", str(model_py), *TINY, "--out", str(tmp_path))
    assert done.returncode == 0, done.stderr[-3000:]
    rows = json.loads((tmp_path / "training.json").read_text())["rows"]
    assert [r["arch"] for r in rows] == ["gpt", "nanogpt"] and rows[1]["vs_gpt_cpu"] > 0
    config = json.loads((tmp_path / "config.json").read_text())
    assert (config["n_layer"], config["n_embd"], config["block_size"], config["vocab_size"]) == (1, 32, 16, 96)
    assert "using fused AdamW" not in done.stdout  # nanoGPT's own print kept out of the table


@pytest.mark.parametrize("case", ["missing", "not_nanogpt", "no_gpt"])
def test_nanogpt_problems_are_one_line_and_write_nothing(tmp_path, case):
    model_py = tmp_path / "model.py"
    archs = ["gpt"]
    if case == "not_nanogpt":
        model_py.write_text("x = 1\n")
    elif case == "no_gpt":
        model_py.write_text(NANOGPT_STANDIN)
        archs = ["gta"]
    done = run("training", "--archs", *archs, "--nanogpt", str(model_py), *TINY, "--out", str(tmp_path),
               timeout=300)
    expected = {"missing": "no such file", "not_nanogpt": "GPTConfig", "no_gpt": "name gpt among --archs"}
    assert done.returncode == 2 and done.stderr.startswith("benchmark: error: ")
    assert done.stderr.strip().count("\n") == 0 and expected[case] in done.stderr
    assert not (tmp_path / "training.json").exists()
