"""scripts/compare.py and scripts/plot_results.py: the summary maths on made-up runs, the interleaved timing pass,
the figures' axes and error bars, and a tiny real comparison (2 configs x 2 seeds) through the CLI to JSON,
Markdown and PNG files, with progress in each run.log, resumed without rework."""

import json
import math
from pathlib import Path

import matplotlib
import pytest
import torch
import yaml

from helpers import load_script, write_corpus

ROOT = Path(__file__).resolve().parents[1]


compare = load_script("compare")
plot_results = load_script("plot_results")


def test_summary_means_and_paired_differences():
    losses = {"gpt": [4.0, 4.2, 4.1], "ltc": [3.9, 4.0, 4.05]}
    # a speed a run recorded itself (an older result.json) is ignored: the timing pass's figures count
    runs = [{"model": m, "seed": s, "val_loss": loss, "params": 10, "tokens_per_sec": 100.0 + s}
            for m, values in losses.items() for s, loss in enumerate(values)]
    speeds = {"ltc": {"tokens_per_sec": 250.0, "decode_ms_per_token": 1.5}}
    summary = compare.summarize(runs, baseline="gpt", speeds=speeds)
    assert summary["gpt"]["val_loss_mean"] == pytest.approx(4.1)
    assert summary["gpt"]["val_loss_sd"] == pytest.approx(0.1)
    assert "diff_vs_baseline_mean" not in summary["gpt"]
    diffs = [-0.1, -0.2, -0.05]
    assert summary["ltc"]["diff_vs_baseline_mean"] == pytest.approx(sum(diffs) / 3)
    mean = sum(diffs) / 3
    assert summary["ltc"]["diff_vs_baseline_sd"] == pytest.approx(math.sqrt(sum((d - mean) ** 2 for d in diffs) / 2))
    assert summary["ltc"]["tokens_per_sec"] == 250.0 and summary["ltc"]["decode_ms_per_token"] == 1.5
    assert summary["gpt"]["tokens_per_sec"] is None and summary["gpt"]["decode_ms_per_token"] is None
    t_975 = 4.302652729749464  # Student's t, 2 degrees of freedom
    assert summary["gpt"]["val_loss_ci95"] == pytest.approx(t_975 * 0.1 / math.sqrt(3), rel=1e-9)
    statistic = mean / (summary["ltc"]["diff_vs_baseline_sd"] / math.sqrt(3))
    assert summary["ltc"]["diff_vs_baseline_p"] == pytest.approx(1 - abs(statistic) / math.sqrt(2 + statistic**2))
    table = compare.markdown_table(summary, "gpt")
    assert table.splitlines()[2].startswith("| ltc | 3 | 3.9833 +- 0.1897 | -0.1167 +- 0.1897 | 0.118 |")


def test_paired_difference_uses_only_shared_seeds_and_one_seed_has_no_sd():
    runs = [{"model": "a", "seed": 0, "val_loss": 2.0}, {"model": "b", "seed": 0, "val_loss": 2.5},
            {"model": "b", "seed": 1, "val_loss": 2.7}]
    summary = compare.summarize(runs, baseline="a")
    assert summary["a"]["val_loss_sd"] is None
    assert summary["b"]["paired_seeds"] == 1 and summary["b"]["diff_vs_baseline_mean"] == pytest.approx(0.5)
    assert summary["b"]["diff_vs_baseline_sd"] is None


class CallRecorder(torch.nn.Module):
    """A backbone that records each call as (name, "train" or "decode", tokens) in a shared list."""

    def __init__(self, name: str, inner: torch.nn.Module, calls: list):
        super().__init__()
        self.name, self.inner, self.calls, self.config = name, inner, calls, inner.config

    def forward(self, idx, state=None):
        self.calls.append((self.name, "train" if torch.is_grad_enabled() else "decode", idx.shape[1]))
        return self.inner(idx, state)


def test_timing_pass_interleaves_the_models_round_by_round(monkeypatch):
    from ltcx.models.catalog import build_tiny

    loads = iter([0.5, 1.5, 0.7])
    monkeypatch.setattr(compare.os, "getloadavg", lambda: (next(loads), 0.0, 0.0))
    calls = []
    torch.manual_seed(0)
    backbones = {name: CallRecorder(name, build_tiny(name, 64), calls) for name in ("gpt", "ltc")}
    speeds, seen = compare.interleaved_timings(backbones, batch_size=2, block_size=16, device=torch.device("cpu"),
                                               rounds=2)
    assert seen == [0.5, 1.5, 0.7]  # before the first round and after each
    assert calls[:2] == [("gpt", "decode", 8), ("ltc", "decode", 8)]  # the states decode starts from
    train = [name for name, kind, _ in calls if kind == "train"]
    assert train == ["gpt", "ltc", "gpt", "ltc", "ltc", "gpt"]  # warm-up, then rounds whose first model rotates
    decode = [name for name, kind, tokens in calls[2:] if kind == "decode"]
    assert all(tokens == 1 for _, kind, tokens in calls[2:] if kind == "decode")
    assert decode == ["gpt", "ltc"] + ["gpt", "ltc"] * 4 + ["ltc", "gpt"] * 4
    for name in backbones:
        assert speeds[name]["tokens_per_sec"] > 0 and speeds[name]["decode_ms_per_token"] > 0


