"""A callback for tests/test_launch.py: a run held mid-run, so that a test can kill or preempt its worker there."""

import os
import time
from pathlib import Path

import lightning as L


class HoldUntil(L.Callback):
    """After optimizer step ``at_step``, when the environment names a folder (``LTCX_TEST_HOLD``): write
    ``held-<pid>`` there (holding the run's folder) and wait until ``release`` appears there or a SIGTERM reached this
    process (Lightning then stops after this step and ltcx saves it). Without the variable it does nothing."""

    def __init__(self, at_step: int) -> None:
        self.at_step = at_step

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        folder = os.environ.get("LTCX_TEST_HOLD")
        if not folder or trainer.global_step != self.at_step:
            return
        hold = Path(folder)
        (hold / f"held-{os.getpid()}").write_text(str(trainer.default_root_dir))
        while not (hold / "release").exists() and not trainer._signal_connector.received_sigterm:
            time.sleep(0.05)
