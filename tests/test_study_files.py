"""A study's own files read back as data (ltcx/study/records.py): a damaged result.json, test.json, spec.json,
test_metrics.json, timing.json or done.json is one line naming the file and the fix, the report of the other runs
still comes out with the damaged run listed in it, and the exit status says so. Also the study's answers that misled:
a worker killed by a signal is reported as killed (not with its log's last notice), and --name stays inside --out.

The study here is planted (its folders and files written as a finished study leaves them, no training), so each
case is a fraction of a second."""

import json
import math
from pathlib import Path

import pytest
import yaml

from helpers import assert_mentions, one_error_line
from ltcx.errors import LtcxError
from ltcx.study.plan import make_run, plan_shapes
from ltcx.study.records import DamagedRecord, read_done
from ltcx.study.report import write_json
from ltcx.study.spec import load_spec

LRS = [1e-3, 3e-3]
SEEDS = [0, 1]


def planted_study(tmp_path: Path) -> tuple[Path, Path, dict]:
    """A finished study of gpt and ltc (their YAMLs as they are), 2 rates x 2 seeds, planted: (its spec's path, its
    folder, {(arch, lr, seed): run folder}). The rate 3e-3 wins for both; seed 0 is the tuning seed."""
    spec_path = tmp_path / "tiny.yaml"
    spec_path.write_text(yaml.safe_dump(dict(
        name="tiny", archs=["gpt", "ltc"], configs=["data/mqar"], size_by="config", block_size=16, batch_size=4,
        steps=6, evals=2, learning_rates=LRS, lr_extend=0, seeds=SEEDS, metric="loss", timing_rounds=0)))
    spec = load_spec(spec_path)
    out = tmp_path / "results" / "tiny"
    out.mkdir(parents=True)
    write_json(out / "spec.json", spec.defining())
    folders = {}
    for shape in plan_shapes(spec):
        for lr in LRS:
            for seed in SEEDS if lr == 3e-3 else [0]:
                run = make_run(spec, shape, lr, seed)
                folder = run.folder(out)
                folder.mkdir(parents=True)
                loss = 3.0 - 100 * lr + 0.01 * seed + (shape.arch == "ltc") * 0.1
                write_json(folder / "result.json", {
                    "arch": run.arch, "size": 0.0, "size_label": shape.label, "cell": {}, "lr": lr, "seed": seed,
                    "steps": run.steps, "tokens": run.steps * 64, "diverged": False, "init_args": {},
                    "distance": None, "val": {"val/loss": loss}, "curves": {"val/loss": [[192, loss + 1], [384, loss]]},
                    "params": 1000, "flops_per_token": 6000.0, "state_bytes": 64,
                    "checkpoint": str(folder / "last.ckpt")})
                if lr == 3e-3:
                    write_json(folder / "test.json", {"test/loss": loss + 0.05})
                folders[(run.arch, lr, seed)] = folder
    return spec_path, out, folders


def study(spec_path: Path, capsys, *flags: str) -> tuple[int, str, str]:
    """``ltcx study`` in process: (exit status, stdout, stderr)."""
    from ltcx.cli import main

    with pytest.raises(SystemExit) as exit_info:
        main(["study", "--spec", str(spec_path), "--out", str(spec_path.parent / "results"), *flags])
        raise SystemExit(0)
    captured = capsys.readouterr()
    return exit_info.value.code, captured.out, captured.err


def edit_json(path: Path, **changes) -> None:
    record = json.loads(path.read_text())
    record.update(changes)
    path.write_text(json.dumps(record))  # NaN stays NaN (json's own extension), as a hand or a bug would leave it


DAMAGES = {
    "result.json cut short": ("result.json", lambda p: p.write_bytes(p.read_bytes()[:200]), "not JSON"),
    "val a string": ("result.json", lambda p: edit_json(p, val="abc"), "'val'"),
    "steps negative": ("result.json", lambda p: edit_json(p, steps=-5), "'steps'"),
    "val/loss NaN": ("result.json", lambda p: edit_json(p, val={"val/loss": math.nan}), "'val'"),
    "test.json cut short": ("test.json", lambda p: p.write_text('{"a":'), "not JSON"),
    "test.json without its metric": ("test.json", lambda p: p.write_text('{"a": 1}'), "test/loss"),
    "result.json of another rate": ("result.json", lambda p: edit_json(p, lr=1e-3), "lr"),
}


