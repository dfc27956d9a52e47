"""Speed and memory of each architecture, measured as ratios within one run.

    python scripts/benchmark.py --archs gpt ltc --batch_size 4 --seq_len 256
    python scripts/benchmark.py --archs gpt --generate_tokens 512      # cached vs uncached generation
    python scripts/benchmark.py --archs gpt titans_mag titans_mag:memory_chunk_size=64   # override init_args
    python scripts/benchmark.py --data_loader sample --batch_size 24 --seq_len 512 --resume_tokens 10000000
    python scripts/benchmark.py --archs gpt ltc --compile          # also the torch.compile'd training step
    python scripts/benchmark.py --archs gpt gpt gta --decode_at 128   # gpt twice: the noise between two copies
    python scripts/benchmark.py --startup      # CPU seconds of the commands that answer without training

For each architecture (its model block of configs/<arch>.yaml, vocabulary 50,304) it reports training
tokens/s (forward + backward + AdamW) and its MFU (tokens/s x the backbone's flops_per_token / the peak
FLOP/s of the device: a known GPU's dense bf16 peak, on a CPU the float32 matmul rate measured here, or
--peak_flops), prefill latency, cached decode latency per token, cache/state bytes per token and peak
memory, prints a table and writes JSON.

``--data_loader TEXT`` measures the data instead: a corpus made of TEXT's training files repeated (each copy's
paragraphs tagged with the copy number, so that deduplication keeps them) is read as streaming text and, prepared
once by ``ltcx prepare``, as token shards; it reports loader tokens/s (one process, no dataloader workers) and, with
``--resume_tokens N``, the time to the first batch after resuming at N trained tokens in each mode.

``--startup`` measures the commands instead: the CPU time (user + system, which other jobs on the machine do not
change, unlike the wall time) of ``ltcx --help``, each command's ``--help``, and one-line errors, each a fresh
process, median of ``--repeats``.

One script because every measurement shares its set-up and output: the models built from the catalogue's YAMLs,
the interleaved rounds that make the ratios fair, and one table and JSON.
"""

from __future__ import annotations

import argparse
import json
import platform
import resource
import statistics
import sys
import time
from contextlib import nullcontext
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from ltcx.generation import generate  # noqa: E402
from ltcx.models.catalog import CATALOG, build_configured  # noqa: E402
from ltcx.models.state import map_state_tensors  # noqa: E402
from ltcx.throughput import (  # noqa: E402
    default_peak_flops,
    measured_matmul_flops,
    model_flops_per_token,
    peak_memory_mb,
    prefilled_state,
    sync,
    timed,
    training_step,
)


def build_backbone(arch: str, vocab_size: int, min_context: int) -> torch.nn.Module:
    """The backbone of ``arch`` (a catalogue name, optionally ``name:key=value,...``) from its YAML."""
    try:
        return build_configured(arch, vocab_size, min_context)
    except KeyError as error:
        raise SystemExit(f"benchmark: {error.args[0]}") from None


def state_bytes(state) -> int:
    total = 0

    def count(t):
        nonlocal total
        total += t.numel() * t.element_size()
        return t

    map_state_tensors(state, count)
    return total


