"""Training step time and peak memory of the fused head + loss (``ltcx/ops/fused_loss.py``) against the full
logits' ``F.cross_entropy``, for one GPT shape (default: width 256, 4 layers, vocabulary 50,304, batch 4 x 256).

    python scripts/fused_loss_benchmark.py --rounds 5

Step time: both paths in one process, interleaved round by round (forward, backward, AdamW), median per path.
Peak memory: each path in a fresh subprocess, its peak resident set during its first step
(Linux, /proc/self/clear_refs) less the resident set before it; AdamW's new state, the same in both, included
(on a CPU nothing else tracks a step's allocations; a GPU run reports torch.cuda.max_memory_allocated instead).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from ltcx.lm import LanguageModel  # noqa: E402
from ltcx.models.catalog import CATALOG  # noqa: E402

PATHS = ("full", "fused")


def build(args) -> tuple[LanguageModel, torch.optim.Optimizer, torch.Tensor]:
    torch.manual_seed(0)
    shape = CATALOG["gpt"].scaled(args.width, args.n_layer, args.seq_len)
    backbone = CATALOG["gpt"].backbone_class()(**{**shape, "block_size": args.seq_len}, vocab_size=args.vocab)
    model = LanguageModel(backbone)
    model.to(args.device)
    batch = torch.randint(0, args.vocab, (args.batch_size, args.seq_len + 1), device=args.device)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-4), batch


def step(model: LanguageModel, optimizer, batch: torch.Tensor, path: str) -> float:
    if path == "fused":
        loss = model.loss(batch)
    else:
        loss = model._cross_entropy(model.backbone(batch[:, :-1])[0], batch[:, 1:])
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return float(loss)


def peak_mb(args, path: str) -> float:
    """The first step's peak above the model and batch (AdamW's state, the same in both paths, included)."""
    model, optimizer, batch = build(args)
    if args.device == "cuda":
        before = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        step(model, optimizer, batch, path)
        return (torch.cuda.max_memory_allocated() - before) / 2**20
    Path("/proc/self/clear_refs").write_text("5")  # Linux: the peak resident set restarts from the current one
    before = _resident_kb("VmRSS")
    step(model, optimizer, batch, path)
    return (_resident_kb("VmHWM") - before) / 1024


def _resident_kb(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"no {field} in /proc/self/status")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--n_layer", type=int, default=4)
    parser.add_argument("--seq_len", type=int, default=256)
    parser.add_argument("--batch_size", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=50304)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--memory_of", choices=PATHS, help=argparse.SUPPRESS)  # the subprocess's job
    args = parser.parse_args()
    if args.memory_of:
        print(json.dumps(peak_mb(args, args.memory_of)))
        return
    model, optimizer, batch = build(args)
    times: dict[str, list[float]] = {p: [] for p in PATHS}
    losses = {}
    for path in PATHS:  # warm-up
        step(model, optimizer, batch, path)
    for _ in range(args.rounds):
        for path in PATHS:
            start = time.perf_counter()
            losses[path] = step(model, optimizer, batch, path)
            if args.device == "cuda":
                torch.cuda.synchronize()
            times[path].append(time.perf_counter() - start)
    passed = [a for a in sys.argv[1:]]
    memory = {p: float(subprocess.run([sys.executable, __file__, *passed, "--memory_of", p], check=True,
                                      capture_output=True, text=True).stdout) for p in PATHS}
    result = {p: {"step_s": statistics.median(times[p]), "peak_step_mb": memory[p]} for p in PATHS}
    print(json.dumps(result, indent=1))
    full, fused = result["full"], result["fused"]
    print(f"| path | step (s, median of {args.rounds}) | peak step memory (MiB) |\n|---|---|---|")
    for p in PATHS:
        print(f"| {p} | {result[p]['step_s']:.3f} | {result[p]['peak_step_mb']:.0f} |")
    print(f"fused / full: step {fused['step_s'] / full['step_s']:.2f}, memory "
          f"{fused['peak_step_mb'] / max(full['peak_step_mb'], 1e-9):.2f}")


if __name__ == "__main__":
    main()