@pytest.mark.parametrize("how", DAMAGES)
def test_a_damaged_run_is_named_with_its_fix_and_the_report_of_the_others_comes_out(tmp_path, capsys, how):
    """--report_only: the damaged run (ltc at the chosen rate, seed 1) is one line naming its file and the fix; the
    report holds every other run and lists the damaged one; the exit status is not 0."""
    name, damage, problem = DAMAGES[how]
    spec_path, out, folders = planted_study(tmp_path)
    damaged = folders[("ltc", 3e-3, 1)]
    damage(damaged / name)
    code, stdout, stderr = study(spec_path, capsys, "--report_only")
    assert code == 1 and "Traceback" not in stderr, stderr
    [line] = [line for line in stderr.splitlines() if str(damaged) in line]
    assert_mentions(line, str(damaged / name), problem, f"delete that run's folder {damaged}")
    summary = json.loads((out / "summary.json").read_text())
    assert [(e["arch"], e["seeds"]) for e in summary["results"]] == [("gpt", [0, 1]), ("ltc", [0])]
    assert [e["run"] for e in summary["left_out"]] == ["ltc config lr=0.003 seed 1"]
    md = (out / "summary.md").read_text()
    assert_mentions(md, "## Runs left out", "ltc config lr=0.003 seed 1", "damaged", str(damaged / name))
    tables = md.split("## Runs left out")[0]
    assert "nan" not in tables.lower() and "| -5 |" not in tables


def test_a_damaged_tuning_run_leaves_its_shape_out_said_and_listed(tmp_path, capsys):
    """A tuning run's result.json (gpt at the rate not chosen) cut short: gpt's rate cannot be chosen, so its row is
    empty and marked incomplete and the damaged run is listed; ltc's rows come out."""
    spec_path, out, folders = planted_study(tmp_path)
    damaged = folders[("gpt", 1e-3, 0)]
    (damaged / "result.json").write_text('{"arch": "gpt", "val": ')
    code, stdout, stderr = study(spec_path, capsys, "--report_only")
    assert code == 1 and "Traceback" not in stderr, stderr
    assert_mentions(stderr, str(damaged / "result.json"), f"delete that run's folder {damaged}")
    summary = json.loads((out / "summary.json").read_text())
    ltc, gpt = summary["results"]
    assert ltc["arch"] == "ltc" and ltc["test"]["n"] == 2 and not ltc["incomplete"]
    assert gpt["arch"] == "gpt" and gpt["test"] is None and gpt["incomplete"] == ["gpt config lr=0.001 seed 0"]
    assert_mentions((out / "summary.md").read_text(), "gpt config lr=0.001 seed 0", "damaged")


@pytest.mark.parametrize("phase", ["seed", "tuning"])
def test_a_missing_run_is_named_and_what_needs_it_is_marked_incomplete(tmp_path, capsys, phase):
    """--report_only with one run's folder gone (ltc's seed 1 at the chosen rate, or its tuning run at the other
    rate): it is named in the output and in summary.md, and ltc's row is kept, marked incomplete, not dropped."""
    spec_path, out, folders = planted_study(tmp_path)
    gone = folders[("ltc", 3e-3, 1) if phase == "seed" else ("ltc", 1e-3, 0)]
    for file in gone.iterdir():
        file.unlink()
    gone.rmdir()
    label = "ltc config lr=0.003 seed 1" if phase == "seed" else "ltc config lr=0.001 seed 0"
    code, stdout, stderr = study(spec_path, capsys, "--report_only")
    assert code == 0, stderr
    assert_mentions(stdout, f"{label}: missing", "1 runs missing or failed")
    summary = json.loads((out / "summary.json").read_text())
    rows = {e["arch"]: e for e in summary["results"]}
    assert set(rows) == {"gpt", "ltc"} and not rows["gpt"]["incomplete"] and rows["ltc"]["incomplete"] == [label]
    assert rows["ltc"]["seeds"] == ([0] if phase == "seed" else [])
    assert [(e["run"], e["why"]) for e in summary["left_out"]] == [(label, "missing")]
    md = (out / "summary.md").read_text()
    assert_mentions(md.splitlines()[2], "**Incomplete**: 1 runs missing or failed", label)
    [row] = [line for line in md.splitlines() if line.startswith("| ltc | config | ") and "incomplete" in line]
    assert "<strong>Incomplete</strong>" in (out / "report.html").read_text()


