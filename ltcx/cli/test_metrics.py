"""``ltcx test``'s output: the test split's metrics to ``test_metrics.json`` in the run's log folder, and a line saying
where (what ``ltcx study`` reads)."""

from __future__ import annotations

import os

__all__ = ["TEST_METRICS", "write_test_metrics"]

TEST_METRICS = "test_metrics.json"


def write_test_metrics(trainer, model) -> str | None:
    """``trainer``'s finished test run as one flat JSON object, written atomically by global rank 0 into
    ``trainer.log_dir``: ``test/loss``, ``test/ppl``, ``test/bpb`` (text with a tokenizer of fixed bytes per token),
    ``test/recall_acc`` (MQAR), and the ``tokens`` (and ``bytes``) of the targets scored, over every rank. Returns
    its path (None on other ranks)."""
    from ltcx.data.shard_format import write_json

    if not trainer.is_global_zero:
        return None
    metrics: dict[str, float | int] = {
        key: float(value) for key, value in sorted(trainer.callback_metrics.items(), key=lambda kv: _order(kv[0]))
        if key.startswith("test/")
    }
    metrics.update(getattr(model, "test_counts", {}))
    folder = trainer.log_dir or trainer.default_root_dir
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, TEST_METRICS)
    write_json(path, metrics)  # a non-finite loss is written as Python's json writes it (NaN, Infinity)
    shown = ", ".join(f"{key} {value:.4f}" for key, value in metrics.items() if key.startswith("test/"))
    print(f"ltcx: test: {shown}; metrics in {path}", flush=True)
    return path


def _order(key: str) -> tuple[int, str]:
    known = ("test/loss", "test/ppl", "test/bpb", "test/recall_acc")
    return (known.index(key), key) if key in known else (len(known), key)
