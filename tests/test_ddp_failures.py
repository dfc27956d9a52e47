"""The failure catalogue under DDP (and FSDP2 where a case is the same): 2 CPU processes (gloo) through `run.py fit`,
a tiny model, a few steps.

A NaN loss on one rank or a signal to the launching process (or to every rank) stops every rank at the same step,
says so once, leaves only good checkpoints and ends every process with the single-process exit status. Each run is
bounded by a timeout that kills the whole process group, so a rank stuck in a collective fails the test instead of
hanging it. About 10 s per DDP run on an idle 2-core machine."""

import signal

import pytest

from helpers import (
    DDP,
    FSDP,
    assert_mentions,
    assert_one_error_line,
    lean_fit_args,
    rank_exits,
    run_ddp,
    step_and_weights,
    write_corpus,
)
from ltcx.persist import read_checkpoint

# the fix each non-finite stop names
LOWER_THE_RATE = ("model.learning_rate", "model.warmup_steps", "trainer.gradient_clip_val")


def test_nan_on_one_rank_stops_every_rank_at_that_step(tmp_path):
    """Rank 1's weights alone go NaN after step 4 (as a bad batch on one rank would make them): the loss of step 5 is
    NaN there only. Both ranks stop before the backward pass of step 5, one line, exit 2 on both, and the good
    checkpoint of step 3 is untouched."""
    data = write_corpus(tmp_path / "corpus", 60, 10)
    first = run_ddp(lean_fit_args(tmp_path, data, "--trainer.max_steps", "3"), tmp_path, tmp_path / "exits0")
    assert first.returncode == 0, first.stderr[-3000:]
    last = tmp_path / "checkpoints/gpt/version_0/last.ckpt"
    before = last.read_bytes()

    stopped = run_ddp(lean_fit_args(
        tmp_path, data, "--trainer.max_steps", "6", "--ckpt_path", "last",
        "--trainer.callbacks+=fault_injection.PoisonWeights", "--trainer.callbacks.at_step=4",
        "--trainer.callbacks.rank=1",
    ), tmp_path, tmp_path / "exits1")
    assert rank_exits(tmp_path / "exits1") == {"rank0": 2, "rank1": 2}, stopped.stderr[-3000:]
    assert stopped.returncode == 2
    assert_mentions(assert_one_error_line(stopped.stderr), "loss became nan", "rank 1 of 2", "step 5",
                    "every rank stopped before updating", "last good one", *LOWER_THE_RATE)
    assert last.read_bytes() == before and step_and_weights(last)[0] == 3
    folder = tmp_path / "checkpoints/gpt"
    assert sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*")) == ["version_0", "version_0/last.ckpt"]


@pytest.mark.parametrize("strategy, clip", [(DDP, []), (FSDP, ["--trainer.gradient_clip_val", "0"])],
                         ids=["ddp", "fsdp"])
def test_non_finite_update_on_one_rank_stops_every_rank_after_that_step(tmp_path, strategy, clip):
    """Rank 1's update alone writes NaN at step 4 (under DDP its gradient poisoned after the all-reduce; under FSDP2
    its shard of a gradient): the ranks' weight checks are gathered, so both stop right after step 4, before its save;
    one line, exit 2 on both; step 2 stays last. FSDP2 runs without gradient clipping: its norm sums every shard, which
    would carry the NaN to both ranks' updates and the check would find it on both."""
    data = write_corpus(tmp_path / "corpus", 60, 10)
    stopped = run_ddp(lean_fit_args(tmp_path, data, "--trainer.max_steps", "6", *clip,
                                    "--trainer.callbacks+=fault_injection.PoisonGradient",
                                    "--trainer.callbacks.at_step=4", "--trainer.callbacks.rank=1", every=2),
                      tmp_path, tmp_path / "exits", strategy)
    assert rank_exits(tmp_path / "exits") == {"rank0": 2, "rank1": 2}, stopped.stderr[-3000:]
    assert_mentions(assert_one_error_line(stopped.stderr), "weights became non-finite", "rank 1 of 2", "step 4",
                    "every rank stopped before saving or validating", "last good one", *LOWER_THE_RATE)
    assert step_and_weights(tmp_path / "checkpoints/gpt/version_0/last.ckpt")[0] == 2


