"""The tests themselves: every test function checks something."""

import ast
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent
CHECKING_CALLS = ("raises", "warns", "fail")  # pytest.raises, pytest.warns, pytest.fail
# helpers that assert, torch.testing.assert_close among them, and a module's private ones (_assert_all_close)
CHECKING_PREFIXES = ("assert_", "check_", "expect_")
# test -> why it checks without any of the above
ALLOWED = {
    "test_contract.py::test_contract": "calls the parametrized `check`, one of the catalogue's check_* functions",
    "test_xlstm.py::test_training_forward_never_uses_the_token_loop": "the monkeypatched mlstm_step raises "
    "AssertionError if the forward calls it",
}


def called_name(call: ast.Call) -> str:
    function = call.func
    return function.attr if isinstance(function, ast.Attribute) else getattr(function, "id", "")


def checks_something(function: ast.FunctionDef) -> bool:
    for node in ast.walk(function):
        if isinstance(node, ast.Assert):
            return True
        if isinstance(node, ast.Call):
            name = called_name(node)
            if name in CHECKING_CALLS or name.lstrip("_").startswith(CHECKING_PREFIXES):
                return True
    return False


def collected_tests() -> list[tuple[str, ast.FunctionDef]]:
    found = []
    for path in sorted(TESTS.glob("test_*.py")):
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name.startswith("test"):
                found.append((f"{path.name}::{node.name}", node))
    return found


@pytest.mark.quick
def test_every_test_asserts_something():
    """A test with no assert, no pytest.raises/warns and no (_)assert_/check_/expect_ helper passes whatever the
    code does: give it an assertion, or name its checking helper assert_..."""
    tests = collected_tests()
    assert len(tests) > 100  # the scan found the suite
    silent = [name for name, function in tests if name not in ALLOWED and not checks_something(function)]
    assert not silent, f"tests that assert nothing: {silent}"
    stale = set(ALLOWED) - {name for name, _ in tests}
    assert not stale, f"ALLOWED names tests that no longer exist: {sorted(stale)}"
