"""Entry point: ``python run.py fit --config configs/gpt.yaml`` (the same as ``ltcx fit ...``)."""
from ltcx.cli import main

if __name__ == "__main__":
    main()
