"""The Lightning commands' bare ``--help`` and unknown flags, answered from the stored help pages without importing
Lightning: the pages are what the parser prints, their options are the parser's, and a flag refused early is one the
parser refuses too."""

import subprocess
import sys

import pytest

from helpers import ROOT, fit_args, one_error_line
from ltcx.cli import help_pages
from ltcx.cli.early_checks import unknown_flag
from ltcx.cli.help_pages import COMMANDS, current_page, installed_versions, page_options, stored_page
from ltcx.cli.lightning import LtcxCLI, cli_main
from ltcx.errors import LtcxError

REWRITE = "stale help pages: rewrite them with `python -m ltcx.cli.help_pages` and commit ltcx/cli/help_pages/"


def test_the_stored_pages_are_what_the_parser_prints():
    """After a change to an argument, its help or a pinned version, this fails until the pages are rewritten."""
    assert current_page("fit") is not None, REWRITE  # the stored versions are the installed ones
    rendered = help_pages.render_pages()
    for command in COMMANDS:
        assert rendered[command] == current_page(command), f"{command}: {REWRITE}"
        assert rendered[command].startswith(f"usage: ltcx [options] {command} [-c CONFIG] ")


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
def test_a_pages_options_are_its_parsers(parsers, command):
    """``--trainer.callbacks+`` (append) is the page's ``--trainer.callbacks``."""
    real = {name.rstrip("+") for action in parsers[command]._actions for name in action.option_strings}
    assert page_options(current_page(command)) == real


def test_the_bare_help_answers_without_importing_torch_or_lightning():
    code = ("import sys; sys.argv = ['run.py']\nfrom ltcx.cli import main\n"
            "for flag in ('--help', '-h'):\n"
            "    main(['fit', flag])\n"
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
    monkeypatch.setattr(help_pages, "installed_versions", lambda: {**installed_versions(), "lightning": "2.7.0"})
    assert stored_page("fit", ["--help"], "ltcx") is None and current_page("fit") is None


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
    assert unknown_flag(list(flags), page_options(current_page("fit"))) is None
    with pytest.raises(SystemExit) as stop:  # the parser takes it: --print_config prints and exits 0
        cli_main(fit_args(fit_env, *flags, "--print_config"))
    assert stop.value.code == 0
    capsys.readouterr()
