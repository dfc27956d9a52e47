"""The Lightning commands' bare ``--help``, unknown flags and values of the wrong type, answered from the stored
pages and options without importing Lightning: the pages are what the parser prints, the options and their types are
the parser's, a flag or value refused early is refused by the parser with the same line, and one it takes is left
to it."""

import json
import pathlib
import subprocess
import sys

import pytest

from helpers import ROOT, fit_args, one_error_line
from ltcx.cli import help_pages
from ltcx.cli.early_checks import check_typed_values, unknown_flag
from ltcx.cli.help_pages import COMMANDS, INDEX, current_page, installed_versions, stored_options, stored_page
from ltcx.cli.lightning import LtcxCLI, cli_main
from ltcx.errors import LtcxError

REWRITE = "stale help pages: rewrite them with `python -m ltcx.cli.help_pages` and commit ltcx/cli/help_pages/"


def test_the_stored_pages_and_options_are_what_the_parser_has():
    """After a change to an argument, its help or a pinned version, this fails until they are rewritten."""
    assert current_page("fit") is not None, REWRITE  # the stored versions are the installed ones
    pages, options = help_pages.render()
    assert options == json.loads(INDEX.read_text())["commands"], REWRITE
    for command in COMMANDS:
        assert pages[command] == current_page(command), f"{command}: {REWRITE}"
        assert pages[command].startswith(f"usage: ltcx [options] {command} [-c CONFIG] ")


class _Built(Exception):
    pass


@pytest.fixture(scope="module")
def parsers():
    """Each command's parser, as ``cli_main`` builds it (stopped before it parses)."""
    built = {}

    def stop(self, parser, args):
        built.update(self._subcommand_parsers)
        raise _Built

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(LtcxCLI, "parse_arguments", stop)
        with pytest.raises(_Built):
            cli_main(["fit"])
    return built


@pytest.mark.parametrize("command", COMMANDS)
def test_the_stored_options_and_types_are_the_parsers(parsers, command):
    """Every option string (``--trainer.callbacks+``, the append form, is ``--trainer.callbacks``), and the type of
    each whose type is made of builtins, read back as the very type hint the parser holds."""
    stored = stored_options(command)
    actions = {name.rstrip("+"): action for action in parsers[command]._actions for name in action.option_strings}
    assert set(stored) == set(actions)
    typed = {option for option, kind in stored.items() if kind is not None}
    assert {"--trainer.max_steps", "--trainer.precision", "--model.learning_rate", "--num_threads"} <= typed
    for option in typed:
        assert stored[option] == actions[option]._typehint, option


def test_the_bare_help_answers_without_importing_torch_or_lightning():
    code = ("import sys; sys.argv = ['run.py']\nfrom ltcx.cli import main\n"
            "for flag in ('--help', '-h'):\n"
            "    try:\n        main(['fit', flag])\n"
            "    except SystemExit as stop:\n        assert stop.code == 0\n"
            "print('torch' in sys.modules, 'lightning' in sys.modules, file=sys.stderr)")
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120,
                          env={"PATH": "", "COLUMNS": "100"})
    assert done.returncode == 0 and done.stderr.split() == ["False", "False"], done.stderr
    page = current_page("fit").replace("usage: ltcx ", "usage: run.py ", 1)
    assert done.stdout == page * 2


def test_any_other_help_goes_to_the_parser(monkeypatch):
    assert stored_page("fit", ["--help"], "ltcx") == current_page("fit")
    assert stored_page("fit", ["--config", "configs/gpt.yaml", "--help"], "ltcx") is None  # that file's values
    assert stored_page("fit", ["--model.backbone.help", "GPT"], "ltcx") is None
    assert stored_page("generate", ["--help"], "ltcx") is None
    monkeypatch.setenv("COLUMNS", "60")  # the parser wraps to a terminal narrower than the page
    assert stored_page("fit", ["--help"], "ltcx") is None
    monkeypatch.setenv("COLUMNS", "200")
    assert stored_page("fit", ["--help"], "ltcx") is not None

@pytest.mark.parametrize("change", ["another Lightning", "an edited LanguageModel"])
def test_with_other_versions_or_sources_everything_goes_to_the_parser(monkeypatch, change):
    """A researcher's own new argument (``ltcx/lm.py`` edited) is the parser's to judge, not refused as unknown."""
    if change == "another Lightning":
        monkeypatch.setattr(help_pages, "installed_versions", lambda: {**installed_versions(), "lightning": "2.7.0"})
    else:
        read_bytes = pathlib.Path.read_bytes
        monkeypatch.setattr(pathlib.Path, "read_bytes", lambda path: read_bytes(path) + (
            b"\n# an edit\n" if path.name == "lm.py" else b""))
    help_pages._current_index.cache_clear()  # read once per process
    try:
        assert stored_page("fit", ["--help"], "ltcx") is None and current_page("fit") is None
        assert stored_options("fit") is None  # nor are flags judged early
    finally:
        monkeypatch.undo()
        help_pages._current_index.cache_clear()