def test_a_missing_run_marks_the_ladder_fit_and_the_multiplier_incomplete():
    """A ladder whose ltc lacks a seed at its largest size: the fit and the multiplier are kept and marked."""
    from ltcx.study.report import summarize, tables
    from ltcx.study.spec import StudySpec

    spec = StudySpec(archs=["gpt", "ltc"], sizes=[1e5, 1e6], size_by="params", block_size=16, batch_size=8, steps=10,
                     learning_rates=[1e-3], seeds=[0, 1], timing_rounds=0)
    final, chosen = [], {}
    for arch in ("gpt", "ltc"):
        for size, flops in ((1e5, 6e3), (1e6, 6e4)):
            label = f"size{size:g}"
            chosen[(arch, label)] = {"lr": 1e-3, "edge": False, "grid": [{"lr": 1e-3, "value": 1.0, "diverged": False}]}
            for seed in (0, 1):
                if (arch, size, seed) == ("ltc", 1e6, 1):
                    continue  # the missing run
                loss = 5.0 * (flops / 6e3) ** -0.1 * (1 + 0.01 * seed) * (0.95 if arch == "ltc" else 1.0)
                final.append({"arch": arch, "size": size, "size_label": label, "cell": {}, "lr": 1e-3, "seed": seed,
                              "steps": 10, "tokens": 100, "diverged": False, "init_args": {"n_embd": 8, "n_layer": 2},
                              "distance": 0.0, "val": {"val/loss": loss}, "test": {"test/loss": loss},
                              "curves": {}, "params": size, "flops_per_token": flops, "state_bytes": 64})
    gone = {"run": "ltc size1e+06 lr=0.001 seed 1", "folder": "f", "why": "missing", "damaged": False, "line": "x",
            "arch": "ltc", "size_label": "size1e+06", "size": 1e6, "cell": {}, "lr": 1e-3, "seed": 1}
    summary = summarize(spec, [], final, chosen, None, [gone])
    ltc = summary["ladder"]["archs"]["ltc"]
    assert ltc["fit"] is not None and ltc["incomplete"] == ["size1e+06"] and ltc["multiplier_incomplete"]
    [ladder] = [rows for title, _, rows, _ in tables(summary) if title.startswith("Compute ladder")]
    [row] = [r for r in ladder if r[0] == "ltc"]
    assert "incomplete: size1e+06" in row[3] and row[4].endswith("(incomplete)")


def test_a_plain_rerun_names_a_damaged_run_and_reports_the_others(tmp_path, capsys):
    """Without --report_only the launcher finds the damaged run: one line, nothing retrained in its place, the report
    of the others, exit 1 with the fix."""
    spec_path, out, folders = planted_study(tmp_path)
    damaged = folders[("gpt", 3e-3, 1)]
    (damaged / "result.json").write_bytes((damaged / "result.json").read_bytes()[:200])
    code, stdout, stderr = study(spec_path, capsys)
    assert code == 1 and "Traceback" not in stderr, stderr
    assert "training" not in stdout
    assert_mentions(stderr, str(damaged / "result.json"), f"delete that run's folder {damaged}", "1 runs are damaged")
    summary = json.loads((out / "summary.json").read_text())
    assert [(e["arch"], e["seeds"]) for e in summary["results"]] == [("gpt", [0]), ("ltc", [0, 1])]
    assert [e["damaged"] for e in summary["left_out"]] == [True]


@pytest.mark.parametrize("flags", [("--report_only",), ()])
@pytest.mark.parametrize("text", ["[1,2", "[1, 2]", "\xff"])
def test_a_damaged_spec_json_is_one_line_saying_how_to_recover(tmp_path, capsys, flags, text):
    spec_path, out, _ = planted_study(tmp_path)
    (out / "spec.json").write_bytes(text.encode("latin-1"))
    line = one_error_line(["study", "--spec", str(spec_path), "--out", str(tmp_path / "results"), *flags], capsys)
    assert_mentions(line, str(out / "spec.json"), "damaged", "delete it", "the very spec")


