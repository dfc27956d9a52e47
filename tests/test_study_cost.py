"""What a study costs and what it reads: the estimate ``--dry_run`` prints is a pure function of the runs' FLOPs,
steps and processes and the rates passed in (no timing here); sample-check's splits hold distinct blocks, and a
split too small for its batches is said in one line; docs/recall.md's table is the kept results' or says it
awaits them."""

import json

import pytest

from helpers import ROOT
from ltcx.study.cost import estimate, run_flops, study_estimate
from ltcx.study.spec import find_spec, load_spec


def test_the_estimate_is_flops_over_the_rate_plus_steps_plus_starts():
    assert run_flops(6e6, steps=10, batch_size=8, block_size=64, eval_batches=6) == 6e6 * 512 * (10 + 2)
    found = estimate([1e12, 2e12], rate=1e10, steps_s=[5.0, 5.0], processes=3, start_s=2.0)
    assert found.cpu_s == pytest.approx(300 + 10 + 6)
    assert "5.3 CPU-minutes" in found.describe() and "3 processes x 2 CPU-s" in found.describe()
    with pytest.raises(ValueError):
        estimate([1.0], rate=0.0, steps_s=[], processes=1, start_s=1.0)


def test_sample_checks_estimate_counts_every_run_process_and_flop():
    from ltcx.study.budget import figures
    from ltcx.study.plan import make_run, plan_shapes

    spec = load_spec(find_spec("sample-check"))
    shapes = plan_shapes(spec)
    tuning = [make_run(spec, shape, lr, spec.tune_seed) for shape in shapes for lr in spec.learning_rates]
    base, grown = study_estimate(spec, shapes, tuning, rate=1e9, step_s={"gpt": 0.01, "ltc": 0.02}, start_s=3.0)
    assert (len(shapes), len(tuning)) == (4, 8)
    assert base.processes == 8 + 4 + 4  # tuning, seed 1 (tested in its fit), ltcx test of seed 0's
    assert grown.processes == 4 * spec.lr_extend
    tokens = spec.batch_size * spec.block_size
    per_token = {s.label + s.arch: figures(s.arch, {**s.init_args, "vocab_size": 320}, 64, 64)[1] for s in shapes}
    # per shape: 2 tuning runs (24 steps, 2 x 2 validation batches), seed 1's (and its 2 test batches), seed 0's test
    expected = sum(f * tokens * (2 * (24 + 4 / 3) + (24 + 6 / 3) + 2 / 3) for f in per_token.values())
    assert base.flops == pytest.approx(expected)
    layers_steps = 2 * (2 * (24 + 4 / 3) + (24 + 6 / 3) + 2 / 3)
    assert base.steps_s == pytest.approx(2 * layers_steps * (0.01 + 0.02))


def test_sample_checks_test_split_holds_distinct_blocks_and_a_small_split_is_said(capsys):
    from ltcx.data import TextDataModule
    from ltcx.study.plan import data_args

    spec = load_spec(find_spec("sample-check"))
    _, args = data_args(spec, "gpt")
    for small in (False, True):
        data = TextDataModule(**{**args, **({"test_fraction": 0.005, "test_batches": 8} if small else {})})
        data.setup("test")
        blocks = [tuple(row.tolist()) for batch in data.test_dataloader() for row in batch]
        assert len(blocks) == data.test_batches * data.batch_size
        notice = capsys.readouterr().err
        if small:
            assert len(set(blocks)) < len(blocks) and notice.count("\n") == 1
            assert "the test split holds" in notice and "test_fraction" in notice
        else:
            assert len(set(blocks)) == len(blocks) and notice == ""


def test_the_recall_pages_table_is_its_kept_results_or_says_it_awaits_them(tmp_path):
    from ltcx.study.report import recall_table

    page = (ROOT / "docs/recall.md").read_text()
    kept = ROOT / "docs/results/quick-recall.json"
    if kept.is_file():
        assert recall_table(json.loads(kept.read_text())) in page
    else:
        assert "Awaiting a measurement" in page and "| gpt |" not in page
    summary = {"sizes": ["size32"], "metric": "recall_acc", "results": [
        {"arch": "gpt", "size_label": "size32", "lr": 0.01, "edge": True, "incomplete": [],
         "test": {"mean": 0.9, "ci95": 0.05}, "test_by_seed": {"1": 0.88, "0": 0.92}}]}
    assert recall_table(summary).splitlines()[2] == "| gpt | 0.01 (edge) | 0.900 +- 0.050 (0.92, 0.88) |"