def bench_arch(arch: str, args, device: torch.device, peak_flops: float | None) -> dict:
    torch.manual_seed(0)
    model = build_backbone(arch, 50304, max(args.seq_len, args.generate_tokens)).to(device)
    autocast = (
        torch.autocast(device.type, dtype=torch.bfloat16) if args.dtype == "bf16" else nullcontext()
    )
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    idx = torch.randint(0, 50304, (args.batch_size, args.seq_len + 1), device=device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)

    train_step = training_step(lambda i: model(i)[0], idx, optimizer, autocast)
    model.train()
    tokens = args.batch_size * args.seq_len
    train_s = timed(train_step, device, args.repeats)
    flops_per_token = model_flops_per_token(model, args.seq_len)
    result = {
        "arch": arch,
        "params": model.parameter_count(),
        "train_tokens_per_s": tokens / train_s,
        "train_flops_per_token": flops_per_token,
        "mfu": None if peak_flops is None else tokens / train_s * flops_per_token / peak_flops,
    }
    if args.compile:
        # The logits alone, as LanguageModel compiles them (a state among a compiled graph's outputs is not needed
        # for training, and torch 2.13's AOTAutograd cache rebuilds such outputs wrongly).
        compiled_step = training_step(torch.compile(lambda i: model(i)[0]), idx, optimizer, autocast)
        start = time.perf_counter()
        compiled_step()  # compiles forward and backward
        sync(device)
        result["compile_s"] = time.perf_counter() - start
        compiled_s = timed(compiled_step, device, args.repeats)
        result["compiled_train_tokens_per_s"] = tokens / compiled_s
        result["compiled_vs_eager"] = train_s / compiled_s
    model.eval()
    with torch.no_grad(), autocast:
        prompt = idx[:, : args.seq_len]
        result["prefill_ms"] = 1e3 * timed(lambda: model(prompt), device, args.repeats)
        _, state = model(prompt[:, :-1])
        result["decode_ms_per_token"] = 1e3 * timed(lambda: model(prompt[:, -1:], state), device, args.repeats * 4)
        _, state = model(prompt)
        result["state_bytes_per_token"] = state_bytes(state) / (args.batch_size * args.seq_len)
        result["state_bytes_per_sequence"] = state_bytes(state) / args.batch_size  # after seq_len tokens
        if args.generate_tokens:
            one = idx[:1, :1]

            def uncached():
                ids = one
                for _ in range(args.generate_tokens - 1):
                    logits, _ = model(ids)
                    ids = torch.cat([ids, logits[:, -1:].argmax(-1)], dim=1)
                return ids

            cached_s = timed(lambda: generate(model, one, args.generate_tokens - 1, temperature=0), device, 1, 0)
            uncached_s = timed(uncached, device, 1, 0)
            result["generate_cached_s"] = cached_s
            result["generate_uncached_s"] = uncached_s
    if args.recurrent_baseline and hasattr(model, "forward_recurrent"):
        model.train()
        recurrent_train_step = training_step(lambda i: model.forward_recurrent(i)[0], idx, optimizer, autocast)
        seconds = timed(recurrent_train_step, device, 1, 0)
        result["recurrent_train_tokens_per_s"] = args.batch_size * args.seq_len / seconds
    result["peak_memory_mb"] = peak_memory_mb(device)
    return result, model


def decode_at(models: dict, args, device: torch.device) -> dict:
    """{arch: {"decode_ms_at_P": ms}}: one cached decode step (batch --decode_batch) after P tokens, for every
    model in turn, round after round (the median of each; the first model rotates), so a load that drifts on a
    shared machine hits all alike."""
    times = {arch: {} for arch in models}
    with torch.no_grad():
        for position in args.decode_at:
            key = f"decode_ms_at_{position}"
            states = {}  # arch -> (token, state)
            for arch, model in models.items():
                model.eval()
                try:
                    states[arch] = prefilled_state(model, args.decode_batch, position, device)
                except ValueError:
                    times[arch][key] = None  # beyond the model's context
                    continue
                model(*states[arch])  # warm-up
            samples = {arch: [] for arch in states}
            archs = list(states)
            for round_index in range(args.repeats * 4 if archs else 0):
                shift = round_index % len(archs)  # each model goes first in turn: no order bias
                for arch in archs[shift:] + archs[:shift]:
                    token, state = states[arch]
                    sync(device)
                    start = time.perf_counter()
                    models[arch](token, state)
                    sync(device)
                    samples[arch].append(time.perf_counter() - start)
            for arch, values in samples.items():
                times[arch][key] = 1e3 * statistics.median(values)
    return times


