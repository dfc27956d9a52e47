"""scripts/gpu_check.py, which no GPU has run yet, kept from rotting: its ``--tiny`` mode end to end on the CPU
(the fused kernels against their torch forms in Triton's interpreter, every catalogue entry with every figure of its
eager, compiled and fused forms, the DDP fit and the bf16 generate through the CLI, the JSON and the Markdown
tables), a budget too small for anything (every gap recorded, the report still written), and the pieces that say
which attention kernel ran, how many kernels ran and how a failed measurement is reported."""

from __future__ import annotations

import importlib.util
import json
import math
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from helpers import ROOT
from ltcx.models.catalog import CATALOG

SCRIPT = ROOT / "scripts/gpu_check.py"
FORMS = ["eager", "compiled", "fused"]
TRAINING = [f"{form}_{figure}" for form in FORMS for figure in ("tokens_per_s", "peak_memory_mb", "device_kernels")]
FIELDS = ["params", "context", *TRAINING, "eager_kernels_per_step", "fused_kernels_per_step", "mfu", "compile_s",
          "peak_memory_full_logits_mb", "decode_ms_b1_at_8", "decode_ms_b2_at_8", "decode_ms_b1_at_80",
          "decode_ms_b2_at_80", "sdpa_train", "sdpa_decode", "best_form", "vs_gpt"]
FUSED = {"xlstm", "titans_mag", "titans_mac", "titans_mal", "titans_lmm"}  # the entries with a Triton backend
HAS_TRITON = importlib.util.find_spec("triton") is not None


def gpu_check_module():
    """The script as a module (it is not a package's)."""
    spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def run_check(tmp_path, *args: str) -> subprocess.CompletedProcess:
    environment = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, str(SCRIPT), "--tiny", "--threads", "1", "--out", str(tmp_path / "check"),
                           *args], cwd=tmp_path, env=environment, capture_output=True, text=True, timeout=900)


def tables_of(markdown: str) -> list[list[list[str]]]:
    """The Markdown's tables, each a list of rows of cells (the head and the |---| line included)."""
    tables, previous = [], False
    for line in markdown.splitlines():
        if line.startswith("|"):
            if not previous:
                tables.append([])
            tables[-1].append([c.strip() for c in line.strip("|").split("|")])
        previous = line.startswith("|")
    return tables


def test_tiny_check_reports_every_model_and_field_and_the_cli_checks(tmp_path):
    run = run_check(tmp_path, "--ddp_processes", "1")
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    report = json.loads((tmp_path / "check.json").read_text())
    meta = report["meta"]
    assert meta["fields"] == FIELDS
    assert meta["torch"] == torch.__version__ and meta["commit"] and "--tiny" in meta["command"]
    assert [r["arch"] for r in report["results"]] == list(CATALOG)
    kernels = {(row["kernel"], row["dtype"]): row for row in report["kernels"]}
    assert list(kernels) == [("titans_memory", "float32"), ("titans_memory", "bf16"), ("slstm_scan", "float32"),
                             ("slstm_scan", "bf16"), ("mlstm", "float32"), ("mlstm", "bf16")]
    assert kernels["titans_memory", "bf16"]["status"].startswith("n/a") or not HAS_TRITON
    for key in [("titans_memory", "float32"), ("slstm_scan", "float32"), ("slstm_scan", "bf16"), ("mlstm", "float32"),
                ("mlstm", "bf16")]:
        row = kernels[key]
        if not HAS_TRITON:
            assert row["status"] == "skipped (no triton)", row
            continue
        assert row["ok"] and row["status"] == "passed", row
        assert "T 3 + " in row["shape"] or key[0] == "mlstm", row  # fed in two calls, the state carried
        for what in ("values", "grads"):
            assert 0 <= row[f"{what}_max_rel"] <= row["tol"] and math.isfinite(row[f"{what}_max_abs"]), row
    for result in report["results"]:
        arch = result["arch"]
        assert result["errors"] == {}, arch
        assert all(field in result for field in FIELDS), arch
        assert all(result[field] is not None for field in FIELDS if field != "context"), arch
        forms = FORMS if arch in FUSED and HAS_TRITON else FORMS[:2]
        for field in ("compile_s", "mfu", "peak_memory_full_logits_mb", "decode_ms_b1_at_8", "decode_ms_b2_at_8",
                      *(f"{form}_{figure}" for form in forms for figure in ("tokens_per_s", "peak_memory_mb"))):
            assert isinstance(result[field], float) and result[field] > 0, (arch, field)
        for field in [f"{form}_device_kernels" for form in forms] + [f"{form}_kernels_per_step" for form in forms
                                                                      if form != "compiled"]:
            assert isinstance(result[field], int) and result[field] > 0, (arch, field)
        if arch not in FUSED:
            assert result["fused_tokens_per_s"] == result["fused_kernels_per_step"] == "n/a (no fused form)", arch
        elif not HAS_TRITON:
            assert result["fused_tokens_per_s"] == "skipped (no triton)", arch
        assert result["mfu"] < 1, arch
        assert result["best_form"] in forms and isinstance(result["vs_gpt"], float), arch
        if result["context"] == 64:  # the tiny GPTs' learned positions end there: no step after 80 tokens
            assert result["decode_ms_b1_at_80"] == result["decode_ms_b2_at_80"] == "n/a (context 64)", arch
        else:
            assert result["context"] is None and result["decode_ms_b2_at_80"] > 0, arch
    by_arch = {r["arch"]: r for r in report["results"]}
    assert by_arch["gpt"]["vs_gpt"] == 1.0
    assert by_arch["gpt"]["sdpa_train"] == by_arch["gpt"]["sdpa_decode"] == "flash (CPU)"
    assert by_arch["xlstm"]["sdpa_train"] == "none (no SDPA call)"  # no attention at all

    ddp, generate = report["cli"]["ddp_fit"], report["cli"]["generate"]
    assert ddp["ok"] and ddp["processes"] == 1 and ddp["global_step"] == 2, ddp
    assert "--config configs/trainer/ddp.yaml" in ddp["command"]
    assert generate["ok"] and generate["text"].startswith("Once upon a time"), generate
    assert "--dtype bfloat16" in generate["command"]

    markdown = (tmp_path / "check.md").read_text()
    tables = tables_of(markdown)
    assert [table[0][0] for table in tables] == ["kernel", "model", "model"]
    assert [row[-1] for row in tables[0][2:]] == [row["status"] for row in report["kernels"]]
    for table in tables[1:]:
        assert [row[0] for row in table[2:]] == list(CATALOG) and all(len(row) == len(table[0]) for row in table)
    assert all(row[3].endswith("x (eager)") or row[3].endswith("(compiled)") or row[3].endswith("(fused)")
               for row in tables[1][2:])
    assert meta["commit"] in markdown and "python scripts/gpu_check.py --tiny" in markdown
    assert "* DDP fit, 2 steps on 1 process(es): passed" in markdown and "* bf16 generate: passed" in markdown


