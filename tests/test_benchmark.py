"""scripts/benchmark.py runs end to end on tiny overrides of two configs and reports every column it names."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_benchmark_reports_training_decode_and_cache_columns(tmp_path):
    out = tmp_path / "bench.json"
    gpt, gta = "gpt:n_layer=1,n_embd=32,n_head=2,n_kv_head=1", "gta:n_layer=1,n_embd=32,n_head=2,key_dim=8,latent_dim=8"
    archs = [gpt, gpt, gta]  # the same architecture twice is allowed: its copies measure the noise
    command = [sys.executable, str(ROOT / "scripts/benchmark.py"), "--archs", *archs, "--batch_size", "2",
               "--seq_len", "16", "--repeats", "1", "--decode_at", "8", "--decode_batch", "3", "--threads", "1",
               "--peak_flops", "1e9", "--out", str(out)]
    run = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    results = json.loads(out.read_text())["results"]
    assert [r["arch"] for r in results] == [gpt, gpt + "'", gta]
    for r in results:
        assert r["train_tokens_per_s"] > 0 and r["decode_ms_per_token"] > 0 and r["decode_ms_at_8"] > 0
    # cache bytes per token: GPT 2 (k, v) x 1 KV head x 16 wide; GTA 1 key head x 8 + 1 latent head x 8; float32
    assert [r["state_bytes_per_token"] for r in results] == [2 * 16 * 4, 2 * 16 * 4, (8 + 8) * 4]
    assert "decode_ms_at_8" in run.stdout