def test_a_damaged_test_metrics_file_is_named_with_the_run_folder(tmp_path):
    """The test_metrics.json a fit wrote, read for a run's test.json."""
    from ltcx.runtime import TEST_METRICS
    from ltcx.study.processes import evaluate_test

    spec_path, out, folders = planted_study(tmp_path)
    spec = load_spec(spec_path)
    folder = folders[("ltc", 3e-3, 1)]
    (folder / "test.json").unlink()
    written = folder / "lightning_logs" / "ltc" / "version_0" / TEST_METRICS
    written.parent.mkdir(parents=True)
    written.write_text("[0.5]")
    run = make_run(spec, plan_shapes(spec)[1], 3e-3, 1)
    with pytest.raises(DamagedRecord, match="not an object") as found:
        evaluate_test(spec, run, out, lambda line: None)
    assert_mentions(str(found.value), str(written), f"delete that run's folder {folder}")


def test_a_damaged_done_file_is_named_with_the_run_folder(tmp_path):
    folder = tmp_path / "run"
    folder.mkdir()
    for text in ('{"checkpoint": "../../elsewhere.ckpt"}', '{"checkpoint": 3}', "{"):
        (folder / "done.json").write_text(text)
        with pytest.raises(DamagedRecord) as found:
            read_done(folder)
        assert_mentions(str(found.value), str(folder / "done.json"), f"delete that run's folder {folder}")


@pytest.mark.parametrize("text", ['{"device": "cpu", "models": ', '{"device": "cpu"}', "[]"])
def test_a_damaged_timing_record_is_said_and_the_pass_redone(tmp_path, monkeypatch, text):
    from ltcx.study import timing

    checkpoint = tmp_path / "gpt.ckpt"
    checkpoint.write_bytes(b"only its name and mtime are read: the loader is replaced below")
    monkeypatch.setattr("ltcx.persist.load_language_model", lambda path, **kw: (_Model(), None))
    monkeypatch.setattr(timing, "interleaved_timings", lambda models, *a, **kw: (
        {name: {"tokens_per_sec": 10.0, "decode_ms_per_token": 1.0} for name in models}, [0.5]))
    (tmp_path / "timing.json").write_text(text)
    lines = []
    found = timing.timing_pass(tmp_path, {"gpt size16": (checkpoint, 16)}, 4, 1, False, lines.append)
    assert found["models"]["gpt size16"]["tokens_per_sec"] == 10.0
    [said] = [line for line in lines if "damaged" in line]
    assert_mentions(said, str(tmp_path / "timing.json"), "redone")
    assert json.loads((tmp_path / "timing.json").read_text())["models"] == found["models"]


class _Model:
    def to(self, device):
        return self


# ----------------------------------------------------------------------------- answers that misled


@pytest.mark.parametrize("code", [-9, 128 + 9])
def test_a_worker_killed_by_a_signal_is_reported_as_killed_not_by_its_logs_last_notice(tmp_path, monkeypatch, code):
    """A `--launcher devices` worker killed with kill -9 (-9 from its wait, 137 from a shell): its log's last line
    is a notice printed at its start, not the cause."""
    from ltcx.study import processes

    spec_path, out, folders = planted_study(tmp_path)
    spec = load_spec(spec_path)
    run = make_run(spec, plan_shapes(spec)[0], 1e-2, 0)
    notice = "ltcx: no CUDA device, so trainer.precision bf16-mixed runs as 32-true"

    def killed(args, log, label, **kwargs):
        log.write_text(notice + "\n")
        return code

    monkeypatch.setattr(processes, "run_child", killed)
    with pytest.raises(LtcxError) as found:
        processes.train(spec, run, out, lambda line: None)
    assert_mentions(str(found.value), "SIGKILL", "signal 9", f"exit {code}", str(run.folder(out) / "run.log"))
    assert "no CUDA device" not in str(found.value)


@pytest.mark.parametrize("name", ["../../escaped", "..", "a/b", "", "a\nb"])
def test_name_from_the_command_line_stays_inside_out(tmp_path, capsys, name):
    spec_path, _, _ = planted_study(tmp_path)
    line = one_error_line(["study", "--spec", str(spec_path), "--name", name, "--out", str(tmp_path / "res"),
                           "--dry_run"], capsys)
    assert_mentions(line, "--name", "folder's name")
    assert not (tmp_path / "res").exists() and not (tmp_path.parent / "escaped").exists()
