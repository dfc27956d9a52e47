"""The docs stay true: README.md's commands stay runnable (every flag and path a command names exists, every `run.py`
command parses, and the Quickstart's own run, shrunk to a tiny model, takes the Generate, Share and Evaluate commands
exactly as written), and docs/testing.md names every test module."""

import re
import shlex
import subprocess
import sys

import pytest

from helpers import ROOT, TINY_MODEL
from ltcx.cli import LIGHTNING_COMMANDS, main

README = (ROOT / "README.md").read_text()


def readme_commands() -> list[list[str]]:
    """The commands in the README's indented blocks (continuation lines joined, comments dropped), without the
    output lines it quotes."""
    commands, pending = [], ""
    for line in README.splitlines():
        if not line.startswith("    ") or line.startswith("     ") and not pending:
            pending = ""
            continue
        text = pending + line.strip()
        if text.endswith("\\"):
            pending = text[:-1] + " "
            continue
        pending = ""
        words = shlex.split(text, comments=True)
        if words and (words[0] in ("ltcx", "tensorboard") or words[:2] in (["python", "run.py"], ["python", "-m"])
                      or (words[0] == "python" and words[1].startswith("scripts/"))):
            commands.append(words)
    return commands


COMMANDS = readme_commands()


def test_the_readme_has_its_commands():
    verbs = {tuple(c[:3]) if c[0] == "python" else tuple(c[:2]) for c in COMMANDS}
    for expected in [("python", "run.py", "fit"), ("ltcx", "generate"), ("ltcx", "export"), ("ltcx", "prepare"),
                     ("ltcx", "evaluate"), ("ltcx", "lm-eval"), ("ltcx", "study"),
                     ("python", "-m", "pytest")]:
        assert expected in verbs, expected


@pytest.mark.parametrize("words", COMMANDS, ids=[" ".join(c)[:60] for c in COMMANDS])
def test_every_path_a_command_names_exists(words):
    for word in words:
        for path in re.findall(r"(?:configs|scripts)/[\w/.-]+\.(?:yaml|py)", word):
            assert (ROOT / path).is_file(), path


FITS = [c for c in COMMANDS if c[:2] == ["python", "run.py"] and c[2] in LIGHTNING_COMMANDS]


@pytest.mark.parametrize("words", FITS, ids=[" ".join(c[2:])[:60] for c in FITS])
def test_every_run_py_command_parses(words, monkeypatch, tmp_path, capsys):
    """Every flag and value of a `python run.py fit ...` line is one the CLI accepts (`--print_config` parses the
    whole command and stops before building anything)."""
    monkeypatch.chdir(ROOT)
    monkeypatch.setattr(sys, "argv", ["ltcx"])
    with pytest.raises(SystemExit) as stop:
        main([*words[2:], "--print_config"])
    assert stop.value.code in (0, None), capsys.readouterr().err


OTHERS = [c for c in COMMANDS if (c[0] == "ltcx" and c[1] not in LIGHTNING_COMMANDS) or c[1].startswith("scripts/")]


@pytest.mark.parametrize("words", OTHERS, ids=[" ".join(c[:2])[:60] for c in OTHERS])
def test_every_flag_of_the_other_commands_exists(words):
    """The argparse commands and the scripts: each `--flag` the README gives appears in the command's own help."""
    command = [sys.executable, str(ROOT / "run.py"), words[1]] if words[0] == "ltcx" else [sys.executable, words[1]]
    help_text = subprocess.run([*command, "--help"], cwd=ROOT, capture_output=True, text=True, timeout=300).stdout
    for flag in (w.split("=", 1)[0] for w in words if w.startswith("--")):
        assert re.search(rf"{re.escape(flag)}\b", help_text), f"{flag} is not an option of {' '.join(words[:2])}"


def test_the_pytest_commands_name_markers_that_exist():
    markers = (ROOT / "pyproject.toml").read_text()
    for words in (c for c in COMMANDS if c[:3] == ["python", "-m", "pytest"]):
        for marker in (words[i + 1] for i, w in enumerate(words) if w == "-m" and i > 2):
            assert f'"{marker}:' in markers, marker


def test_the_quickstart_run_takes_the_generate_share_and_evaluate_commands(tmp_path, monkeypatch, capsys):
    """The Quickstart's fit with a tiny model and 2 steps, then the README's generate, export and evaluate lines
    verbatim, in the same folder, as a reader would run them (the long-context default's plan cut to one short
    run)."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "argv", ["ltcx"])
    quickstart = next(c for c in FITS if c[2] == "fit" and "configs/trainer/smoke.yaml" in c and len(c) == 7)
    config = [str(ROOT / w) if w.startswith("configs/") else w for w in quickstart[2:]]
    tiny = [w for i, w in enumerate(TINY_MODEL) if "block_size" not in w and "block_size" not in TINY_MODEL[i - 1]]
    main([*config, *tiny, "--trainer.max_steps", "2", "--trainer.val_check_interval", "2",
          "--data.batch_size", "2", "--data.val_batches", "1", "--trainer.enable_progress_bar", "false"])
    assert (tmp_path / "checkpoints/gpt/version_0/last.ckpt").is_file()
    from ltcx.study import long_context as cpu_default  # --train cpu's 18 CPU-minutes cut to one run of 4 steps

    plan = cpu_default.plan()
    monkeypatch.setattr(cpu_default, "plan", lambda: [r for r in plan if r.label == "gpt-rope"][:1])
    monkeypatch.setattr(cpu_default, "STEPS", 4)
    for verb in ("generate", "export", "evaluate"):
        for words in (c for c in COMMANDS if c[:2] == ["ltcx", verb]):
            capsys.readouterr()
            main(words[1:])
            out = capsys.readouterr().out
            if verb == "generate":
                assert out.startswith("Once upon a time"), out
    assert (tmp_path / "gpt-sample/model.safetensors").is_file()
    assert list(tmp_path.glob("evaluation/*.json"))


def test_docs_testing_names_every_test_module():
    listed = (ROOT / "docs/testing.md").read_text()
    for module in sorted((ROOT / "tests").glob("test_*.py")):
        assert f"| `{module.name}` |" in listed, f"docs/testing.md does not describe {module.name}"