def made_up_summary(timing: dict | None) -> dict:
    """A summary with a one-seed model (a) and a three-seed model (b, baseline)."""
    models = {
        "a": {"seeds": [0], "val_loss_mean": 8.6, "val_loss_sd": None, "diff_vs_baseline_mean": -0.08,
              "tokens_per_sec": 100.0, "decode_ms_per_token": 2.0},
        "b": {"seeds": [0, 1, 2], "val_loss_mean": 8.68, "val_loss_sd": 0.05, "tokens_per_sec": 120.0,
              "decode_ms_per_token": 3.0},
    }
    runs = [{"model": "a", "seed": 0, "curve": [[10, 9.0], [20, 8.6]]}] + [
        {"model": "b", "seed": s, "curve": [[10, 9.0 + s / 10], [20, 8.6 + s / 10]]} for s in range(3)]
    return {"baseline": "b", "tokens": 20, "models": models, "runs": runs, **({"timing": timing} if timing else {})}


def test_final_loss_is_points_with_sd_error_bars_and_none_for_one_seed():
    summary = made_up_summary(None)
    colours = {"a": "red", "b": "blue"}
    figure = plot_results.final_loss_figure(summary, ["a", "b"], colours)
    axes = figure.axes[0]
    assert not [p for p in axes.patches if isinstance(p, matplotlib.patches.Rectangle)]  # no bars
    one_seed, three_seeds = axes.containers
    assert not one_seed.has_yerr  # no error bar of zero length for one seed
    assert three_seeds.has_yerr
    (bar,) = three_seeds.lines[2]  # the vertical error line: mean +- sd
    (segment,) = bar.get_segments()
    assert [y for _, y in segment] == pytest.approx([8.63, 8.73])
    labels = [t.get_text() for t in axes.get_xticklabels()]
    assert labels == ["a\n-0.080\n1 seed", "b\n3 seeds"]
    curves = plot_results.curves_figure(summary, colours).axes[0]
    assert len(curves.collections) == 1  # a band for b only
    assert [t.get_text() for t in curves.get_legend().get_texts()] == ["a (1 seed)", "b (3 seeds)"]
    matplotlib.pyplot.close("all")


LOADED = {"speed_unreliable": True, "load_average_max": 7.25, "usable_cores": 2}


@pytest.mark.parametrize("timing, notes", [
    (LOADED, ["UNRELIABLE: load average 7.2 exceeded the 2 usable cores while timing"]),
    ({**LOADED, "speed_unreliable": False}, []),
    (None, ["not timed (compare.py --timing_rounds 0)"]),
    ("absent", ["UNRELIABLE: each run timed itself at a different hour (a summary from before the timing pass)"]),
])
def test_throughput_figure_notes_a_loaded_machine(timing, notes):
    summary = made_up_summary(None)
    if timing != "absent":
        summary["timing"] = timing
    figure = plot_results.throughput_figure(summary, ["a", "b"], {"a": "red", "b": "blue"})
    assert [t.get_text() for t in figure.texts] == notes
    matplotlib.pyplot.close("all")


def tiny_config(folder: Path, arch: str, init_args: dict) -> Path:
    config = yaml.safe_load((ROOT / f"configs/{arch}.yaml").read_text())
    config["config"] = str(ROOT / "configs" / config["config"])  # the recipe, relative to the copied YAML's folder
    config["model.backbone"]["init_args"].update(init_args)
    config["model.warmup_steps"] = 2  # a dotted key: a nested model: after the recipe would replace its model:
    path = folder / f"{arch}.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return path


