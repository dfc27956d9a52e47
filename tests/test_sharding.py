"""FSDP2 (``ltcx.sharding``, configs/trainer/fsdp.yaml) for real: 2 CPU processes over gloo.

Every catalogue architecture sharded block by block computes what the unsharded model computes (float64), each rank
holding half of the parameters; through `run.py fit`, the FSDP2 run's losses and weights are the DDP run's (float32),
its checkpoint is an ordinary ltcx file (generate, export in one process), a SIGTERM saves the step and
``--ckpt_path last`` resumes it exactly, and a rank killed in a save leaves the previous checkpoint. A non-finite
update on one rank and a killed rank are checked under FSDP2 by tests/test_ddp_failures.py, beside DDP. Each `run.py`
run takes ~15-25 s on an idle 2-core machine (two processes, imports included)."""

import json
import os
import signal
import socket
import subprocess
import sys

import pytest
import torch

from helpers import (
    DDP,
    FSDP,
    ROOT,
    assert_generates,
    assert_mentions,
    assert_one_error_line,
    fit_args,
    lean_fit_args,
    rank_exits,
    read_events,
    run_ddp,
    step_and_weights,
    write_corpus,
)
from ltcx.lm import LanguageModel
from ltcx.persist import export_model, load_exported, read_checkpoint

F32_REL = 1e-5  # float32: the same sums in another order (all-reduce vs reduce-scatter)
ADAM_NEAR_ZERO_ATOL = 2e-6  # after 4 AdamW steps: see test_fsdp_fit_matches_ddp_and_its_checkpoint_loads_in_one_process


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_every_architecture_sharded_matches_unsharded_on_two_ranks(tmp_path):
    """tests/sharded_catalogue.py on 2 gloo ranks, for every catalogue entry, with and without activation
    checkpointing: the same evaluation logits, gradients, weights after an AdamW step and evaluation logits after it
    (float64); each rank holds about half of the parameters, under their own names; activation checkpointing keeps
    less for the backward."""
    out = tmp_path / "results.json"
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{ROOT / 'tests'}", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(free_port()), "WORLD_SIZE": "2", "OMP_NUM_THREADS": "1"}
    ranks = [subprocess.Popen([sys.executable, str(ROOT / "tests/sharded_catalogue.py"), str(out)],
                              env={**env, "RANK": str(rank)}, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                              text=True)
             for rank in (0, 1)]
    try:
        errors = [rank.communicate(timeout=300)[1] for rank in ranks]
    finally:
        for rank in ranks:
            rank.kill()
    assert [rank.returncode for rank in ranks] == [0, 0], errors[0][-3000:] + errors[1][-3000:]
    results = json.loads(out.read_text())
    from ltcx.models.catalog import CATALOG

    assert sorted(results) == sorted(CATALOG)
    for name, result in results.items():
        assert result["units"] >= 2, name  # sharded block by block, not as one unit
        for variant in ("sharded", "checkpointed"):
            got = result[variant]
            for key in ("eval_before", "grads", "weights", "eval_after"):
                assert got[key] < 1e-10, (name, variant, key, got[key])
            assert got["names"], (name, variant)
            assert all(0.45 <= share <= 0.55 for share in got["shares"]), (name, variant, got["shares"])
        assert result["checkpointed"]["saved_numel"] < result["sharded"]["saved_numel"] / 2, name


def losses(run_folder) -> list[float]:
    return [event.value for event in read_events(run_folder).Scalars("train/loss")]


TWO_LAYERS = ["--model.backbone.init_args.n_layer", "2"]  # the shared tiny shape has one block to shard by


