"""A study's learning-rate grid extends itself, its report keeps every seed and says what it stands on: planted
runs (a fake job writes each run's files as a finished run leaves them; no training), so each case is a fraction of
a second. The grid: a choice at the edge of the rates tried adds the next rate outward by the grid's ratio on the
tuning seed, until the choice is interior or ``lr_extend`` rates were added; a study stopped mid-extension resumes
to the same runs and the same summary. The report: the tuning seed's run in the curves and runs; titles, plain
ticks, bold rendered, speed columns flagged, the budget distance named and marked."""

import json
import math
from pathlib import Path

import pytest
import yaml

from ltcx.study import runner
from ltcx.study.report import write_json
from ltcx.study.spec import load_spec

BEST = {"gpt": 0.03, "ltc": 0.002}  # the planted optimum of each architecture's validation loss


def planted_job(calls: list, stop_at: str | None = None):
    """A stand-in for ``processes.execute_job``: writes the run's result.json (and test.json) as a finished run
    does, its loss least at ``BEST``; raises ``StudyStopped`` (a Ctrl-C) instead of the run labelled ``stop_at``."""

    def job(spec, job, out, say, env=None, where=""):
        run = job.run
        if run.label == stop_at:
            raise runner.StudyStopped(f"study stopped: {run.label}: SIGINT at step 3", 130)
        calls.append((run.label, job.test))
        folder = run.folder(out)
        folder.mkdir(parents=True, exist_ok=True)
        loss = 2.0 + math.log(run.lr / BEST[run.arch]) ** 2 / 10 + 0.01 * run.seed
        result = {"arch": run.arch, "size": run.shape.size, "size_label": run.shape.label, "cell": {}, "lr": run.lr,
                  "seed": run.seed, "steps": run.steps, "tokens": run.steps * 64, "diverged": False,
                  "init_args": run.shape.init_args, "distance": run.shape.distance, "val": {"val/loss": loss},
                  "curves": {"val/loss": [[64, loss + 1], [128, loss]]}, "params": 1000, "flops_per_token": 6e3,
                  "state_bytes": 64, "checkpoint": str(folder / "last.ckpt")}
        if not (folder / "result.json").exists():
            write_json(folder / "result.json", result)
        if job.test:
            write_json(folder / "test.json", {"test/loss": loss + 0.05})
            result["test"] = {"test/loss": loss + 0.05}
        return result

    return job


def spec_file(tmp_path: Path, **changes) -> Path:
    spec = {**dict(name="grid", archs=["gpt", "ltc"], configs=["data/mqar"], data={"vocab_size": 64},
                   size_by="width", sizes=[64], layers=1, block_size=16, batch_size=4, steps=4, evals=2,
                   learning_rates=[1e-3, 3e-3, 1e-2], seeds=[0, 1], metric="loss", timing_rounds=0), **changes}
    path = tmp_path / "grid.yaml"
    path.write_text(yaml.safe_dump(spec))
    return path