def test_a_spent_budget_records_every_gap_and_still_writes_the_report(tmp_path):
    run = run_check(tmp_path, "--budget_s", "1", "--archs", "gpt", "xlstm", "--ddp_processes", "1")
    assert run.returncode == 1, run.stderr[-3000:]
    assert "failed: the report lists them" in run.stderr
    report = json.loads((tmp_path / "check.json").read_text())
    assert not report["cli"]["ddp_fit"]["ok"] and "timed out" in report["cli"]["ddp_fit"]["error"]
    assert report["cli"]["generate"]["error"] == "not run: the DDP fit left no checkpoint"
    assert [r["arch"] for r in report["results"]] == ["gpt", "xlstm"]
    for result in report["results"]:
        assert set(result["errors"]) == set(FIELDS)
        assert all("time budget" in message or "no training" in message for message in result["errors"].values())
    assert all(row["status"] == "not run: the time budget (--budget_s) was spent" or not HAS_TRITON
               for row in report["kernels"])
    markdown = (tmp_path / "check.md").read_text()
    model_rows = tables_of(markdown)[1][2]
    assert model_rows[0] == "gpt" and all(set(cell.split(" / ")) == {"failed"} for cell in model_rows[1:])
    assert "**failed**: timed out" in markdown and "* gpt `eager_tokens_per_s`: not measured" in markdown


def test_sdpa_kernels_names_the_backend_that_ran(one_thread):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    check = gpu_check_module()
    q, k = torch.randn(1, 2, 8, 4), torch.randn(1, 2, 8, 4)
    assert check.sdpa_kernels(lambda: F.scaled_dot_product_attention(q, k, k, is_causal=True)) == "flash (CPU)"
    with sdpa_kernel([SDPBackend.MATH]):
        assert check.sdpa_kernels(lambda: F.scaled_dot_product_attention(q, k, k, is_causal=True)) == "math"
    assert check.sdpa_kernels(lambda: q @ k.transpose(-1, -2)) == "none (no SDPA call)"


def test_device_kernels_on_a_cpu_counts_the_aten_ops_at_the_top(one_thread):
    from ltcx.throughput import device_kernels

    assert device_kernels(lambda: torch.ones(3) + 1, torch.device("cpu")) == 2  # ones (its fill inside it), add


def test_a_failing_measurement_is_recorded_and_the_next_one_runs(tmp_path):
    check = gpu_check_module()
    record = check.Recorder(tmp_path / "gpt.json", "gpt", 60.0)
    with record.measuring("train", "train_tokens_per_s", "mfu"):
        record.set(train_tokens_per_s=5.0)
        raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB\nmore detail")
    with record.measuring("sdpa", "sdpa_train"):
        record.set(sdpa_train="flash")
    written = json.loads((tmp_path / "gpt.json").read_text())
    assert written["train_tokens_per_s"] == 5.0 and written["mfu"] is None and written["sdpa_train"] == "flash"
    assert written["errors"] == {"mfu": "OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB"}
    assert written["phase"] is None and not written["done"]


@pytest.mark.parametrize("value,shown", [(1234567.8, "1,234,568"), (0.4567, "0.457"), ("n/a (context 512)",
                                                                                       "n/a (context 512)")])
def test_table_cells(value, shown):
    check = gpu_check_module()
    assert check.cell({"x": value, "errors": {}}, "x") == shown
    assert check.cell({"x": None, "errors": {"x": "boom"}}, "x") == "failed"
