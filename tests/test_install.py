"""ltcx installed as a package (`pip install .`, not the checkout): the configs ship inside it, so `ltcx fit --config
gpt` (a shipped name) and the README's `--config configs/gpt.yaml` train from any directory."""

import subprocess
import sys

import pytest

from helpers import copy_tracked_files, write_corpus
from ltcx.models.catalog import CATALOG, shipped_config, shipped_config_names


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    """ltcx built and installed from a copy of the tracked files into a folder of its own (its dependencies are this
    environment's); returns that folder, for PYTHONPATH."""
    base = tmp_path_factory.mktemp("install")
    source, target = copy_tracked_files(base / "source"), base / "site"
    done = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation",
                           "--target", str(target), str(source)], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return target


def run_installed(target, cwd, *args):
    code = "import sys, ltcx; print('ltcx from', ltcx.__file__, flush=True); from ltcx.cli import main; main()"
    return subprocess.run([sys.executable, "-c", code, *args], cwd=cwd, capture_output=True, text=True, timeout=600,
                          env={"PYTHONPATH": str(target), "PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1",
                               "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"})


def test_installed_package_trains_with_shipped_configs_from_another_directory(installed, tmp_path):
    """Both forms: a shipped name (gpt) and the checkout's path (configs/trainer/smoke.yaml), no such file here."""
    data = write_corpus(tmp_path / "corpus", 60, 10)
    done = run_installed(installed, tmp_path, "fit", "--config", "gpt", "--config", "configs/trainer/smoke.yaml",
                         "--data.path", str(data), "--data.block_size", "32", "--data.batch_size", "2",
                         "--data.val_batches", "1", "--trainer.max_steps", "2", "--trainer.val_check_interval", "2",
                         "--trainer.enable_progress_bar", "false", *CATALOG["gpt"].tiny_cli())
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.splitlines()[0].startswith(f"ltcx from {installed}/ltcx/"), done.stdout
    assert (tmp_path / "checkpoints/gpt/version_0/last.ckpt").is_file()


def test_shipped_names():
    assert shipped_config("gpt") == shipped_config("gpt.yaml") == shipped_config("configs/gpt.yaml")
    assert shipped_config("trainer/smoke").name == "smoke.yaml"
    assert shipped_config("nope") is None and shipped_config("../setup.py") is None and shipped_config("/gpt") is None
    assert {"gpt", "recipe", "trainer/smoke", "data/mqar"} <= set(shipped_config_names())


def test_python_dash_m_ltcx_is_the_command(installed, tmp_path):
    """`python -m ltcx` where the console script is not on PATH: the same commands, and its name in their messages."""
    env = {"PYTHONPATH": str(installed), "PATH": "/usr/bin:/bin"}
    version = subprocess.run([sys.executable, "-m", "ltcx", "--version"], cwd=tmp_path, capture_output=True,
                             text=True, timeout=120, env=env)
    assert version.returncode == 0 and version.stdout.startswith("ltcx "), version.stderr[-2000:]
    missing = subprocess.run([sys.executable, "-m", "ltcx", "fit", "--config", "nope.yaml"], cwd=tmp_path,
                             capture_output=True, text=True, timeout=120, env=env)
    assert missing.returncode == 2, missing.stderr[-2000:]
    assert missing.stderr.strip().endswith("see `python -m ltcx fit --help`"), missing.stderr