def test_sigterm_to_the_launcher_saves_once_every_rank_exits_143_and_resumes(tmp_path):
    """SIGTERM to the launching process (rank 0) only, after step 3 of 6: every rank stops after step 3, last.ckpt of
    step 3 is written once, both ranks exit 143; --ckpt_path last then finishes the run."""
    data = write_corpus(tmp_path / "corpus", 60, 10)
    stopped = run_ddp(lean_fit_args(tmp_path, data, "--trainer.max_steps", "6",
                                    "--trainer.callbacks+=fault_injection.SignalSelf", "--trainer.callbacks.at_step=3",
                                    "--trainer.callbacks.signal_name=SIGTERM", "--trainer.callbacks.rank=0"),
                      tmp_path, tmp_path / "exits0")
    assert rank_exits(tmp_path / "exits0") == {"rank0": 143, "rank1": 143}, stopped.stderr[-3000:]
    assert stopped.returncode == 143
    last = tmp_path / "checkpoints/gpt/version_0/last.ckpt"
    assert stopped.stderr.count("ltcx: SIGTERM at step 3: saved") == 1 and f"saved {last};" in stopped.stderr
    assert "Traceback" not in stopped.stderr
    assert [p.name for p in last.parent.iterdir()] == ["last.ckpt"]  # no temp file, no second name
    assert step_and_weights(last)[0] == 3

    resumed = run_ddp(lean_fit_args(tmp_path, data, "--trainer.max_steps", "6", "--ckpt_path", "last"),
                      tmp_path, tmp_path / "exits1")
    assert rank_exits(tmp_path / "exits1") == {"rank0": 0, "rank1": 0}, resumed.stderr[-3000:]
    state = read_checkpoint(tmp_path / "checkpoints/gpt/version_1/last.ckpt")
    assert state["global_step"] == 6
    assert state["ltcx"]["tokens_seen"] == 6 * 2 * 4 * 32  # resumed at step 3: 6 steps x 2 ranks x 4 x 32 tokens


@pytest.mark.parametrize("signal_name", ["SIGTERM", pytest.param("SIGINT", marks=pytest.mark.slow)])
def test_signal_to_every_rank_stops_them_at_the_same_step(tmp_path, signal_name):
    """The whole process group gets the signal (a scheduler stopping the job, Ctrl-C in a terminal): one save of
    step 2, every rank exits 128 + the signal."""
    data = write_corpus(tmp_path / "corpus", 60, 10)
    stopped = run_ddp(lean_fit_args(tmp_path, data, "--trainer.max_steps", "6",
                                    "--trainer.callbacks+=fault_injection.SignalSelf", "--trainer.callbacks.at_step=2",
                                    f"--trainer.callbacks.signal_name={signal_name}", "--trainer.callbacks.rank=0",
                                    "--trainer.callbacks.group=true"),
                      tmp_path, tmp_path / "exits")
    code = 128 + getattr(signal, signal_name)
    assert rank_exits(tmp_path / "exits") == {"rank0": code, "rank1": code}, stopped.stderr[-3000:]
    assert stopped.returncode == code
    assert stopped.stderr.count(f"ltcx: {signal_name} at step 2: saved") == 1 and "Traceback" not in stopped.stderr
    assert step_and_weights(tmp_path / "checkpoints/gpt/version_0/last.ckpt")[0] == 2


KILLED_CASES = [
    pytest.param(1, 6, None, DDP, id="rank1-launcher-busy"),
    pytest.param(1, 6, None, FSDP, id="rank1-launcher-busy-fsdp"),
    pytest.param(1, 600, 1, DDP, id="rank1-launcher-stuck"),
    pytest.param(0, None, None, DDP, id="rank0", marks=pytest.mark.slow),
]


@pytest.mark.parametrize("killed, busy_s, peer_grace, strategy", KILLED_CASES)
def test_a_killed_rank_stops_the_other_with_one_line(tmp_path, killed, busy_s, peer_grace, strategy):
    """SIGKILL to one rank after step 2 (a crash, the OOM killer): the other rank says which rank stopped in one line,
    no gloo traceback, and exits 2 (never 0). Killing rank 1 while the launching process (rank 0) spends 6 s outside
    any collective (a long step, a save, samples): Lightning's observer there would SIGKILL it within 5 s (`Child
    process ... terminated with code -9`, exit -9); its next collective fails instead. Stuck for 600 s (a collective
    that hangs rather than fails): its watch of the workers prints the line and exits 2 once the grace (here 1 s)
    is over. The busy case runs under FSDP2 too."""
    data = write_corpus(tmp_path / "corpus", 60, 10)
    busy = [] if busy_s is None else [
        "--trainer.callbacks+=fault_injection.Pause", "--trainer.callbacks.at_step=2", "--trainer.callbacks.rank=0",
        f"--trainer.callbacks.seconds={busy_s}", f"--trainer.callbacks.peer_grace={peer_grace or 'null'}"]
    stopped = run_ddp(lean_fit_args(tmp_path, data, "--trainer.max_steps", "6",
                                    "--trainer.callbacks+=fault_injection.KillSelf", "--trainer.callbacks.at_step=2",
                                    f"--trainer.callbacks.rank={killed}", *busy),
                      tmp_path, tmp_path / "exits", strategy)
    survivor = 1 - killed
    # the killed rank writes no exit status, nor does a launching process its watch stopped (os._exit)
    exits = rank_exits(tmp_path / "exits") if (tmp_path / "exits").exists() else {}
    assert exits == ({} if peer_grace else {f"rank{survivor}": 2}), stopped.stderr[-3000:]
    assert stopped.returncode == (2 if killed == 1 else -signal.SIGKILL)  # the launching process is rank 0
    assert_mentions(assert_one_error_line(stopped.stderr), f"rank {killed} of 2 stopped", "at step 2",
                    f"this rank ({survivor}) stops too", f"rank {killed}'s own output", "--ckpt_path last")
    assert "Connection reset" not in stopped.stderr
    assert "Child process" not in stopped.stderr
