"""Evaluation: loss by position (``position_loss.py``, ``ltcx evaluate``) and the lm-evaluation-harness adapter
(``harness.py``, ``ltcx lm-eval``), both scoring through ``scoring.py``. Nothing is imported here: ``harness.py``
imports ``lm_eval``, which only ``ltcx lm-eval`` may load."""