def bench_data(args) -> list[dict]:
    import math
    import tempfile
    from types import SimpleNamespace

    from ltcx.data import TextDataModule
    from ltcx.data.files import resolve_local_files
    from ltcx.data.prepare import prepare
    from ltcx.tokenizers import get_tokenizer

    paragraphs = [p for f in resolve_local_files(args.data_loader).train
                  for p in Path(f).read_text(encoding="utf-8").split("\n\n") if p.strip()]
    source_tokens = sum(map(len, get_tokenizer("gpt2").encode_batch(paragraphs)))
    batch_tokens = args.batch_size * args.seq_len  # tokens trained on per batch
    copies = max(1, math.ceil(1.2 * max(args.resume_tokens, 50 * batch_tokens) / source_tokens))
    work = Path(tempfile.mkdtemp(prefix="ltcx-bench-data-"))
    corpus = work / "corpus.txt"
    corpus.write_text("\n\n".join(f"{p} ({k})" for k in range(copies) for p in paragraphs), encoding="utf-8")
    start = time.perf_counter()
    meta = prepare(str(corpus), str(work / "shards"), num_proc=args.prepare_proc, val_fraction=0.001)
    prepare_s = time.perf_counter() - start
    print(f"corpus: {copies} tagged copies of {args.data_loader}, {meta['counts']['train_tokens']:,} tokens; "
          f"prepared in {prepare_s:.1f} s with {args.prepare_proc} processes "
          f"({meta['counts']['train_tokens'] / prepare_s:,.0f} tokens/s)")

    def data_module(path: Path) -> TextDataModule:
        dm = TextDataModule(path=str(path), block_size=args.seq_len, batch_size=args.batch_size, val_batches=0)
        dm.setup("fit")
        return dm

    def first_batch_s(dm: TextDataModule):
        """Seconds to the first batch of a (resumed) loader, that batch, and the loader."""
        start = time.perf_counter()
        loader = iter(dm.train_dataloader())
        batch = dm.on_before_batch_transfer(next(loader), 0)
        return time.perf_counter() - start, batch, loader

    results = []
    for mode, path in (("streaming text", corpus), ("token shards", work / "shards")):
        dm = data_module(path)
        loader = iter(dm.train_dataloader())
        next(loader)
        start = time.perf_counter()
        for _ in range(args.loader_batches):
            next(loader)
        elapsed = time.perf_counter() - start
        result = {"mode": mode, "loader_tokens_per_s": args.loader_batches * batch_tokens / elapsed}
        if args.resume_tokens:
            consumed = args.resume_tokens // batch_tokens
            dm = data_module(path)
            dm.load_state_dict({"train_batches_consumed": consumed})  # text: no positions, re-tokenize and drop
            result["resume_s"], batch, loader = first_batch_s(dm)
            if mode == "streaming text":
                result["resume_retokenize_s"] = result.pop("resume_s")
                dm.trainer = SimpleNamespace(global_step=consumed + 1, accumulate_grad_batches=1, global_rank=0,
                                             world_size=1)
                state = dm.state_dict()  # the position after that batch, as a checkpoint would hold it
                after = dm.on_before_batch_transfer(next(loader), 0)
                resumed = data_module(path)
                resumed.load_state_dict(state)
                result["resume_s"], batch, _ = first_batch_s(resumed)
                assert torch.equal(batch, after), "resume from the position differs from the re-tokenized stream"
        results.append(result)
        print(" | ".join(f"{k}={v:,.3g}" if isinstance(v, float) else f"{k}={v}" for k, v in result.items()))
    return results


STARTUP_COMMANDS = [
    ["--help"], ["generate", "--help"], ["export", "--help"], ["prepare", "--help"], ["fit", "--help"],
    ["generate", "--ckpt_path", "no-such.ckpt"], ["fit", "--config", "configs/no-such.yaml"],
    ["fit", "--config", "configs/gpt.yaml", "--ckpt_path", "no-such.ckpt"],
    ["fit", "--config", "configs/gpt.yaml", "--trainer.max_stepz", "5"],
    ["fit", "--config", "configs/gpt.yaml", "--help"],
    ["fit", "--config", "configs/gpt.yaml", "--trainer.max_steps", "x"],
]