def test_fsdp_fit_matches_ddp_and_its_checkpoint_loads_in_one_process(tmp_path, capsys):
    """4 steps under DDP and under FSDP2 from the same seed: each FSDP2 rank holds half of the parameters; the losses
    of every step and the final weights agree within float32 rounding; the FSDP2 checkpoint has the DDP one's keys,
    names the backbone's own class, passes its digest, holds AdamW's state as the DDP one does, and `generate` and
    `export` read it in this one process."""
    data = write_corpus(tmp_path / "corpus", 60, 10)
    runs = {}
    for name, strategy in (("ddp", DDP), ("fsdp", FSDP)):
        folder = tmp_path / name
        folder.mkdir()
        extra = ["--trainer.callbacks+=shard_probe.RecordShards", f"--trainer.callbacks.out_dir={folder / 'shards'}"]
        args = fit_args(data, *TWO_LAYERS, "--trainer.max_steps", "4", *extra)  # validation and samples every 2 steps
        done = run_ddp(args, folder, folder / "exits", strategy)
        assert rank_exits(folder / "exits") == {"rank0": 0, "rank1": 0}, done.stderr[-3000:]
        runs[name] = folder
    shards = {name: [json.loads((folder / f"shards/rank{r}.json").read_text()) for r in (0, 1)]
              for name, folder in runs.items()}
    total = shards["ddp"][0]["total"]
    assert [s["held"] for s in shards["ddp"]] == [total, total]  # DDP: a full copy on each rank
    assert all(abs(s["held"] - total / 2) <= 0.01 * total for s in shards["fsdp"]), shards["fsdp"]

    events = {name: read_events(folder / "lightning_logs/gpt/version_0") for name, folder in runs.items()}
    for tag, count in (("train/loss", 4), ("val/loss", 2)):
        ddp_values, fsdp_values = ([e.value for e in events[name].Scalars(tag)] for name in ("ddp", "fsdp"))
        assert len(ddp_values) == len(fsdp_values) == count, tag
        torch.testing.assert_close(torch.tensor(fsdp_values), torch.tensor(ddp_values), rtol=F32_REL, atol=0)
    assert len(events["fsdp"].Tensors("samples/text_summary")) == 2  # rank 0 sampled from the gathered weights

    last = {name: folder / "checkpoints/gpt/version_0/last.ckpt" for name, folder in runs.items()}
    (ddp_step, ddp_weights), (fsdp_step, fsdp_weights) = step_and_weights(last["ddp"]), step_and_weights(last["fsdp"])
    assert ddp_step == fsdp_step == 4 and list(fsdp_weights) == list(ddp_weights)
    for key, value in fsdp_weights.items():
        # AdamW divides by sqrt(v): where a coordinate's gradient is near zero, the reductions' other order (last bits)
        # moves its update by up to ~1e-6 (seen: 6.3e-7 on one of 4,096); a sharding bug moves whole tensors far more.
        torch.testing.assert_close(value, ddp_weights[key], rtol=F32_REL,
                                   atol=F32_REL * value.abs().max().item() + ADAM_NEAR_ZERO_ATOL)
    checkpoint = read_checkpoint(last["fsdp"])  # the digest is checked here
    assert checkpoint["ltcx"]["backbone_class"] == "ltcx.models.gpt.GPT"
    # AdamW's state as DDP's file holds it (parameters numbered in the order of the groups): either resumes the other
    [ddp_adam], [fsdp_adam] = read_checkpoint(last["ddp"])["optimizer_states"], checkpoint["optimizer_states"]
    assert [g["params"] for g in fsdp_adam["param_groups"]] == [g["params"] for g in ddp_adam["param_groups"]]
    assert sorted(fsdp_adam["state"]) == sorted(ddp_adam["state"])
    for number, moments in fsdp_adam["state"].items():
        for key in ("exp_avg", "exp_avg_sq"):
            torch.testing.assert_close(moments[key], ddp_adam["state"][number][key], rtol=1e-4,
                                       atol=1e-4 * ddp_adam["state"][number][key].abs().max().item())

    assert_generates(last["fsdp"], capsys)
    model, _ = load_exported(export_model(last["fsdp"], tmp_path / "exported", model_class=LanguageModel),
                             model_class=LanguageModel)
    exported = model.backbone.state_dict()
    assert all(torch.equal(value, fsdp_weights[f"backbone.{key}"]) for key, value in exported.items())


def test_fsdp_sigterm_saves_the_step_and_ckpt_path_last_resumes_it_exactly(tmp_path):
    """Under FSDP2, SIGTERM to the launching process after step 3 of 6: every rank exits 143 and last.ckpt holds
    step 3; `--ckpt_path last` then finishes the run with the weights and losses of an uninterrupted 6-step run."""
    data = write_corpus(tmp_path / "corpus", 60, 10)
    straight_folder = tmp_path / "straight"
    straight_folder.mkdir()
    straight = run_ddp(lean_fit_args(straight_folder, data, *TWO_LAYERS, "--trainer.max_steps", "6"), straight_folder,
                       straight_folder / "exits", FSDP)
    assert straight.returncode == 0, straight.stderr[-3000:]

    stopped = run_ddp(lean_fit_args(tmp_path, data, *TWO_LAYERS, "--trainer.max_steps", "6",
                                    "--trainer.callbacks+=fault_injection.SignalSelf", "--trainer.callbacks.at_step=3",
                                    "--trainer.callbacks.signal_name=SIGTERM", "--trainer.callbacks.rank=0"),
                      tmp_path, tmp_path / "exits0", FSDP)
    assert rank_exits(tmp_path / "exits0") == {"rank0": 143, "rank1": 143}, stopped.stderr[-3000:]
    last = tmp_path / "checkpoints/gpt/version_0/last.ckpt"
    assert stopped.stderr.count("ltcx: SIGTERM at step 3: saved") == 1 and "Traceback" not in stopped.stderr
    assert step_and_weights(last)[0] == 3

    resumed = run_ddp(lean_fit_args(tmp_path, data, *TWO_LAYERS, "--trainer.max_steps", "6", "--ckpt_path", "last"),
                      tmp_path, tmp_path / "exits1", FSDP)
    assert rank_exits(tmp_path / "exits1") == {"rank0": 0, "rank1": 0}, resumed.stderr[-3000:]
    step, weights = step_and_weights(tmp_path / "checkpoints/gpt/version_1/last.ckpt")
    straight_step, straight_weights = step_and_weights(straight_folder / "checkpoints/gpt/version_0/last.ckpt")
    assert step == straight_step == 6
    assert all(torch.equal(value, straight_weights[key]) for key, value in weights.items())
    straight_losses = losses(straight_folder / "lightning_logs/gpt/version_0")
    assert losses(tmp_path / "lightning_logs/gpt/version_1") == straight_losses[3:]


