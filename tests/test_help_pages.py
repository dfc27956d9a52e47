"""The Lightning commands' bare ``--help``, unknown flags and values of the wrong type, answered from the stored
pages and options without importing Lightning: the pages are what the parser prints, the options and their types are
the parser's, a flag or value refused early is refused by the parser with the same line, and one it takes is left
to it."""

import json
import pathlib
import subprocess
import sys

import pytest

from helpers import ROOT, fit_args
from ltcx.cli import help_pages
from ltcx.cli.early_checks import check_lightning_command_line
from ltcx.cli.help_pages import COMMANDS, INDEX, current_page, installed_versions, stored_options, stored_page
from ltcx.cli.lightning import LtcxCLI, cli_main
from ltcx.errors import LtcxError

REWRITE = "stale help pages: rewrite them with `python -m ltcx.cli.help_pages` and commit ltcx/cli/help_pages/"


def test_the_stored_pages_and_options_are_what_the_parser_has():
    """After a change to an argument, its help or a pinned version, this fails until they are rewritten."""
    assert current_page("fit") is not None, REWRITE  # the stored versions are the installed ones
    pages, options = help_pages.render()  # in a terminal of 132 columns: the page is the same at any width
    assert options == json.loads(INDEX.read_text())["commands"], REWRITE
    for command in COMMANDS:
        assert pages[command] == current_page(command), f"{command}: {REWRITE}"
        assert pages[command].startswith(f"usage: ltcx [options] {command} [-c CONFIG] ")


@pytest.fixture(scope="module")
def parsers():
    return help_pages.command_parsers()


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
    monkeypatch.setenv("COLUMNS", "60")  # both lay the page out for 80 columns, whatever the terminal's width
    assert stored_page("fit", ["--help"], "ltcx") == current_page("fit")


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


# The early reading against the full parser, one command line after the base command line of a tiny fit. Each
# case: the early line, "same" (the early line is the full parser's), "refused" (the full parser refuses too, in its
# own words) or None (the early check passes it: the full parser accepts it, prints help, or refuses it for a reason
# judged only there).
CASES = {
    # values of the wrong type: the parser's line, where it stands in the line
    ("--trainer.max_steps", "x"): "same",
    ("--trainer.max_steps=1e3",): "same",
    ("--trainer.max_step", "x"): "same",  # argparse's abbreviation
    ("--model.learning_rate", "nan"): "same",
    ("--trainer.precision", "7"): "same",
    ("--model.betas", "[0.9]"): "same",
    ("--model.decay_steps", "abc"): "same",
    ("--trainer.enable_checkpointing", "maybe"): "same",
    ("--seed_everything", "x"): "same",
    ("--num_threads", "1.5"): "same",
    ("--trainer.max_steps", "5", "--trainer.limit_val_batches", "a"): "same",
    ("--trainer.max_steps", "x", "--bogus", "1"): "same",  # the value where it stands, unknowns after the line
    ("--trainer.max_steps", "x", "--config", "no-such.yaml"): "same",
    ("--trainer.max_steps", "x", "--ckpt_path", "no-such.ckpt"): "same",
    ("--trainer.max_steps",): "same",  # no value
    ("--trainer.max_steps", "--data.path", "x"): "same",  # no value: the next word is an option
    ("--trainer.max_steps", "-x"): "same",
    ("--trainer.max_steps", "--x y"): "same",  # a word with a space is a value
    ("--config", "no-such.yaml"): "same",
    ("--config", "last"): "same",  # a file's name here, not the checkpoint keyword
    ("--trainer.max_steps", "optimizer"): "same",  # a value, not the --optimizer flag
    # unknown flags: the closest option
    ("--trainer.max_stepz", "5"): "unrecognized arguments: --trainer.max_stepz (did you mean --trainer.max_steps?)",
    ("--max_steps", "5"): "unrecognized arguments: --max_steps (did you mean --trainer.max_steps?)",
    ("--model.learnig_rate=1e-3",): "unrecognized arguments: --model.learnig_rate (did you mean "
                                    "--model.learning_rate?)",
    ("--bogus_flag", "1"): "unrecognized arguments: --bogus_flag",
    ("--model.lr", "3e-4"): "unrecognized arguments: --model.lr (did you mean --model.learning_rate?)",
    ("--model.wd", "0"): "unrecognized arguments: --model.wd (did you mean --model.weight_decay?)",
    ("--trainer.foo", "1"): "refused",
    ("--data.path", "--bogus"): "refused",  # --data.path has no value, --bogus is unknown
    ("--optimizer", "torch.optim.SGD"): "refused",
    ("--ckpt_path", "no\nsuch.ckpt"): "refused",  # named on one line
    # the parser's to judge, or taken by it
    ("--trainer.max_step", "5"): None,
    ("--data.batch_size", "2"): None,
    ("--model.backbone.init_args.n_layer", "1"): None,
    ("--model.backbone.n_layer", "1"): None,
    ("--trainer.logger.init_args.name", "x"): None,
    ("--seed_everything=3",): None,
    ("--trainer.callbacks+=lightning.pytorch.callbacks.LearningRateMonitor",): None,
    ("--trainer.max_steps", "-1"): None,
    ("--trainer.devices+", "3"): None,
    ("--trainer.max_time", "00:01:00:00"): None,
    ("--model.betas", "[0.9,0.99]"): None,
    ("--model.decay_steps", "null"): None,
    ("--num_threads=2",): None,
    ("--trainer.limit_val_batches", "0.5"): None,
    ("--trainer.precision", "bf16-mixed"): None,
    ("--data.path", "--a=b c"): None,  # a value with a space
    ("--trainer.default_root_dir", "--x=1 y"): None,
    ("--ckpt_path", "~"): None,  # YAML's null
    ("--config", ""): None,  # not a missing file: the parser's own reasons
    ("--config", "corpus"): None,  # a folder (the test's corpus)
    ("--config", "null"): None,
    ("--ckpt_path=NULL",): None,
    ("--help", "--bogus"): None,  # the help, wherever an unknown flag stands
    ("--bogus", "--help"): None,
    ("-h", "--optimizer", "x"): None,
    ("--hel", "--trainer.max_steps", "x"): None,  # argparse's abbreviation of --help
    ("--data.help", "ltcx.data.TextDataModule", "--trainer.max_steps", "x"): None,
    ("--help", "--ckpt_path", "no-such.ckpt"): None,
    ("--", "--trainer.max_steps", "x"): None,  # after --: values the parser refuses as such
    ("--data.block_size", "x", "--trainer.max_steps", "5"): None,  # a class's argument: the parser's
    ("--model.eps.x", "3"): None,
}


