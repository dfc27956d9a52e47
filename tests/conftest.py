import sys

import pytest
import torch.nn as nn

# The CLI imports Lightning when a command runs; the tests import it here, at collection, so that no test that
# captures stderr around main() is where Lightning's loggers bind their stream (pytest closes it after the test).
import ltcx.cli.lightning  # noqa: F401
from helpers import write_checkpoint, write_corpus


@pytest.fixture(autouse=True)
def hf_offline(monkeypatch):
    """No test reaches the Hugging Face hub: hub code paths fail fast instead of retrying the network.

    The libraries read these settings at import, so the module constants are patched as well as the env.
    """
    import datasets.config
    import huggingface_hub.constants

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)


@pytest.fixture(scope="module")
def one_thread():
    """For modules of tiny tensors: intra-op threads only add overhead (and oversubscribe a shared 2-core box)."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture
def fit_env(tmp_path, monkeypatch):
    """In-process runs in tmp_path (checkpoints/ and lightning_logs/ land there) on a small corpus."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "argv", ["ltcx"])
    return write_corpus(tmp_path / "corpus", 60, 10)


@pytest.fixture
def checkpoint(tmp_path):
    """A small valid checkpoint of a tiny GPT (bytes tokenizer), written as ltcx writes them."""
    return write_checkpoint(tmp_path / "good.ckpt")


@pytest.fixture
def no_backoff(monkeypatch):
    """For "fails at once" checks: records the sleeps of retries with back-off (huggingface_hub, datasets and
    transformers sleep between attempts) and fails the test if they add up to a second, whatever the load of the
    machine (a wall-clock bound would measure the load)."""
    import time

    slept: list[float] = []
    monkeypatch.setattr(time, "sleep", slept.append)
    yield slept
    assert sum(slept) < 1, f"slept {slept} between retries"


class Built(BaseException):
    """A real (not meta) weight was made: the refusal came too late. A BaseException, so no handler takes it."""


@pytest.fixture
def nothing_built():
    """Records every parameter or buffer registered off the meta device while a test runs, and stops the build at
    the first big one or after a thousand (so that a regression fails at once instead of allocating gigabytes)."""
    built = []

    def record(module, name, tensor):
        if tensor is not None and tensor.device.type != "meta":
            built.append((name, tuple(tensor.shape)))
            if tensor.numel() > 10**6 or len(built) > 1000:
                raise Built(f"{name} {tuple(tensor.shape)} built for real")

    hooks = [nn.modules.module.register_module_parameter_registration_hook(record),
             nn.modules.module.register_module_buffer_registration_hook(record)]
    yield built
    for hook in hooks:
        hook.remove()