# A refused flag's line, and a flag only the parser judges (argparse takes a unique start of an option for it; the
# names below an option that takes a class are that class's).
UNKNOWN = {
    ("--trainer.max_stepz", "5"): "--trainer.max_stepz (did you mean --trainer.max_steps?)",
    ("--max_steps", "5"): "--max_steps (did you mean --trainer.max_steps?)",
    ("--model.learnig_rate=1e-3", "--max_stepz=5"): "--model.learnig_rate (did you mean --model.learning_rate?)",
    ("--bogus_flag", "1"): "--bogus_flag",
}
KNOWN = [
    ("--trainer.max_step", "5"), ("--data.batch_size", "2"), ("--model.backbone.init_args.n_layer", "1"),
    ("--model.backbone.n_layer", "1"), ("--trainer.logger.init_args.name", "x"), ("--seed_everything=3",),
    ("--trainer.callbacks+=lightning.pytorch.callbacks.LearningRateMonitor",), ("--trainer.max_steps", "-1"),
]


@pytest.mark.parametrize("flags", UNKNOWN, ids=lambda flags: flags[0])
def test_an_unknown_flag_is_refused_before_lightning_with_the_closest_option(fit_env, capsys, flags):
    line = one_error_line(fit_args(fit_env, *flags), capsys)
    assert line == f"ltcx: error: unrecognized arguments: {UNKNOWN[flags]}; see `ltcx fit --help`"
    with pytest.raises(LtcxError, match="unrecognized arguments: --"):  # the parser refuses it too
        cli_main(fit_args(fit_env, *flags))


@pytest.mark.parametrize("flags", KNOWN, ids=lambda flags: flags[0])
def test_a_flag_the_parser_takes_is_left_to_it(fit_env, capsys, flags):
    assert unknown_flag(list(flags), stored_options("fit")) is None
    check_typed_values(list(flags), stored_options("fit"), "ltcx fit")
    with pytest.raises(SystemExit) as stop:  # the parser takes it: --print_config prints and exits 0
        cli_main(fit_args(fit_env, *flags, "--print_config"))
    assert stop.value.code == 0
    capsys.readouterr()


# Values of the wrong type, each refused early with the parser's own line, and values it takes.
BAD_VALUES = [("--trainer.max_steps", "x"), ("--trainer.max_steps=1e3",), ("--model.learning_rate", "nan"),
              ("--trainer.precision", "7"), ("--model.betas", "[0.9]"), ("--model.decay_steps", "abc"),
              ("--trainer.enable_checkpointing", "maybe"), ("--seed_everything", "x"), ("--num_threads", "1.5"),
              ("--trainer.max_steps", "5", "--trainer.limit_val_batches", "a")]
GOOD_VALUES = [("--trainer.max_steps", "5"), ("--trainer.precision", "bf16-mixed"), ("--model.betas", "[0.9,0.99]"),
               ("--model.decay_steps", "null"), ("--trainer.devices+", "3"), ("--trainer.max_time", "00:01:00:00"),
               ("--num_threads=2",), ("--trainer.limit_val_batches", "0.5"), ("--seed_everything", "true")]


@pytest.mark.parametrize("flags", BAD_VALUES, ids=lambda flags: flags[-2] if len(flags) > 1 else flags[0])
def test_a_value_of_the_wrong_type_is_refused_before_lightning_with_the_parsers_line(fit_env, capsys, flags):
    early = one_error_line(fit_args(fit_env, *flags), capsys)
    with pytest.raises(LtcxError) as full:  # the full parser, Lightning's
        cli_main(fit_args(fit_env, *flags))
    assert early == f"ltcx: error: {full.value}"


@pytest.mark.parametrize("flags", GOOD_VALUES, ids=lambda flags: flags[0])
def test_a_value_the_parser_takes_passes_the_early_check(fit_env, capsys, flags):
    check_typed_values(list(flags), stored_options("fit"), "ltcx fit")
    with pytest.raises(SystemExit) as stop:
        cli_main(fit_args(fit_env, *flags, "--print_config"))
    assert stop.value.code == 0
    capsys.readouterr()
