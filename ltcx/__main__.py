"""``python -m ltcx <command>``: the same as ``ltcx <command>``, where the console script is not on PATH."""

from ltcx.cli import main

if __name__ == "__main__":
    main()
