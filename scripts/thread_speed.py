"""Training-step time of the smoke run's GPT at 1, 2, ... torch threads, alternating within one process so that
whatever else runs on the machine weighs on every setting alike:

    python scripts/thread_speed.py --threads 1 2 --repeats 4

Model and batch as ``configs/gpt.yaml`` + ``configs/trainer/smoke.yaml``: 6 layers, width 384, vocabulary 50,304,
batch 8 x 128 tokens, forward + backward + AdamW. Prints each timed step with the 1-minute load average, then the
median per thread count.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from ltcx.models.gpt import GPT  # noqa: E402


def main(argv: list[str] | None = None) -> dict[int, float]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--repeats", type=int, default=4, help="rounds over the thread counts (2 timed steps each)")
    parser.add_argument("--batch_size", type=int, default=8)
    parser.add_argument("--seq_len", type=int, default=128)
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    model = GPT(block_size=512, vocab_size=50304, n_layer=6, n_head=6, n_kv_head=2, n_embd=384, bias=False)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    batch = torch.randint(0, 50304, (args.batch_size, args.seq_len + 1))

    def step() -> float:
        start = time.perf_counter()
        logits, _ = model(batch[:, :-1])
        F.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1)).backward()
        optimizer.step()
        optimizer.zero_grad()
        return time.perf_counter() - start

    times: dict[int, list[float]] = {n: [] for n in args.threads}
    for repeat in range(args.repeats):
        for threads in args.threads:
            torch.set_num_threads(threads)
            step()  # the first step at a new thread count is not timed
            times[threads] += [step(), step()]
            print(f"round {repeat}: {threads} thread(s): {times[threads][-2]:.2f} s, {times[threads][-1]:.2f} s "
                  f"(load average {os.getloadavg()[0]:.1f})", flush=True)
    tokens = args.batch_size * args.seq_len
    medians = {n: statistics.median(t) for n, t in times.items()}
    for threads, median in medians.items():
        print(f"{threads} thread(s): median step {median:.2f} s, {tokens / median:.0f} tokens/s")
    return medians


if __name__ == "__main__":
    main()