class _Parsed(Exception):
    pass


def _full_parser(args: list[str]) -> str:
    """What LightningCLI's parser makes of ``args``: "accepted" (stopped before building anything), "help", or its
    error line."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(LtcxCLI, "before_instantiate_classes", lambda cli: (_ for _ in ()).throw(_Parsed()))
        try:
            cli_main(args)
        except _Parsed:
            return "accepted"
        except SystemExit as stop:
            return "help" if stop.code in (0, None) else f"exit {stop.code}"
        except LtcxError as error:
            return str(error)
    return "accepted"


@pytest.mark.parametrize("flags", CASES, ids=lambda flags: " ".join(flags)[:50])
def test_a_line_refused_early_is_refused_by_the_full_parser_with_its_line(fit_env, capsys, flags):
    args = fit_args(fit_env, *flags)
    try:
        check_lightning_command_line("fit", args[1:], "ltcx fit")
        early = None
    except LtcxError as error:
        early = str(error)
    full = _full_parser(args)
    capsys.readouterr()
    expected = CASES[flags]
    if expected is None:
        assert early is None, (early, full)
    elif expected == "same":
        assert early is not None and early == full, (early, full)
    elif expected == "refused":
        assert early is not None and full not in ("accepted", "help"), (early, full)
    else:
        assert early == f"{expected}; see `ltcx fit --help`" and full not in ("accepted", "help"), (early, full)


@pytest.mark.parametrize("command", ["validate", "predict"])
def test_the_other_commands_are_read_against_their_own_options(tmp_path, command):
    options = stored_options(command)
    assert "--verbose" in options if command == "validate" else "--return_predictions" in options
    with pytest.raises(LtcxError, match=r"unrecognized arguments: --max_steps \(did you mean --trainer.max_steps"):
        check_lightning_command_line(command, ["--max_steps", "3"], f"ltcx {command}")
    with pytest.raises(LtcxError, match="checkpoint 'no-such.ckpt' does not exist"):
        check_lightning_command_line(command, ["--ckpt_path", "no-such.ckpt"], f"ltcx {command}")
    check_lightning_command_line(command, ["--ckpt_path", "~", "--trainer.max_steps", "3"], f"ltcx {command}")


@pytest.mark.parametrize("form", ["--config=~/smoke.yaml", "-c ~/smoke.yaml", "-c~/smoke.yaml"])
def test_a_config_under_home_is_found_as_the_parser_finds_it(fit_env, monkeypatch, form):
    home = fit_env.parent / "home"
    home.mkdir()
    (home / "smoke.yaml").write_text((ROOT / "configs/trainer/smoke.yaml").read_text())
    monkeypatch.setenv("HOME", str(home))
    args = [*fit_args(fit_env)[1:], *form.split()]
    check_lightning_command_line("fit", args, "ltcx fit")
    assert _full_parser(["fit", *args]) == "accepted"
    with pytest.raises(LtcxError, match=f"--config: File does not exist: '{home}/other.yaml'"):
        check_lightning_command_line("fit", [*args, "--config", "~/other.yaml"], "ltcx fit")