@pytest.mark.slow
def test_a_ddp_checkpoint_resumes_under_fsdp_as_under_ddp(tmp_path):
    """A DDP run's last.ckpt of step 3 continued to step 5 under FSDP2 and under DDP: the same weights within
    float32 rounding (AdamW's moments reach their own parameters; Lightning's own ModelParallelStrategy numbers them
    otherwise)."""
    data = write_corpus(tmp_path / "corpus", 60, 10)
    first = run_ddp(lean_fit_args(tmp_path, data, *TWO_LAYERS, "--trainer.max_steps", "3"), tmp_path,
                    tmp_path / "exits0", DDP)
    assert first.returncode == 0, first.stderr[-3000:]
    start = tmp_path / "checkpoints/gpt/version_0/last.ckpt"
    weights = {}
    for name, strategy in (("ddp", DDP), ("fsdp", FSDP)):
        folder = tmp_path / name
        folder.mkdir()
        resumed = run_ddp(lean_fit_args(folder, data, *TWO_LAYERS, "--trainer.max_steps", "5", "--ckpt_path",
                                        str(start)), folder, folder / "exits", strategy)
        assert resumed.returncode == 0, resumed.stderr[-3000:]
        step, weights[name] = step_and_weights(folder / "checkpoints/gpt/version_0/last.ckpt")
        assert step == 5
    for key, value in weights["fsdp"].items():
        torch.testing.assert_close(value, weights["ddp"][key], rtol=F32_REL, atol=F32_REL * value.abs().max().item())


@pytest.mark.parametrize("killed", [0, pytest.param(1, marks=pytest.mark.slow)])
def test_fsdp_rank_killed_while_saving_keeps_the_previous_checkpoint_and_resumes(tmp_path, killed):
    """Under FSDP2 (a save every 2 steps), kill -9 of a rank in the save of step 4: rank 0, which writes the file,
    once the new file is written and before it replaces the old one; rank 1 between the gathers of the weights and of
    AdamW's state. The other rank says so in one line and exits 2, no file of step 4 exists, last.ckpt is still step
    2's, and `--ckpt_path last` resumes from it to step 6 (the killed writer's temp file removed when it starts)."""
    data = write_corpus(tmp_path / "corpus", 60, 10)
    stopped = run_ddp(lean_fit_args(tmp_path, data, "--trainer.max_steps", "6",
                                    "--trainer.callbacks+=fault_injection.KillSelfWhileSaving",
                                    "--trainer.callbacks.at_step=4", f"--trainer.callbacks.rank={killed}", every=2),
                      tmp_path, tmp_path / "exits0", FSDP)
    survivor = 1 - killed
    assert rank_exits(tmp_path / "exits0") == {f"rank{survivor}": 2}, stopped.stderr[-3000:]
    assert stopped.returncode == (2 if killed == 1 else -signal.SIGKILL)  # the launching process is rank 0
    assert_mentions(assert_one_error_line(stopped.stderr), f"rank {killed} of 2 stopped", "at step 4",
                    f"this rank ({survivor}) stops too", f"rank {killed}'s own output", "--ckpt_path last")
    folder = tmp_path / "checkpoints/gpt/version_0"
    left = sorted(p.name for p in folder.iterdir())
    assert [n for n in left if not n.startswith(".")] == ["epoch=0-step=2.ckpt", "last.ckpt"], left
    assert len(left) == (3 if killed == 0 else 2), left  # the killed writer's temp file
    assert step_and_weights(folder / "last.ckpt")[0] == 2

    resumed = run_ddp(lean_fit_args(tmp_path, data, "--trainer.max_steps", "6", "--ckpt_path", "last", every=2),
                      tmp_path, tmp_path / "exits1", FSDP)
    assert rank_exits(tmp_path / "exits1") == {"rank0": 0, "rank1": 0}, resumed.stderr[-3000:]
    assert sorted(p.name for p in folder.iterdir()) == ["epoch=0-step=2.ckpt", "last.ckpt"]
    assert step_and_weights(tmp_path / "checkpoints/gpt/version_1/last.ckpt")[0] == 6
    assert len(losses(tmp_path / "lightning_logs/gpt/version_1")) == 4  # steps 3 to 6: resumed at step 2