def bench_startup(args) -> list[dict]:
    """CPU and wall seconds of each command in ``STARTUP_COMMANDS`` (``python run.py ...`` in a fresh process)."""
    import subprocess

    results = []
    for command in STARTUP_COMMANDS:
        cpu, wall = [], []
        for _ in range(args.repeats):
            before = resource.getrusage(resource.RUSAGE_CHILDREN)
            start = time.perf_counter()
            subprocess.run([sys.executable, str(ROOT / "run.py"), *command], cwd=ROOT, capture_output=True)
            wall.append(time.perf_counter() - start)
            after = resource.getrusage(resource.RUSAGE_CHILDREN)
            cpu.append(after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime)
        result = {"command": "ltcx " + " ".join(command), "cpu_s": statistics.median(cpu),
                  "wall_s": statistics.median(wall)}
        results.append(result)
        print(f"{result['command']:<70} {result['cpu_s']:6.2f} s CPU  {result['wall_s']:6.2f} s wall", flush=True)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--archs", nargs="+", default=["gpt"],
                        help=f"architectures ({', '.join(sorted(CATALOG))}), each optionally with :key=value,... "
                        "init_args")
    parser.add_argument("--batch_size", type=int, default=4)
    parser.add_argument("--seq_len", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dtype", choices=["float32", "bf16"], default="float32")
    parser.add_argument("--generate_tokens", type=int, default=0, help="also time generating this many tokens")
    parser.add_argument("--decode_at", type=int, nargs="*", default=[],
                        help="also time one cached decode step (batch --decode_batch) after this many tokens")
    parser.add_argument("--decode_batch", type=int, default=1, help="batch size of the --decode_at steps")
    parser.add_argument("--recurrent_baseline", action="store_true",
                        help="also time training through forward_recurrent (token by token), where a model has it")
    parser.add_argument("--compile", action="store_true",
                        help="also time the training step of torch.compile(model) (its ratio to eager, compile time)")
    parser.add_argument("--peak_flops", type=float, default=None,
                        help="FLOP/s of the device for MFU (default: a known GPU's dense bf16 peak, or on a CPU the "
                             "measured float32 matmul rate)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--out", default="benchmark.json")
    parser.add_argument("--data_loader", default=None, metavar="TEXT",
                        help="measure the data loader on TEXT (e.g. sample) instead of the models")
    parser.add_argument("--resume_tokens", type=int, default=0, help="with --data_loader: time a resume at N tokens")
    parser.add_argument("--loader_batches", type=int, default=50, help="with --data_loader: batches timed")
    parser.add_argument("--prepare_proc", type=int, default=2, help="with --data_loader: ltcx prepare's processes")
    parser.add_argument("--startup", action="store_true", help="measure the CPU time of help and argument errors")
    args = parser.parse_args()
    if args.data_loader or args.startup:
        results = bench_data(args) if args.data_loader else bench_startup(args)
        Path(args.out).write_text(json.dumps({"meta": vars(args), "results": results}, indent=2))
        print(f"wrote {args.out}")
        return
    if args.threads:
        torch.set_num_threads(args.threads)
    # Products of tiny decay factors (Titans' memory, xLSTM's gates) reach float32 denormals, which are
    # very slow on CPUs; flushing them to zero changes no figure that matters and times the real work.
    torch.set_flush_denormal(True)
    device = torch.device(args.device)
    matmul_flops = measured_matmul_flops(torch.get_num_threads()) if device.type == "cpu" else None
    if args.peak_flops is not None:
        peak_flops, source = args.peak_flops, "--peak_flops"
    else:
        peak_flops, source = default_peak_flops(device)
    results, models = [], {}
    for arch in args.archs:
        label = arch
        while label in models:  # the same architecture twice: the spread between the copies is the noise floor
            label += "'"
        result, models[label] = bench_arch(arch, args, device, peak_flops)
        result["arch"] = label
        results.append(result)
    if args.decode_at:
        decode_times = decode_at(models, args, device)
        for result in results:
            result.update(decode_times[result["arch"]])
    base = results[0]["train_tokens_per_s"]
    columns = ["arch", "params", "train_tokens_per_s", "vs_first", "mfu", "prefill_ms", "decode_ms_per_token",
               "state_bytes_per_token", "state_bytes_per_sequence", "peak_memory_mb"]
    if args.compile:
        columns += ["compiled_train_tokens_per_s", "compiled_vs_eager", "compile_s"]
    if args.generate_tokens:
        columns += ["generate_cached_s", "generate_uncached_s"]
    columns += [f"decode_ms_at_{p}" for p in args.decode_at]
    if args.recurrent_baseline:
        columns += ["recurrent_train_tokens_per_s"]
    for r in results:
        r["vs_first"] = r["train_tokens_per_s"] / base
    print(f"device={device} dtype={args.dtype} batch={args.batch_size} seq_len={args.seq_len} "
          f"torch={torch.__version__}")
    if matmul_flops is not None:
        print(f"measured float32 matmul rate: {matmul_flops / 1e9:.1f} GFLOP/s ({torch.get_num_threads()} threads)")
    print("MFU peak: "
          + (f"{peak_flops:.4g} FLOP/s ({source})" if peak_flops else f"none ({source}): set --peak_flops"))
    print(" | ".join(columns))
    for r in results:
        print(" | ".join(f"{r.get(c):.3g}" if isinstance(r.get(c), float) else str(r.get(c, "-")) for c in columns))
    meta = {"device": str(device), "dtype": args.dtype, "batch_size": args.batch_size, "seq_len": args.seq_len,
            "torch": torch.__version__, "machine": platform.processor() or platform.machine(),
            "threads": torch.get_num_threads(), "peak_flops": peak_flops, "peak_source": source,
            "matmul_fp32_flops": matmul_flops}
    Path(args.out).write_text(json.dumps({"meta": meta, "results": results}, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
