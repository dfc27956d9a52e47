"""ltcx study's launchers (ltcx/study/launch.py) on one tiny study (gpt and xlstm at width 16, 6 steps, one learning
rate, one seed: every run a phase's, two at a time), trained once by the local launcher in a module fixture and used
by every test (the file's CPU time is mostly its `ltcx fit` and `ltcx test` processes: 17 of them):

- two `devices` launchers of 2 CPU workers each, started at once on a folder whose first launcher was SIGKILLed with
  its runs held mid-run: the claims are won again, the held runs resume from their last.ckpt, no run trains twice,
  and every result.json and test.json equals the local launcher's;
- submitit's local executor (the same job objects as SLURM's, in real processes): a job preempted (SIGUSR2) is
  requeued and its run resumes from the step it saved; a job SIGKILLed with its run is submitted again;
- a run that fails is reported with its log's last line while the others finish, and the study exits 1;
- the claim itself, the progress lines, --dry_run, --report_only and the launcher's one-line errors.
"""

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import yaml

from helpers import ROOT, assert_mentions, one_error_line
from ltcx.errors import ConfigError
from ltcx.runtime import usable_cores
from ltcx.study import launch
from ltcx.study.spec import load_spec

ARCHS = ["gpt", "xlstm"]
LABELS = [f"{arch} size16 lr=0.003 seed 0" for arch in ARCHS]
THREADS = str(max(1, usable_cores() // 2))  # a devices slot's share of 2 workers: the local runs get the same


def write_spec(folder: Path, file: str = "tiny.yaml", **changes) -> Path:
    every3 = folder / "every3.yaml"  # a last.ckpt at step 3 to resume from, and the hold of tests/launch_faults.py
    every3.write_text(yaml.safe_dump({"trainer": {"callbacks": [
        {"class_path": "ltcx.callbacks.ModelCheckpoint", "init_args": {"save_last": True, "every_n_train_steps": 3}},
        {"class_path": "launch_faults.HoldUntil", "init_args": {"at_step": 4}}]}}))
    spec = dict(name="tiny", archs=ARCHS, configs=["data/mqar", str(every3)], size_by="width", sizes=[16], layers=1,
                head_dim=8, data={"vocab_size": 32, "num_kv_pairs": 2, "random_fillers": False, "val_batches": 1},
                trainer={"log_every_n_steps": 1}, block_size=16, batch_size=8, steps=6, evals=2,
                learning_rates=[3e-3], seeds=[0], metric="recall_acc", timing_rounds=0)
    path = folder / file
    path.write_text(yaml.safe_dump({**spec, **changes}))
    return path


def start(spec: Path, out: Path, *flags: str, hold: Path | None = None) -> subprocess.Popen:
    """``ltcx study`` in a process group of its own (a worker to kill whole), its output in ``out``'s log files."""
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{ROOT / 'tests'}", "HF_HUB_OFFLINE": "1",
           "OMP_NUM_THREADS": THREADS}
    env.pop("LTCX_TEST_HOLD", None)
    if hold is not None:
        env["LTCX_TEST_HOLD"] = str(hold)
    out.mkdir(parents=True, exist_ok=True)
    n = len(list(out.glob("launcher*.out")))
    stdout, stderr = open(out / f"launcher{n}.out", "w"), open(out / f"launcher{n}.err", "w")
    proc = subprocess.Popen([sys.executable, str(ROOT / "run.py"), "study", "--spec", str(spec), "--out", str(out),
                             *flags], cwd=out, env=env, stdout=stdout, stderr=stderr, start_new_session=True)
    proc.logs = (out / f"launcher{n}.out", out / f"launcher{n}.err")
    return proc


def finish(proc: subprocess.Popen, timeout: float = 600) -> SimpleNamespace:
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    return SimpleNamespace(code=proc.returncode, out=proc.logs[0].read_text(), err=proc.logs[1].read_text())


def wait_for(condition, *procs: subprocess.Popen, what: str, timeout: float = 300) -> None:
    """Poll ``condition`` (a guard against a hang, not a measurement) while ``procs`` run."""
    deadline = time.monotonic() + timeout
    while not condition():
        for proc in procs:
            assert proc.poll() is None, f"exited {proc.returncode} before {what}: {proc.logs[1].read_text()[-2000:]}"
        assert time.monotonic() < deadline, f"no {what} after {timeout} s"
        time.sleep(0.1)


def held(hold: Path) -> dict[str, int]:
    """Run folder -> pid of each fit held by ``launch_faults.HoldUntil``."""
    return {str(Path(p.read_text()).resolve()): int(p.name.split("-")[1]) for p in hold.glob("held-*")
            if p.read_text()}


def gone(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(") ")[1][0] in "ZX"
    except (FileNotFoundError, IndexError):
        return True


def runs(out: Path) -> dict[str, Path]:
    return {f"{arch} size16 lr=0.003 seed 0": (out / f"tiny/runs/{arch}/size16/lr0.003/seed0").resolve()
            for arch in ARCHS}


def figures(folder: Path) -> dict:
    """result.json less the checkpoint's path, and test.json."""
    result = json.loads((folder / "result.json").read_text())
    result.pop("checkpoint")
    return {"result": result, "test": json.loads((folder / "test.json").read_text())}


def said_of(output: str, label: str) -> str:
    """The one line of ``output`` that begins with ``label`` (a run's line in a dry run's plan, indented)."""
    [line] = [line.strip() for line in output.splitlines() if line.strip().startswith(f"{label}: ")]
    return line


def fit_starts(folder: Path) -> list[str]:
    """The start line of every ``ltcx fit`` of the run (ltcx/cli/console.py): one per process that trained it."""
    return [line for line in (folder / "run.log").read_text().splitlines()
            if line.startswith("ltcx: ") and " parameters; logs " in line]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """The tiny study trained by the local launcher: the figures every other launcher must give."""
    root = tmp_path_factory.mktemp("launch")
    spec = write_spec(root)
    local = finish(start(spec, root / "local"))
    assert local.code == 0, local.err[-3000:]
    return SimpleNamespace(root=root, spec=spec, out=root / "local", stdout=local.out)


def test_the_local_launcher_trains_each_run_once_and_says_its_progress(tiny):
    assert [line.split(": training")[0] for line in tiny.stdout.splitlines() if ": training 6 steps" in line] == \
        LABELS
    lines = tiny.stdout.splitlines()
    finished = [line for line in lines if line.endswith(": val/recall_acc 0.0000") or ": val/recall_acc " in line]
    assert [line.split(":")[0] for line in finished] == [*LABELS, *LABELS]  # tune, then seeds (tested)
    assert "tune: done 1 / running 0 / failed 0 / left 1, about " in tiny.stdout
    assert "seeds: done 2 / running 0 / failed 0 / left 0" in tiny.stdout
    for folder in runs(tiny.out).values():
        assert len(fit_starts(folder)) == 1
    assert (tiny.out / "tiny/summary.json").is_file()


def test_two_devices_launchers_finish_a_study_whose_worker_was_killed(tiny):
    """A: 2 CPU workers, both runs held after step 4 (last.ckpt at step 3), then SIGKILLed with its process group.
    B and C, 2 workers each, started at once: the claims A's death released are won again, each run resumes at
    step 3 in one of them and is tested once, and every figure is the local launcher's."""
    out, hold = tiny.root / "shared", tiny.root / "hold-shared"
    hold.mkdir()
    first = start(tiny.spec, out, "--launcher", "devices", "--workers", "2", hold=hold)
    wait_for(lambda: len(held(hold)) == 2, first, what="both tuning runs held at step 4")
    os.killpg(first.pid, signal.SIGKILL)
    killed = finish(first)
    assert killed.code == -signal.SIGKILL
    assert "slot 0 (OMP_NUM_THREADS=" in killed.out and "slot 1 (OMP_NUM_THREADS=" in killed.out
    for folder in held(hold):
        assert (Path(folder) / "claim").is_file() and not (Path(folder) / "result.json").exists()

    second = start(tiny.spec, out, "--launcher", "devices", "--workers", "2")
    third = start(tiny.spec, out, "--launcher", "devices", "--workers", "2")
    b, c = finish(second), finish(third)
    assert b.code == 0, b.err[-3000:]
    assert c.code == 0, c.err[-3000:]
    both = b.out + c.out
    for label, folder in runs(out).items():
        trained = [line for line in both.splitlines() if line.startswith(f"{label}: training 6 steps")]
        assert len(trained) == 1 and "(resumed from last.ckpt)" in trained[0], both  # by one of them, once
        assert len(fit_starts(folder)) == 2 and "resumed at step 3 of 6" in (folder / "run.log").read_text()
        assert both.count(f"{label}: testing") == 1, both
        assert figures(folder) == figures(runs(tiny.out)[label]), label
    assert any("claimed by another launcher" in line and "waiting" in line for line in both.splitlines()), both
    summary, reference = (json.loads((o / "tiny/summary.json").read_text()) for o in (out, tiny.out))
    assert summary["results"] == reference["results"]


def test_submitit_requeues_a_preempted_job_and_resubmits_a_killed_one(tiny):
    """The local study's folder with its two runs to train again (their test.json kept, so no test runs), through
    submitit's local executor (a spec of its own, `launcher: {kind: slurm, cluster: local}`: the launcher is no part
    of what the study is). Both runs held after step 4: xlstm's job gets SIGUSR2 (SLURM's warning before preemption
    or the time limit): its fit saves step 4 and the job is requeued, resuming there; gpt's job is SIGKILLed with its
    fit: submitted again, it resumes at step 3. Their figures are the local launcher's."""
    out, hold = tiny.root / "submitit", tiny.root / "hold-submitit"
    hold.mkdir()
    shutil.copytree(tiny.out / "tiny", out / "tiny", ignore=shutil.ignore_patterns("launcher*"))
    for label in LABELS:
        for path in runs(out)[label].iterdir():
            if path.name != "test.json":
                shutil.rmtree(path) if path.is_dir() else path.unlink()
    spec = write_spec(tiny.root, "tiny-submitit.yaml",
                      launcher={"kind": "slurm", "cluster": "local", "gpus_per_run": 0})
    proc = start(spec, out, hold=hold)
    wait_for(lambda: len(held(hold)) == 2, proc, what="both tuning jobs held at step 4")
    fits = held(hold)
    folders = {label: str(folder) for label, folder in runs(out).items()}
    job_pid = {label: int((runs(out)[label] / "claim").read_text().split()[1]) for label in LABELS}
    gpt, xlstm = LABELS[0], LABELS[1]
    os.kill(job_pid[xlstm], signal.SIGUSR2)
    wait_for(lambda: gone(fits[folders[xlstm]]), proc, what="xlstm's fit saving and exiting")
    os.kill(job_pid[gpt], signal.SIGKILL)
    os.kill(fits[folders[gpt]], signal.SIGKILL)
    (hold / "release").touch()
    done = finish(proc)
    assert done.code == 0, done.err[-3000:] + done.out[-3000:]
    assert "ended without a result" in done.out and "submitted again" in done.out
    log = (runs(out)[xlstm] / "run.log").read_text()
    assert "SIGTERM at step 4" in log and "resumed at step 4 of 6" in log and len(fit_starts(runs(out)[xlstm])) == 2
    assert "resumed at step 3 of 6" in (runs(out)[gpt] / "run.log").read_text()
    for label in LABELS:
        assert figures(runs(out)[label]) == figures(runs(tiny.out)[label]), label


def test_a_failing_run_is_reported_with_its_last_line_and_the_others_finish(tiny):
    """xlstm has no n_kv_head: its fit stops at the command line; gpt's runs finish and the report holds them, and
    names xlstm's run, its row marked incomplete."""
    spec = write_spec(tiny.root, "tiny-failing.yaml", name="failing", archs=["xlstm", "gpt"], baseline="gpt",
                      seeds=[0], args=["--model.backbone.init_args.n_kv_head=1"])
    out = tiny.root / "failing"
    done = finish(start(spec, out))
    assert done.code == 1, done.err[-3000:]
    failed = "xlstm size16 lr=0.003 seed 0 failed (exit 2): ltcx: error: "
    lines = done.err.splitlines()
    assert_mentions(lines[-1], "study failing", "1 runs failed", "rerun the same command")
    assert lines[-2].startswith(f"ltcx: failed: {failed}")  # the run, its exit status and its log's last line
    assert_mentions(lines[-2], "n_kv_head", str(out / "failing/runs/xlstm/size16/lr0.003/seed0/run.log"),
                    "rerun to resume")
    assert "gpt size16 lr=0.003 seed 0: val/recall_acc " in done.out and "tune: done 1 / running 0 / failed 1 / " \
        "left 0" in done.out
    [held_back] = [line for line in done.out.splitlines() if "tune: xlstm size16: " in line]
    assert_mentions(held_back, "tuning run failed", "no seeds", "rerun")
    summary = json.loads((out / "failing/summary.json").read_text())  # xlstm's row kept, marked incomplete
    assert [(e["arch"], e["incomplete"]) for e in summary["results"]] == [("gpt", []), ("xlstm", [
        "xlstm size16 lr=0.003 seed 0"])]
    assert "**Incomplete**: 1 runs missing or failed (xlstm size16 lr=0.003 seed 0: failed)" in (
        out / "failing/summary.md").read_text()


def test_the_report_is_written_again_from_the_folder_alone(tiny, capsys):
    from ltcx.cli import main

    out = tiny.root / "report"
    shutil.copytree(tiny.out / "tiny", out / "tiny", ignore=shutil.ignore_patterns("summary.*", "report.html"))
    main(["study", "--spec", str(tiny.spec), "--out", str(out), "--report_only"])
    assert "wrote summary.json" in capsys.readouterr().out
    written, reference = (json.loads((o / "tiny/summary.json").read_text()) for o in (out, tiny.out))
    assert written["results"] == reference["results"]
    assert not any("training" in line for line in capsys.readouterr().out.splitlines())
    timed = write_spec(tiny.root, "timed.yaml", timing_rounds=2)  # the same study: timing_rounds redoes no run
    timed_now = ("timing pass", "2 models", "2 rounds")
    for flags, facts in (((), timed_now), ((), ("timing pass", "reused", "--retime")), (("--retime",), timed_now)):
        main(["study", "--spec", str(timed), "--out", str(out), "--report_only", *flags])
        [said] = [line for line in capsys.readouterr().out.splitlines() if "timing pass" in line]
        assert_mentions(said, *facts)
    assert json.loads((out / "tiny/summary.json").read_text())["results"][0]["tokens_per_sec"] > 0


def test_a_run_forked_from_the_fork_server_holds_its_claim_and_equals_a_fresh_interpreters(tmp_path, monkeypatch):
    """Without a GPU a study's runs start as forks of the pre-imported fork server (ltcx/study/prestart.py). A tiny
    MQAR fit forked keeps its run's claim when the launcher lets go of its own descriptor, on the thread count of its
    slot; the same fit in a fresh interpreter (``processes.run_child`` with the server off) ends with the same
    checkpoint to the bit: weights, optimizer state and step."""
    from ltcx.study import prestart, processes

    assert prestart.available()  # no GPU on this machine
    env = {"OMP_NUM_THREADS": "1", "PYTHONPATH": f"{ROOT}{os.pathsep}{ROOT / 'tests'}"}

    def args(root: Path) -> list[str]:
        return ["fit", "--config", str(ROOT / "configs/gpt.yaml"), "--config", str(ROOT / "configs/data/mqar.yaml"),
                "--model.backbone.init_args.n_layer", "1", "--model.backbone.init_args.n_embd", "16",
                "--model.backbone.init_args.n_head", "2", "--model.backbone.init_args.n_kv_head", "1",
                "--data.vocab_size", "32", "--data.num_kv_pairs", "2", "--data.block_size", "16",
                "--data.batch_size", "8", "--data.val_batches", "1", "--trainer.max_steps", "4",
                "--trainer.val_check_interval", "2", "--trainer.check_val_every_n_epoch", "null",
                "--trainer.callbacks+=launch_faults.HoldUntil", "--trainer.callbacks.at_step=2",
                "--trainer.default_root_dir", str(root)]

    forked, hold = tmp_path / "forked", tmp_path / "hold"
    hold.mkdir()
    fd = launch.try_claim(forked)
    try:
        run = prestart.start(args(forked), forked / "run.log", {**env, "LTCX_TEST_HOLD": str(hold)}, keep_fds=(fd,))
    finally:
        os.close(fd)  # the launcher lets go: the fork holds the claim now
    try:
        wait_for(lambda: list(hold.glob("held-*")), what="the fork held at step 2")
        assert launch.try_claim(forked) is None and launch.claimed(forked)
        (hold / "release").touch()
        assert run.wait() == 0, (forked / "run.log").read_text()[-3000:]
    finally:
        prestart.stop()
    assert not launch.claimed(forked)  # released with the process
    assert "measured on 1 CPU thread" in (forked / "run.log").read_text()

    fresh = tmp_path / "fresh"
    fresh.mkdir()
    monkeypatch.setenv("LTCX_STUDY_FORKSERVER", "0")
    assert not prestart.available()
    assert processes.run_child(args(fresh), fresh / "run.log", "fresh", env=env) == 0, (fresh / "run.log").read_text()
    saved = [torch.load(next(root.rglob("last.ckpt")), map_location="cpu", weights_only=False)
             for root in (forked, fresh)]
    assert saved[0]["global_step"] == saved[1]["global_step"] == 4
    for part in ("state_dict", "optimizer_states"):
        one, other = (torch.utils._pytree.tree_leaves(s[part]) for s in saved)
        assert len(one) == len(other) and all(
            torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b for a, b in zip(one, other))


# ----------------------------------------------------------------------------- without training


def test_the_claim_is_the_lock_and_the_kernel_releases_it_with_its_process(tmp_path):
    holder = subprocess.Popen([sys.executable, "-c", "import sys; sys.path.insert(0, sys.argv[1]); "
                               "from pathlib import Path; from ltcx.study.launch import try_claim; "
                               "fd = try_claim(Path(sys.argv[2])); print(fd is not None, flush=True); "
                               "import time; time.sleep(600)", str(ROOT), str(tmp_path)],
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "True"
        assert launch.try_claim(tmp_path) is None and launch.claimed(tmp_path)  # held by another process
        assert (tmp_path / "claim").read_text().split()[1] == str(holder.pid)
    finally:
        holder.kill()
        holder.wait()
    assert not launch.claimed(tmp_path)  # its process died: the kernel released it
    fd = launch.try_claim(tmp_path)
    assert fd is not None
    os.close(fd)


def test_progress_counts_runs_and_estimates_the_time_left():
    said = []
    spec = SimpleNamespace(metric="recall_acc")
    progress = launch.Progress(spec, "tune", 5, 2, said.append)
    job = launch.Job(SimpleNamespace(label="gpt size16 lr=0.003 seed 0"))
    progress.started()
    progress.started()
    progress.ended(job, {"val": {"val/recall_acc": 0.25}}, 60.0)
    progress.ended(job, None, 0.0, failed=True)
    assert said == ["gpt size16 lr=0.003 seed 0: val/recall_acc 0.2500",
                    "tune: done 1 / running 1 / failed 0 / left 3, about 2 min left",  # 60 s x 4 runs / 2 slots
                    "tune: done 1 / running 0 / failed 1 / left 3, about 2 min left"]  # 60 s x 3 / 2


def test_the_dry_run_says_where_each_run_would_run(tmp_path, capsys):
    from ltcx.cli import main

    spec = write_spec(tmp_path)
    main(["study", "--spec", str(spec), "--out", str(tmp_path / "results"), "--dry_run", "--launcher", "devices",
          "--workers", "2"])
    out = capsys.readouterr().out
    assert "devices launcher" in out.splitlines()[0]
    for slot, label in enumerate(LABELS):
        assert_mentions(said_of(out, label), "6 steps", "[to run]", f"slot {slot}", f"OMP_NUM_THREADS={THREADS}",
                        "ltcx fit ")
    main(["study", "--spec", str(write_spec(tmp_path, launcher={"kind": "slurm", "partition": "gpu", "time_min": 90,
                                                                 "runs_per_job": 2})),
          "--out", str(tmp_path / "results"), "--dry_run"])
    out = capsys.readouterr().out
    assert_mentions(said_of(out, LABELS[1]), "6 steps", "[to run]", "SLURM job 0", "partition gpu", "90 min",
                    "1 GPUs", "ltcx fit ")
    assert not (tmp_path / "results").exists()


def test_cpu_runs_with_cpus_per_run_fill_the_cores_and_a_typed_kind_replaces_the_specs_launcher(tmp_path, capsys,
                                                                                                 monkeypatch):
    """devices with cpus_per_run and no GPUs: cores // cpus_per_run slots of cpus_per_run threads each (the
    quick-recall preset's launcher); --workers still wins. A typed --launcher of another kind drops the spec's
    launcher keys, which were for its own kind."""
    from ltcx.cli import main

    monkeypatch.setattr(launch, "visible_gpus", lambda: [])
    monkeypatch.setattr("ltcx.runtime.usable_cores", lambda: 3)
    spec = write_spec(tmp_path, launcher={"kind": "devices", "gpus_per_run": 0, "cpus_per_run": 1})
    out = str(tmp_path / "results")
    main(["study", "--spec", str(spec), "--out", out, "--dry_run"])
    lines = capsys.readouterr().out
    assert "devices launcher" in lines.splitlines()[0]
    for slot, label in enumerate(LABELS):
        assert_mentions(said_of(lines, label), "6 steps", f"slot {slot}", "OMP_NUM_THREADS=1", "ltcx fit ")
    assert launch.make_launcher(load_spec(spec), tmp_path, print, None).slots == 3
    assert launch.make_launcher(load_spec(spec), tmp_path, print, None, {"workers": 2}).slots == 2
    wider = launch.make_launcher(load_spec(spec), tmp_path, print, None, {"cpus_per_run": 2})
    assert wider.slots == 1 and wider.envs == [{"OMP_NUM_THREADS": "2"}]
    main(["study", "--spec", str(spec), "--out", out, "--dry_run", "--launcher", "local"])
    assert "local launcher" in capsys.readouterr().out.splitlines()[0]
    assert not (tmp_path / "results").exists()


@pytest.mark.parametrize("launcher, facts", [
    ({"kind": "ray"}, ("'launcher.kind' ('ray')", "local, devices or slurm")),
    ({"workers": 0}, ("'launcher.workers' (0)", "integer >= 1")),
    ({"nodes": 2}, ("unknown key 'launcher.nodes'", "kind, workers, gpus_per_run")),
    ("devices", ("'launcher' ('devices')", "mapping", "kind: local|devices|slurm")),
])
def test_a_bad_launcher_key_is_one_line(tmp_path, launcher, facts):
    path = write_spec(tmp_path, launcher=launcher)
    with pytest.raises(ConfigError) as error:
        load_spec(path)
    assert_mentions(str(error.value), f"study spec {path}", *facts)
    assert "\n" not in str(error.value)


def test_bad_launcher_flags_are_one_line_before_anything_is_written(tmp_path, capsys, monkeypatch):
    spec, out = str(write_spec(tmp_path)), str(tmp_path / "results")
    line = one_error_line(["study", "--spec", spec, "--out", out, "--workers", "0"], capsys)
    assert_mentions(line, "--workers", "integer >= 1", "'0'", "ltcx study --help")
    line = one_error_line(["study", "--spec", spec, "--out", out, "--launcher", "slurm", "--workers", "2"], capsys)
    assert_mentions(line, "launcher slurm", "'workers'", "launcher devices only", "leave it out")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")
    line = one_error_line(["study", "--spec", spec, "--out", out, "--launcher", "devices", "--workers", "3"], capsys)
    assert_mentions(line, "launcher devices", "3 workers x 1 GPUs per run", "shows 2 GPUs", "--workers 2 or fewer")
    assert not (tmp_path / "results").exists()
