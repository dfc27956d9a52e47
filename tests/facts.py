"""What an error test checks: the facts of a message (the option it names, the offending value, the fix), each as a
short phrase, so that rewording the sentence around them breaks no test but dropping one of them does."""


def assert_mentions(text: str, *facts: str) -> None:
    """Each of ``facts`` appears in ``text``, in any order."""
    missing = [fact for fact in facts if fact not in text]
    assert not missing, f"{missing} not in {text!r}"


def assert_one_error_line(stderr: str) -> str:
    """The one ``ltcx: error: ...`` line of a run's stderr (and no traceback), which is returned."""
    errors = [line for line in stderr.splitlines() if line.startswith("ltcx: error: ")]
    assert len(errors) == 1 and "Traceback" not in stderr, stderr[-3000:]
    return errors[0]
