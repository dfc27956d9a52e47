"""``python tests/record_exit.py fit ...``: ltcx's main that also writes this process's exit status to
``$LTCX_EXIT_DIR/rank<LOCAL_RANK>``. Lightning's ddp launcher starts the other ranks with this same command line,
so a test sees every rank's status, not only the launching process's."""

import os
import sys

from ltcx.cli import main

if __name__ == "__main__":
    code = 1  # an exception other than SystemExit
    try:
        main()
        code = 0
    except SystemExit as stop:
        code = stop.code if isinstance(stop.code, int) else (0 if stop.code is None else 1)
        raise
    finally:
        folder = os.environ["LTCX_EXIT_DIR"]
        os.makedirs(folder, exist_ok=True)
        with open(os.path.join(folder, f"rank{os.environ.get('LOCAL_RANK', '0')}"), "w") as f:
            f.write(str(code))
        sys.stdout.flush()
