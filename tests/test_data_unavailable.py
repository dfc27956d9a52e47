"""Data that goes away or was never reachable: an unreadable file mid-training is named, an offline hub fails at once,
an unreachable one is found by one short probe."""

from pathlib import Path

from helpers import (
    assert_mentions,
    fit_args,
    lean_fit_args,
    one_error_line,
)


def test_unreadable_file_mid_training_is_named(tmp_path, fit_env, capsys):
    corpus = tmp_path / "jsonl"
    corpus.mkdir()
    for i in range(4):
        lines = [f'{{"text": "the cat sat on the mat number {i} {j} and ran off"}}' for j in range(12)]
        if i == 2:
            lines.insert(3, "{not json")
        (corpus / f"part-{i}.jsonl").write_text("\n".join(lines) + "\n")
    line = one_error_line(lean_fit_args(tmp_path, corpus, "--trainer.max_steps", "200"), capsys)
    assert_mentions(line, "cannot read", f"'{corpus / 'part-2.jsonl'}'", "ArrowInvalid: JSON parse", "fix or remove it")



def test_offline_hub_data_and_tokenizer_fail_at_once(tmp_path, fit_env, capsys, no_backoff):
    """"At once": no retries with back-off (the no_backoff fixture), whatever the load of the machine."""
    line = one_error_line(fit_args(Path("roneneldan/TinyStories"), "--trainer.max_steps", "1"), capsys)
    assert_mentions(line, "cannot load data set 'roneneldan/TinyStories'", "Hugging Face hub", "offline mode is set",
                    "HF_HUB_OFFLINE / HF_DATASETS_OFFLINE", "--data.path sample", "--data.path at local",
                    ".txt/.jsonl/.parquet")
    line = one_error_line(fit_args(fit_env, "--data.tokenizer", "some-org/no-such-tokenizer"), capsys)
    assert_mentions(line, "unknown tokenizer 'some-org/no-such-tokenizer'", "not in the local cache", "offline mode")



def test_unreachable_hub_is_found_by_one_short_probe(tmp_path, fit_env, monkeypatch, capsys, no_backoff):
    """Offline mode not set, but no hub: one connection attempt (here to a closed local port) and the line."""
    import huggingface_hub.constants

    for flag in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE"):
        monkeypatch.delenv(flag, raising=False)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(huggingface_hub.constants, "ENDPOINT", "http://127.0.0.1:9")
    monkeypatch.setenv("NO_PROXY", "*")
    line = one_error_line(fit_args(Path("roneneldan/TinyStories"), "--trainer.max_steps", "1"), capsys)
    assert_mentions(line, "cannot load data set 'roneneldan/TinyStories'", "Hugging Face hub",
                    "no connection to 127.0.0.1:9", "within 3 s", "--data.path sample")

