"""Helpers shared by several test modules (imported as ``from helpers import ...``, like ``fault_injection``):
relative errors of tensors against a reference, documents of a fixed byte length, feeding a backbone in pieces,
a small text corpus, TensorBoard events and a generation check for CLI runs."""

from __future__ import annotations

import random
from pathlib import Path

import torch

REL_TOL = 1e-12  # float64 agreement, relative to the largest magnitude of the compared tensors


def relative_error(value: torch.Tensor, reference: torch.Tensor, norm: str = "fro") -> float:
    """|value - reference| / |reference|, computed in float64: ``norm="fro"`` the Frobenius norms (an error over
    the whole tensor), ``norm="max"`` the largest absolute entries (the worst element against the scale)."""
    difference = value.to(torch.float64) - reference.to(torch.float64)
    if norm == "fro":
        return (difference.norm() / reference.to(torch.float64).norm()).item()
    if norm == "max":
        return (difference.abs().max() / reference.to(torch.float64).abs().max()).item()
    raise ValueError(f"norm must be 'fro' or 'max', not {norm!r}")


def assert_rel(actual: torch.Tensor, expected: torch.Tensor, tol: float = REL_TOL, what: str = "") -> None:
    """max |actual - expected| <= tol x the largest magnitude of either tensor; the message names ``what``."""
    scale = max(actual.abs().max().item(), expected.abs().max().item(), 1e-300)
    err = (actual - expected).abs().max().item()
    assert err <= tol * scale, f"{what}: max |err| {err:.3e} > {tol:.0e} x {scale:.3e}"


def unit_docs(n: int, start: int = 0, size: int = 16) -> list[str]:
    """Documents of exactly ``size`` bytes: with the bytes tokenizer and block_size ``size`` each one plus its
    end-of-text is exactly one block."""
    return [f"doc{i:0{size - 3}d}" for i in range(start, start + n)]


def run_in_pieces(model, idx: torch.Tensor, sizes) -> tuple[torch.Tensor, object]:
    """Feed idx [B, T] to a backbone in consecutive pieces of ``sizes`` (summing to T), carrying the state ->
    (the pieces' logits concatenated [B, T, V], the final state)."""
    state, outputs, start = None, [], 0
    for size in sizes:
        logits, state = model(idx[:, start : start + size], state)
        outputs.append(logits)
        start += size
    assert start == idx.shape[1], (start, idx.shape)
    return torch.cat(outputs, dim=1), state


def write_corpus(folder: Path, train_docs: int = 300, val_docs: int = 30) -> Path:
    """train.txt and validation.txt of 40-word documents from a 19-word vocabulary (seeded) in ``folder``."""
    rng = random.Random(0)
    words = "the cat dog ran sat on a mat big small red blue happy sad tree house sun moon".split()
    folder.mkdir(parents=True, exist_ok=True)
    for name, count in (("train.txt", train_docs), ("validation.txt", val_docs)):
        docs = [" ".join(rng.choice(words) for _ in range(40)) + "." for _ in range(count)]
        (folder / name).write_text("\n\n".join(docs) + "\n")
    return folder


def read_events(log_dir: Path):
    """The TensorBoard events of a run folder (its one events file)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    [event_file] = list(log_dir.glob("events.out.tfevents.*"))
    events = EventAccumulator(str(event_file), size_guidance={"tensors": 0, "scalars": 0})
    events.Reload()
    return events


def assert_generates(checkpoint: Path, capsys) -> None:
    """``ltcx generate`` continues a prompt from ``checkpoint`` (greedy, 8 new tokens)."""
    from ltcx.cli import main

    capsys.readouterr()
    main(["generate", "--ckpt_path", str(checkpoint), "--prompt", "The cat", "--max_new_tokens", "8",
          "--temperature", "0"])
    out = capsys.readouterr().out
    assert out.startswith("The cat") and len(out.strip()) > len("The cat")
