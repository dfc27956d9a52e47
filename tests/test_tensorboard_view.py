"""TensorBoard's first view of a run, seen in a real browser (headless Chromium through Playwright,
``scripts/tensorboard_view.py``): the train/loss and val/loss charts on screen, no ``epoch`` or ``hp_metric``.
Needs Chromium (Debian: ``apt-get install chromium``) and ``pip install playwright``; skipped where either is missing
(CI has neither: tests/test_cli.py checks the tags that make this view)."""

import importlib.util
import shutil
import subprocess
import sys

import pytest

from helpers import ROOT, fit_args, run_cli, write_corpus

pytestmark = pytest.mark.skipif(shutil.which("/usr/bin/chromium") is None or importlib.util.find_spec("playwright")
                                is None, reason="needs Chromium and Playwright")


def test_a_runs_first_view_shows_its_train_and_validation_loss(tmp_path):
    data = write_corpus(tmp_path / "corpus")
    fit = run_cli(fit_args(data, "--trainer.max_steps", "4"), tmp_path)
    assert fit.returncode == 0, fit.stderr[-3000:]
    shot = tmp_path / "first_view.png"
    seen = subprocess.run([sys.executable, str(ROOT / "scripts/tensorboard_view.py"),
                           str(tmp_path / "lightning_logs/gpt"), "--out", str(shot), "--settle_ms", "2000"],
                          capture_output=True, text=True, timeout=300)
    assert seen.returncode == 0, seen.stdout + seen.stderr
    assert seen.stdout.strip().endswith("charts on screen: train/loss, train/lr, val/bpb, val/loss")
    assert shot.stat().st_size > 10_000