def test_tiny_comparison_end_to_end(tmp_path, capsys, monkeypatch):
    passes = []  # the models of each timing pass

    def counted(backbones, *args, **kwargs):
        passes.append(sorted(backbones))
        return interleaved_timings(backbones, *args, **kwargs)

    interleaved_timings = compare.interleaved_timings
    monkeypatch.setattr(compare, "interleaved_timings", counted)
    monkeypatch.setattr(compare.os, "getloadavg", lambda: (1e3, 1e3, 1e3))  # a machine far busier than its cores
    data = write_corpus(tmp_path / "corpus", 80, 10)
    tiny = {"n_layer": 1, "n_embd": 32, "n_head": 2, "n_kv_head": 1, "block_size": 64}
    configs = [tiny_config(tmp_path, "gpt", tiny), tiny_config(tmp_path, "ltc", {**tiny, "num_decay_modes": 4})]
    argv = ["--name", "tiny", "--configs", *map(str, configs), "--seeds", "0", "1", "--baseline", "gpt",
            "--tokens", "512", "--batch_size", "4", "--block_size", "32", "--evals", "2",
            "--out", str(tmp_path / "results"), "--timing_rounds", "1",
            "--", "--data.path", str(data), "--data.val_batches", "1"]
    compare.main(argv)
    folder = tmp_path / "results/tiny"
    summary = json.loads((folder / "summary.json").read_text())
    assert [(r["model"], r["seed"]) for r in summary["runs"]] == [("gpt", 0), ("ltc", 0), ("gpt", 1), ("ltc", 1)]
    for run in summary["runs"]:
        assert run["steps"] == 4 and [t for t, _ in run["curve"]] == [2 * 128, 4 * 128]
        assert math.isfinite(run["val_loss"])
        assert run["params"] > 0 and run["state_bytes_per_token"] > 0 and "decode_ms_per_token" not in run
        log = (folder / "runs" / run["model"] / f"seed{run['seed']}" / "run.log").read_text()
        assert "step 2/4 (50%)  val/loss " in log and "step 4/4 (100%)  val/loss " in log  # progress lines
    assert summary["models"]["ltc"]["paired_seeds"] == 2
    assert passes == [["gpt", "ltc"]]  # one pass, after the runs, both models in it
    timing = summary["timing"]
    assert timing["checkpoints"]["ltc"][0].startswith(str(folder / "runs/ltc/seed0/"))  # the lowest seed's
    for model in ("gpt", "ltc"):
        assert summary["models"][model]["tokens_per_sec"] == timing["models"][model]["tokens_per_sec"] > 0
        assert summary["models"][model]["decode_ms_per_token"] == timing["models"][model]["decode_ms_per_token"] > 0
    assert summary["speed_unreliable"] and timing["load_average_max"] == 1e3
    table = (folder / "summary.md").read_text()
    assert "| gpt | 2 |" in table and "train tokens/s (unreliable) | decode ms/token (unreliable) |" in table
    assert "**The speed columns are unreliable**: the load average (1000.0) exceeded the" in table

    capsys.readouterr()
    (folder / "runs/ltc/seed1/result.json").unlink()  # as if the comparison was killed after that run's last save
    compare.main(argv)  # finished runs are not redone; the stopped one continues from its checkpoint
    out = capsys.readouterr().out
    assert out.count("done before, skipped") == 3 and "ltc seed 1: training 4 steps (resumed)" in out
    assert "timing pass: done before for these checkpoints, reused" in out and len(passes) == 1
    log = (folder / "runs/ltc/seed1/run.log").read_text()
    # finished: the resume trains nothing
    assert "is at step 4, at or past trainer.max_steps 4: nothing to train" in log
    assert json.loads((folder / "summary.json").read_text())["models"]["ltc"]["paired_seeds"] == 2

    monkeypatch.setattr(compare.os, "getloadavg", lambda: (0.0, 0.0, 0.0))
    compare.main([*argv[:argv.index("--")], "--retime", *argv[argv.index("--"):]])  # a quiet machine now
    assert len(passes) == 2
    summary = json.loads((folder / "summary.json").read_text())
    assert not summary["speed_unreliable"] and "unreliable" not in (folder / "summary.md").read_text()

    written = plot_results.plot(folder)
    assert [p.name for p in written] == ["val_loss_curves.png", "final_val_loss.png", "throughput.png"]
    assert all(p.read_bytes().startswith(b"\x89PNG") for p in written)


@pytest.mark.parametrize("flag", ["--evals", "--batch_size", "--block_size", "--tokens"])
def test_a_count_below_one_is_one_line_before_any_run(tmp_path, capsys, flag):
    argv = ["--name", "x", "--configs", "gpt", "--tokens", "512", "--batch_size", "4", "--block_size", "32",
            "--out", str(tmp_path / "results")]
    with pytest.raises(SystemExit) as exit_info:
        compare.main([*argv, flag, "0"])  # the last value given wins
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err == f"compare: error: argument {flag}: 0 is below 1: pass an integer >= 1 (see --help)\n"
    assert not (tmp_path / "results").exists()