def test_a_choice_at_the_grids_edge_extends_the_grid_until_it_is_interior_and_resumes_to_the_same(tmp_path,
                                                                                                   monkeypatch):
    spec = load_spec(spec_file(tmp_path))
    out = tmp_path / "results/grid"
    calls = []
    # gpt's best (0.03) lies above the grid: 0.01 x 3.16 = 0.0316 is tried (the grid's ratio), then 0.1, which is
    # worse, so 0.0316 is interior; ltc's (0.002) lies inside. Stopped (Ctrl-C) at the second extension run.
    monkeypatch.setattr(runner, "execute_job", planted_job(calls, stop_at="gpt size64 lr=0.1 seed 0"))
    with pytest.raises(runner.StudyStopped):
        runner.run_study(spec, out, say=lambda line: None)
    assert [label for label, _ in calls][-1] == "gpt size64 lr=0.0316 seed 0"
    monkeypatch.setattr(runner, "execute_job", planted_job(calls))
    said = []
    summary = runner.run_study(spec, out, say=said.append)
    assert any("trying gpt size64 lr=0.1 seed 0" in line for line in said)
    tuned = sorted(label for label, test in calls if label.endswith("seed 0") and not test)
    assert tuned == sorted([f"gpt size64 lr={lr} seed 0" for lr in ("0.001", "0.003", "0.01", "0.0316", "0.1")]
                           + [f"ltc size64 lr={lr} seed 0" for lr in ("0.001", "0.003", "0.01")])  # each once
    picks = {p["arch"]: p for p in summary["learning_rates"]}
    assert picks["gpt"]["lr"] == 0.0316 and not picks["gpt"]["edge"] and picks["gpt"]["added"] == [0.0316, 0.1]
    assert picks["ltc"]["lr"] == 0.003 and picks["ltc"]["added"] == []
    md = (out / "summary.md").read_text()
    assert "| gpt | size64 | " in md and "gpt size64: 0.0316, 0.1" in md and "lr 0.1 |" in md
    # resumed bit for bit: a study that never stopped leaves the same summary
    again = tmp_path / "again"
    monkeypatch.setattr(runner, "execute_job", planted_job([]))
    fresh = runner.run_study(spec, again / "grid", say=lambda line: None)
    assert json.dumps(fresh["results"]).replace(str(again), str(tmp_path / "results")) == json.dumps(
        summary["results"])
    assert fresh["learning_rates"] == summary["learning_rates"]
    # --report_only rebuilds the extended grid from the folder alone
    rebuilt = runner.run_study(spec, out, say=lambda line: None, report_only=True)
    assert rebuilt["learning_rates"] == summary["learning_rates"] and not rebuilt["left_out"]


def test_the_extension_stops_at_its_bound_and_says_so(tmp_path, monkeypatch):
    spec = load_spec(spec_file(tmp_path, archs=["gpt"], lr_extend=1))
    monkeypatch.setattr(runner, "execute_job", planted_job([]))
    summary = runner.run_study(spec, tmp_path / "results/grid", say=lambda line: None)
    [pick] = summary["learning_rates"]
    assert pick["lr"] == 0.0316 and pick["edge"] and pick["next"] is None and pick["tried"][-1] == 0.0316
    assert "0.0316 (edge of the rates tried)" in (tmp_path / "results/grid/summary.md").read_text()
    dry = []
    from ltcx.study import cost

    monkeypatch.setattr(cost, "measured_rate", lambda: 1e10)  # rates passed in: no timing here
    monkeypatch.setattr(cost, "measured_step_s", lambda arch: 0.01)
    runner.run_study(spec, tmp_path / "dry", dry_run=True, say=dry.append)
    assert any("up to 1 rates more" in line for line in dry)
    [line] = [line for line in dry if line.startswith("estimated CPU time: ")]
    assert "at 10 GFLOP per CPU-second" in line and "5 processes" in line and "add at most" in line  # 3 + 1 + 1


def test_every_seed_the_tuning_seeds_included_is_in_the_curves_and_the_runs(tmp_path, monkeypatch):
    """The tuning seed's run at the chosen rate is a run of both phases: kept once, with its test, in the curves."""
    from ltcx.study.report import curve_band

    spec = load_spec(spec_file(tmp_path, archs=["gpt"], seeds=[0, 1, 2], learning_rates=[0.01, 0.03, 0.1]))
    monkeypatch.setattr(runner, "execute_job", planted_job([]))
    summary = runner.run_study(spec, tmp_path / "results/grid", say=lambda line: None)
    seeds, tokens, band = curve_band(summary, "gpt", "size64")
    assert seeds == [0, 1, 2] and tokens == [64, 128] and all(f.n == 3 for f in band)
    at_rate = [r for r in summary["runs"] if r["lr"] == 0.03]
    assert sorted((r["seed"], r["phase"]) for r in at_rate) == [(0, "seeds"), (1, "seeds"), (2, "seeds")]
    assert all("test/loss" in r["test"] for r in at_rate)
    assert summary["results"][0]["test"]["n"] == 3 and summary["results"][0]["seeds"] == [0, 1, 2]
    assert len(summary["runs"]) == 5  # 3 rates on seed 0 (one of them seed 0's final run), seeds 1 and 2


