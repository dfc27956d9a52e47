"""scripts/compare.py and scripts/plot_results.py: the summary maths on made-up runs, and a tiny real
comparison (2 configs x 2 seeds) through the CLI to JSON, Markdown and PNG files, resumed without rework."""

import json
import math
from pathlib import Path

import pytest
import yaml

from helpers import load_script, write_corpus

ROOT = Path(__file__).resolve().parents[1]


compare = load_script("compare")


def test_summary_means_and_paired_differences():
    losses = {"gpt": [4.0, 4.2, 4.1], "ltc": [3.9, 4.0, 4.05]}
    runs = [{"model": m, "seed": s, "val_loss": loss, "params": 10, "tokens_per_sec": 100.0 + s}
            for m, values in losses.items() for s, loss in enumerate(values)]
    summary = compare.summarize(runs, baseline="gpt")
    assert summary["gpt"]["val_loss_mean"] == pytest.approx(4.1)
    assert summary["gpt"]["val_loss_sd"] == pytest.approx(0.1)
    assert "diff_vs_baseline_mean" not in summary["gpt"]
    diffs = [-0.1, -0.2, -0.05]
    assert summary["ltc"]["diff_vs_baseline_mean"] == pytest.approx(sum(diffs) / 3)
    mean = sum(diffs) / 3
    assert summary["ltc"]["diff_vs_baseline_sd"] == pytest.approx(math.sqrt(sum((d - mean) ** 2 for d in diffs) / 2))
    assert summary["ltc"]["tokens_per_sec"] == pytest.approx(101.0)
    assert summary["ltc"]["decode_ms_per_token"] is None
    table = compare.markdown_table(summary, "gpt")
    assert table.splitlines()[2].startswith("| ltc | 3 | 3.9833 +- 0.0764 | -0.1167 +- 0.0764 |")


def test_paired_difference_uses_only_shared_seeds_and_one_seed_has_no_sd():
    runs = [{"model": "a", "seed": 0, "val_loss": 2.0}, {"model": "b", "seed": 0, "val_loss": 2.5},
            {"model": "b", "seed": 1, "val_loss": 2.7}]
    summary = compare.summarize(runs, baseline="a")
    assert summary["a"]["val_loss_sd"] is None
    assert summary["b"]["paired_seeds"] == 1 and summary["b"]["diff_vs_baseline_mean"] == pytest.approx(0.5)
    assert summary["b"]["diff_vs_baseline_sd"] is None


def tiny_config(folder: Path, arch: str, init_args: dict) -> Path:
    config = yaml.safe_load((ROOT / f"configs/{arch}.yaml").read_text())
    config["config"] = str(ROOT / "configs" / config["config"])  # the recipe, relative to the copied YAML's folder
    config["model.backbone"]["init_args"].update(init_args)
    config["model.warmup_steps"] = 2  # a dotted key: a nested model: after the recipe would replace its model:
    path = folder / f"{arch}.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return path


def test_tiny_comparison_end_to_end(tmp_path, capsys):
    data = write_corpus(tmp_path / "corpus", 80, 10)
    tiny = {"n_layer": 1, "n_embd": 32, "n_head": 2, "n_kv_head": 1, "block_size": 64}
    configs = [tiny_config(tmp_path, "gpt", tiny), tiny_config(tmp_path, "ltc", {**tiny, "num_decay_modes": 4})]
    argv = ["--name", "tiny", "--configs", *map(str, configs), "--seeds", "0", "1", "--baseline", "gpt",
            "--tokens", "512", "--batch_size", "4", "--block_size", "32", "--evals", "2",
            "--out", str(tmp_path / "results"),
            "--", "--data.path", str(data), "--data.val_batches", "1"]
    compare.main(argv)
    folder = tmp_path / "results/tiny"
    summary = json.loads((folder / "summary.json").read_text())
    assert [(r["model"], r["seed"]) for r in summary["runs"]] == [("gpt", 0), ("ltc", 0), ("gpt", 1), ("ltc", 1)]
    for run in summary["runs"]:
        assert run["steps"] == 4 and [t for t, _ in run["curve"]] == [2 * 128, 4 * 128]
        assert math.isfinite(run["val_loss"])
        assert run["params"] > 0 and run["decode_ms_per_token"] > 0 and run["state_bytes_per_token"] > 0
    assert summary["models"]["ltc"]["paired_seeds"] == 2
    assert "| gpt | 2 |" in (folder / "summary.md").read_text()

    capsys.readouterr()
    (folder / "runs/ltc/seed1/result.json").unlink()  # as if the comparison was killed after that run's last save
    compare.main(argv)  # finished runs are not redone; the stopped one continues from its checkpoint
    out = capsys.readouterr().out
    assert out.count("done before, skipped") == 3 and "ltc seed 1: training 4 steps (resumed)" in out
    log = (folder / "runs/ltc/seed1/run.log").read_text()
    # finished: the resume trains nothing
    assert "is at step 4, at or past trainer.max_steps 4: nothing to train" in log
    assert json.loads((folder / "summary.json").read_text())["models"]["ltc"]["paired_seeds"] == 2

    plot_results = load_script("plot_results")
    written = plot_results.plot(folder)
    assert [p.name for p in written] == ["val_loss_curves.png", "final_val_loss.png", "throughput.png"]
    assert all(p.read_bytes().startswith(b"\x89PNG") for p in written)
