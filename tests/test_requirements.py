"""The install is lean and its files agree: requirements.txt pins exactly the packages of setup.py's
install_requires (what training, generation and export need), requirements-dev.txt adds exactly the `dev` extra
(tests, lint, lm-eval, SLURM), and no test, lint or evaluation tool is among what a user installs to train."""

import re
import runpy
from unittest import mock

from helpers import ROOT


def _name(requirement: str) -> str:
    return re.split(r"[\[<>=;! ]", requirement.strip(), maxsplit=1)[0].lower().replace("_", "-")


def _pinned(path) -> set[str]:
    lines = (line.split("#")[0].strip() for line in path.read_text().splitlines())
    return {_name(line) for line in lines if line and not line.startswith("-r")}


def _setup_lists() -> tuple[set[str], dict[str, set[str]]]:
    """(install_requires, {extra: its packages}) as setup.py hands them to setuptools."""
    with mock.patch("setuptools.setup") as setup:
        runpy.run_path(str(ROOT / "setup.py"))
    kwargs = setup.call_args.kwargs
    return ({_name(r) for r in kwargs["install_requires"]},
            {extra: {_name(r) for r in names} for extra, names in kwargs["extras_require"].items()})


def test_requirements_files_pin_what_setup_py_names():
    install, extras = _setup_lists()
    assert _pinned(ROOT / "requirements.txt") == install
    assert _pinned(ROOT / "requirements-dev.txt") == extras["dev"]
    assert "-r requirements.txt" in (ROOT / "requirements-dev.txt").read_text()


def test_a_user_install_holds_no_developer_or_evaluation_tool():
    install, extras = _setup_lists()
    assert not install & {"pytest", "pytest-xdist", "ruff", "lm-eval", "accelerate", "submitit"}
    assert {"pytest", "ruff", "lm-eval", "submitit"} <= extras["dev"]
    assert extras["eval"] == {"lm-eval", "accelerate"} and extras["slurm"] == {"submitit"}


def test_ci_installs_the_developer_set():
    assert "-r requirements-dev.txt" in (ROOT / ".ci/run").read_text()