def test_the_report_names_its_budget_flags_every_timed_column_and_renders_bold(tmp_path):
    """The budget distance names its budget and marks one outside the tolerance; each speed column (throughput vs the
    baseline too) is flagged when the timing was unreliable; the HTML renders **bold**; figures have titles and
    plain tick labels."""
    import matplotlib

    matplotlib.use("Agg")
    from ltcx.study.report import figures, tables, write_report

    spec = load_spec(spec_file(tmp_path, size_by="params", sizes=[1e4, 1e5], match="flops",
                               learning_rates=[1e-3]))
    runs = []
    for i, size in enumerate(spec.sizes):
        for arch, distance in (("gpt", 0.001), ("ltc", -0.05 if i else 0.01)):
            for seed in spec.seeds:
                loss = 3.0 - 0.1 * i - 0.01 * seed
                runs.append({"arch": arch, "size": size, "size_label": f"size{size:g}", "cell": {}, "lr": 1e-3,
                             "seed": seed, "steps": 4, "tokens": 100, "diverged": False,
                             "init_args": {"n_embd": 8, "n_layer": 1}, "distance": distance,
                             "val": {"val/loss": loss}, "test": {"test/loss": 4.5 - 0.5 * i - 0.01 * seed},
                             "curves": {"val/loss": [[64, 4.6], [128, 4.4]]}, "params": size,
                             "flops_per_token": 6 * size, "state_bytes": 64})
    from ltcx.study.report import summarize
    from ltcx.study.results import select_learning_rates

    chosen = select_learning_rates(spec, [r for r in runs if r["seed"] == 0])
    timing = {"device": "cpu", "precision": "float32", "rounds": 1, "batch_size": 4, "load_average_max": 9.0,
              "usable_cores": 2, "speed_unreliable": True,
              "models": {f"{a} size{s:g}": {"tokens_per_sec": 100.0, "decode_ms_per_token": 1.0}
                         for a in ("gpt", "ltc") for s in spec.sizes}}
    summary = summarize(spec, runs, runs, chosen, timing)
    found = {title.split(" (")[0]: (header, rows) for title, header, rows, _ in tables(summary)}
    header, rows = found["Shapes"]
    assert header[-1] == "budget distance (flops vs gpt)"
    assert [row[-1] for row in rows] == ["+0.10%", "+1.00%", "+0.10%", "-5.00% (outside 2%)"]
    header, _ = found["Results"]
    assert [h for h in header if "(unreliable)" in h] == ["train tokens/s (unreliable)",
                                                          "throughput vs gpt (unreliable)",
                                                          "decode ms/token (unreliable)"]
    write_report(summary, tmp_path)
    page = (tmp_path / "report.html").read_text()
    assert "<strong>The speed columns are unreliable</strong>" in page and "**" not in page
    titles, labels = [], []
    import matplotlib.figure

    saved = matplotlib.figure.Figure.savefig

    def seen(figure, *args, **kwargs):
        figure.canvas.draw()
        for ax in figure.axes:
            if ax.get_visible():
                titles.append(ax.get_title() or figure.get_suptitle())
                labels.extend(t.get_text() for t in ax.get_yticklabels(which="both") + ax.get_xticklabels(
                    which="both") if t.get_text())
        return saved(figure, *args, **kwargs)

    matplotlib.figure.Figure.savefig = seen
    try:
        figures(summary, tmp_path)
    finally:
        matplotlib.figure.Figure.savefig = saved
    assert titles and all(titles)
    assert "Compute ladder: test/loss against training FLOPs, power-law fits" in titles
    assert labels and not [t for t in labels if "times" in t or "^" in t or "$" in t], labels


def test_a_study_from_before_the_extension_resumes_with_lr_extend_0_only(tmp_path):
    from ltcx.errors import ConfigError
    from ltcx.study.results import check_folder

    out = tmp_path / "results/grid"
    out.mkdir(parents=True)
    old = load_spec(spec_file(tmp_path, lr_extend=0)).defining()
    del old["lr_extend"]  # its spec.json has no such key: its grid was taken as given
    write_json(out / "spec.json", old)
    check_folder(load_spec(spec_file(tmp_path, lr_extend=0)), out)
    with pytest.raises(ConfigError) as error:
        check_folder(load_spec(spec_file(tmp_path)), out)
    assert "another 'lr_extend' (0, now 3)" in str(error.value)
