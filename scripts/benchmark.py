"""What each architecture costs to train and run, written as results files that docs/benchmarks.md's tables are
generated from.

    python scripts/benchmark.py training --width 256 --n_layer 4 --batch_size 4 --seq_len 256 --threads 1
    python scripts/benchmark.py kernels --batch_sizes 1 8 --seq_len 512      # the YAMLs' 29M models, and tiny
    python scripts/benchmark.py memory --batch_size 4 --seq_len 512 --threads 1
    python scripts/benchmark.py decode --width 256 --n_layer 4 --decode_at 64 256 --threads 1
    python scripts/benchmark.py commands                                     # the quickstart's fit, ltcx --help
    python scripts/benchmark.py tables                                       # docs/benchmarks.md from the results

Each question writes one file, ``--out``/<question>.json (``docs/results/`` by default): its stamp (commit, the
command, machine, date), its settings and its rows. ``tables`` replaces the text between ``<!-- table:NAME -->`` and
``<!-- /table -->`` in docs/benchmarks.md with the table made from ``NAME.json``.

Models: every catalogue entry (``--archs`` picks some; ``name:key=value,...`` overrides init_args), each at its
YAML's shape, or with ``--width`` at the catalogue's scaling of it to ``--width`` x ``--n_layer``. A training step is
the fit's (``ltcx.throughput.loss_step``: ``LanguageModel.loss``, backward, AdamW). Every timing is the median of
``--repeats`` runs after a warm-up, in wall and in process CPU seconds; training steps run in interleaved rounds
(each model in turn, the first rotating), so a load that drifts hits all alike. ``--nanogpt PATH`` adds
karpathy/nanoGPT's ``GPT`` from a local copy of its model.py (never vendored) to the training rounds, at the shape
of the ``gpt`` model.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import importlib.util
import io
import json
import os
import platform
import re
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from ltcx.lm import LanguageModel  # noqa: E402
from ltcx.models.catalog import build_configured, get, names  # noqa: E402
from ltcx.models.inference_cache import keeping_derived  # noqa: E402
from ltcx.models.state import map_state_tensors  # noqa: E402
from ltcx.throughput import (  # noqa: E402
    FUSED_BACKENDS,
    best_rate,
    kernels_per_step,
    loss_step,
    model_flops_per_token,
    peak_memory_mb,
    prefilled_state,
    timings,
)

RESULTS = ROOT / "docs" / "results"
DOCS = ROOT / "docs" / "benchmarks.md"
COMMANDS = {"help": ["--help"],
            "quickstart": ["fit", "--config", "configs/gpt.yaml", "--config", "configs/trainer/smoke.yaml"]}


def fail(message: str) -> None:
    """A user error: one line, exit 2."""
    print(f"benchmark: error: {message}", file=sys.stderr)
    raise SystemExit(2)


def build(spec: str, args, min_context: int) -> torch.nn.Module:
    """The backbone of ``spec`` (a catalogue name, optionally ``name:key=value,...``): its YAML's, or with
    ``--width`` the catalogue's scaling of it (heads of ``--head_dim``); float32, seeded."""
    import yaml

    torch.manual_seed(0)
    try:
        if args.width is None:
            return build_configured(spec, args.vocab_size, min_context)
        name, _, overrides = spec.partition(":")
        entry = get(name)
        fields = entry.scaled(args.width, args.n_layer, min_context, head_dim=args.head_dim)
    except KeyError as error:
        fail(str(error.args[0]))
    for assignment in filter(None, overrides.split(",")):
        key, _, value = assignment.partition("=")
        fields[key] = yaml.safe_load(value)
    if "block_size" in fields:
        fields["block_size"] = max(fields["block_size"] or 0, min_context)
    return entry.backbone_class()(**fields, vocab_size=args.vocab_size)


def trainable(backbone: torch.nn.Module) -> tuple[LanguageModel, torch.optim.Optimizer]:
    """``backbone`` as a fit trains it, with the AdamW of ``configure_optimizers`` (the schedule is given an end,
    which it asks for; the learning rate does not change a step's cost)."""
    model = LanguageModel(backbone, decay_steps=1).train()
    configured = model.configure_optimizers()
    return model, configured["optimizer"] if isinstance(configured, dict) else configured


def batch(args, batch_size: int | None = None, seq_len: int | None = None) -> torch.Tensor:
    """Random token ids [B, T + 1]."""
    return torch.randint(0, args.vocab_size, ((batch_size or args.batch_size), (seq_len or args.seq_len) + 1))


def load_nanogpt(path: str):
    """karpathy/nanoGPT's model.py from a local copy: the module (its ``GPT`` and ``GPTConfig``)."""
    if not Path(path).is_file():
        fail(f"--nanogpt {path}: no such file; give a local copy of karpathy/nanoGPT's model.py")
    spec = importlib.util.spec_from_file_location("nanogpt_model", path)
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
    except Exception as error:  # noqa: BLE001 - whatever the file raises, one line
        fail(f"--nanogpt {path}: cannot be imported ({type(error).__name__}: {error})")
    if not all(hasattr(module, name) for name in ("GPT", "GPTConfig")):
        fail(f"--nanogpt {path}: no GPT and GPTConfig in it; give karpathy/nanoGPT's model.py")
    return module


def nanogpt_step(module, gpt: torch.nn.Module, args):
    """(params, step) of nanoGPT's GPT at the shape of ltcx's ``gpt`` backbone: its forward(idx, targets) loss and
    the AdamW of its own ``configure_optimizers``."""
    c = gpt.config
    torch.manual_seed(0)
    model = module.GPT(module.GPTConfig(block_size=args.seq_len, vocab_size=args.vocab_size, n_layer=c.n_layer,
                                        n_head=c.n_head, n_embd=c.n_embd, dropout=0.0, bias=c.bias)).train()
    idx = batch(args)
    inputs, targets = idx[:, :-1].contiguous(), idx[:, 1:].contiguous()
    with contextlib.redirect_stdout(io.StringIO()):  # it prints its parameter groups
        optimizer = model.configure_optimizers(0.1, 1e-4, (0.9, 0.95), "cpu")

    def step() -> None:
        model(inputs, targets)[1].backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return sum(p.numel() for p in model.parameters()), step


def training(args) -> tuple[dict, list[dict]]:
    """Training tokens/s of each model (wall and per CPU-second), against the GPT, and MFU: tokens per CPU-second
    x training FLOPs per token / the FLOPs per CPU-second of a float32 matmul."""
    steps, rows = {}, []
    for spec in args.archs:
        backbone = build(spec, args, args.seq_len)
        model, optimizer = trainable(backbone)
        steps[spec] = loss_step(model, batch(args), optimizer, contextlib.nullcontext())
        rows.append({"arch": spec, "params": backbone.parameter_count(),
                     "flops_per_token": model_flops_per_token(backbone, args.seq_len)})
    if args.nanogpt:
        gpt = next((s for s in args.archs if s.partition(":")[0] == "gpt"), None)
        if gpt is None:
            fail("--nanogpt is built at the shape of the gpt model: name gpt among --archs")
        params, steps["nanogpt"] = nanogpt_step(load_nanogpt(args.nanogpt), build(gpt, args, args.seq_len), args)
        rows.append({"arch": "nanogpt", "params": params, "flops_per_token": None})
    for step in steps.values():
        step()  # warm-up
    samples = {label: [] for label in steps}
    labels = list(steps)
    for round_index in range(args.repeats):
        shift = round_index % len(labels)
        for label in labels[shift:] + labels[:shift]:
            samples[label].append(timings(steps[label], torch.device("cpu"), 1, warmup=0))
    a, b = torch.randn(1024, 1024), torch.randn(1024, 1024)
    a @ b  # warm-up
    # FLOPs per CPU-second of a float32 1024^3 matmul: a rate that other jobs on the machine slow far less than wall
    peak = best_rate(lambda: a @ b, 2.0 * 1024**3, trials=10, budget_s=1.0, clock=time.process_time)
    tokens = args.batch_size * args.seq_len
    for row in rows:
        wall = statistics.median(t.wall_s for t in samples[row["arch"]])
        cpu = statistics.median(t.cpu_s for t in samples[row["arch"]])
        row.update(step_s=wall, step_cpu_s=cpu, tokens_per_s=tokens / wall, tokens_per_cpu_s=tokens / cpu,
                   mfu=None if row["flops_per_token"] is None else tokens / cpu * row["flops_per_token"] / peak)
    base = next((r for r in rows if r["arch"].partition(":")[0] == "gpt"), rows[0])
    for row in rows:
        row["vs_gpt_cpu"] = base["step_cpu_s"] / row["step_cpu_s"]
        row["vs_gpt_wall"] = base["step_s"] / row["step_s"]
    return {"matmul_flops_per_cpu_s": peak}, rows


RECALL_SHAPE = {"width": 64, "n_layer": 2, "head_dim": 32, "vocab_size": 64, "batch": 32, "seq_len": 32}
"""The recall grid's largest model and batch (configs/study/quick-recall.yaml)."""


def recall_kernels(name: str, fields: dict | None = None) -> int:
    """Kernels per training step of catalogue entry ``name`` scaled as ``RECALL_SHAPE`` (``fields`` added)."""
    shape, entry = RECALL_SHAPE, get(name)
    scaled = entry.scaled(shape["width"], shape["n_layer"], shape["seq_len"], head_dim=shape["head_dim"])
    torch.manual_seed(0)
    backbone = entry.backbone_class()(**{**scaled, **(fields or {})}, vocab_size=shape["vocab_size"])
    idx = torch.randint(0, shape["vocab_size"], (shape["batch"], shape["seq_len"] + 1))
    return sum(kernels_per_step(trainable(backbone)[0], idx).values())


def kernels(args) -> tuple[dict, list[dict]]:
    """Device kernels per training step, eager (``ltcx.throughput.kernels_per_step``): each entry's tiny shape at
    batch 2 x 32, the recall grid's shape (``RECALL_SHAPE``), and its YAML's (or scaled) model at each of
    ``--batch_sizes`` x ``--seq_len``; then with its fused backends (``FUSED_BACKENDS``) at the recall shape and the
    first batch size, in a child process that runs the Triton kernels in Triton's interpreter (each launch one
    kernel, ``KernelCounter``). An entry without a fused form is its own."""
    rows = []
    for spec in args.archs:
        name = spec.partition(":")[0]
        torch.manual_seed(0)
        tiny = kernels_per_step(trainable(get(name).build_tiny(args.vocab_size))[0], batch(args, 2, 32))
        backbone = build(spec, args, args.seq_len)
        model, _ = trainable(backbone)
        row = {"arch": spec, "params": backbone.parameter_count(), "tiny": sum(tiny.values()),
               "recall": recall_kernels(name)}
        for batch_size in args.batch_sizes:
            counts = kernels_per_step(model, batch(args, batch_size))
            row[f"b{batch_size}"] = sum(counts.values())
            row.setdefault("top_ops", [[op, calls] for op, calls in counts.most_common(3)])
        row["fused_backends"] = FUSED_BACKENDS.get(type(backbone).__name__, {})
        if row["fused_backends"]:
            row.update(fused_child_counts(spec, args))
        else:
            row.update(fused_recall=row["recall"], fused=row[f"b{args.batch_sizes[0]}"],
                       fused_top_ops=row["top_ops"])
        rows.append(row)
        print(row, flush=True)
    return {"batch_sizes": args.batch_sizes}, rows


def with_fields(spec: str, fields: dict) -> str:
    """``spec`` with ``fields`` added to its overrides (``name:key=value,...``)."""
    extra = ",".join(f"{key}={value}" for key, value in fields.items())
    return spec + ("," if ":" in spec else ":") + extra if extra else spec


def fused_child_counts(spec: str, args) -> dict:
    """{"fused_recall", "fused", "fused_top_ops"} of ``spec`` with its fused backends, from a child process under
    ``TRITON_INTERPRET=1`` (Triton reads it when imported, and this process has imported it)."""
    command = [sys.executable, __file__, "kernels_fused_child", "--archs", spec, "--batch_sizes",
               str(args.batch_sizes[0]), *shape_args(args)]
    run = subprocess.run(command, capture_output=True, text=True,
                         env={**os.environ, "TRITON_INTERPRET": "1", "OMP_NUM_THREADS": str(args.threads)})
    if run.returncode != 0:
        fail(f"fused kernels of {spec}: {(run.stderr.strip().splitlines() or ['failed'])[-1]}")
    return json.loads(run.stdout.strip().splitlines()[-1])


def kernels_fused_child(args) -> None:
    """Prints the fused counts of ``fused_child_counts`` for ``--archs``' one entry, in this interpreted process."""
    spec = args.archs[0]
    name = spec.partition(":")[0]
    fields = FUSED_BACKENDS[get(name).backbone_class().__name__]
    recall = recall_kernels(name, fields)
    model, _ = trainable(build(with_fields(spec, fields), args, args.seq_len))
    counts = kernels_per_step(model, batch(args, args.batch_sizes[0]))
    print(json.dumps({"fused_recall": recall, "fused": sum(counts.values()),
                      "fused_top_ops": [[op, calls] for op, calls in counts.most_common(3)]}))


def memory(args) -> tuple[dict, list[dict]]:
    """Peak resident memory of one training step of each model, each in a fresh process (a process's peak RSS
    only grows)."""
    rows = []
    for spec in args.archs:
        command = [sys.executable, __file__, "memory_child", "--archs", spec, *shape_args(args)]
        run = subprocess.run(command, capture_output=True, text=True, env={**os.environ,
                                                                             "OMP_NUM_THREADS": str(args.threads)})
        if run.returncode != 0:
            fail(f"peak memory of {spec}: {(run.stderr.strip().splitlines() or ['failed'])[-1]}")
        rows.append({"arch": spec, **json.loads(run.stdout.strip().splitlines()[-1])})
        print(rows[-1], flush=True)
    return {}, rows


def memory_child(args) -> None:
    """One training step in this fresh process; prints {"params", "rss_before_mb", "peak_rss_mb"}."""
    backbone = build(args.archs[0], args, args.seq_len)
    model, optimizer = trainable(backbone)
    step = loss_step(model, batch(args), optimizer, contextlib.nullcontext())
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**10
    step()
    print(json.dumps({"params": backbone.parameter_count(), "rss_before_mb": before,
                      "peak_rss_mb": peak_memory_mb(torch.device("cpu"))}))


def decode(args) -> tuple[dict, list[dict]]:
    """One cached decode step (batch ``--batch_size``) after each of ``--decode_at`` tokens, and the state it
    carries then."""
    rows, cpu = [], torch.device("cpu")
    for spec in args.archs:
        backbone = build(spec, args, max(args.decode_at) + 1).eval()
        row = {"arch": spec, "params": backbone.parameter_count()}
        with torch.no_grad(), keeping_derived(backbone):  # as a generation: derived weights built once
            for position in args.decode_at:
                token, state = prefilled_state(backbone, args.batch_size, position, cpu)
                timing = timings(lambda b=backbone, x=token, s=state: b(x, s), cpu, args.repeats)
                row[f"ms_at_{position}"], row[f"cpu_ms_at_{position}"] = 1e3 * timing.wall_s, 1e3 * timing.cpu_s
                row[f"state_kib_at_{position}"] = state_bytes(state) / args.batch_size / 2**10
        rows.append(row)
        print(row, flush=True)
    return {}, rows


def state_bytes(state) -> int:
    sizes: list[int] = []
    map_state_tensors(state, lambda t: sizes.append(t.numel() * t.element_size()) or t)
    return sum(sizes)


def commands(args) -> tuple[dict, list[dict]]:
    """CPU and wall seconds of each command a user starts with, each once in a fresh process in an empty folder
    (``--threads`` threads). No peak RSS: a child forked from this process counts this process's pages."""
    rows = []
    for command in (COMMANDS[name] for name in args.commands):
        with tempfile.TemporaryDirectory() as folder:
            before = resource.getrusage(resource.RUSAGE_CHILDREN)
            start = datetime.datetime.now()
            run = subprocess.run([sys.executable, str(ROOT / "run.py"), *command], cwd=folder, capture_output=True,
                                 text=True, env={**os.environ, "OMP_NUM_THREADS": str(args.threads)})
            wall = (datetime.datetime.now() - start).total_seconds()
            after = resource.getrusage(resource.RUSAGE_CHILDREN)
        if run.returncode != 0:
            fail(f"`ltcx {' '.join(command)}` failed: {(run.stderr.strip().splitlines() or ['?'])[-1]}")
        rows.append({"command": "ltcx " + " ".join(command), "wall_s": wall,
                     "cpu_s": after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime})
        print(rows[-1], flush=True)
    return {}, rows


QUESTIONS = {"training": training, "kernels": kernels, "memory": memory, "decode": decode, "commands": commands}


def shape_args(args) -> list[str]:
    """The arguments that give a child process the same models and batch."""
    shape = ["--batch_size", str(args.batch_size), "--seq_len", str(args.seq_len), "--vocab_size",
             str(args.vocab_size)]
    if args.width is not None:
        shape += ["--width", str(args.width), "--n_layer", str(args.n_layer), "--head_dim", str(args.head_dim)]
    return shape


def stamp(argv: list[str]) -> dict:
    """Commit (``-dirty`` when tracked files differ from it), the command, the machine, the date."""
    def git(*command: str) -> str:
        return subprocess.run(["git", *command], cwd=ROOT, capture_output=True, text=True).stdout.strip()

    cpuinfo = Path("/proc/cpuinfo")
    model = re.search(r"model name\s*:\s*(.+)", cpuinfo.read_text()) if cpuinfo.is_file() else None
    dirty = "-dirty" if git("status", "--porcelain", "--untracked-files=no") else ""
    return {"commit": (git("rev-parse", "--short", "HEAD") or "unknown") + dirty,
            "command": " ".join(["python", "scripts/benchmark.py", *argv]),
            "machine": {"cpu": model.group(1).strip() if model else platform.processor() or platform.machine(),
                        "cores": os.cpu_count(), "threads": torch.get_num_threads(), "torch": torch.__version__},
            "date": datetime.date.today().isoformat()}


def stamp_line(data: dict) -> str:
    s, m = data["stamp"], data["stamp"]["machine"]
    return (f"Measured: commit {s['commit']}, `{s['command']}`, {m['cpu']} ({m['cores']} cores, {m['threads']} "
            f"thread{'s' * (m['threads'] != 1)}), torch {m['torch']}, {s['date']}.")


def _n(value, digits: int = 3) -> str:
    if value is None:
        return "-"
    if isinstance(value, int):
        return f"{value:,}"
    return f"{value:,.{digits}g}" if abs(value) < 10 ** digits else f"{value:,.0f}"


def _rows(header: list[str], rows: list[list[str]]) -> list[str]:
    """A Markdown table: figures right-aligned, text left."""
    aligns = ["---:" if all(re.match(r"[-\d]", row[i]) for row in rows) else "---" for i in range(len(header))]
    return ["| " + " | ".join(line) + " |" for line in [header, aligns, *rows]]


def table(name: str, data: dict) -> str:
    """The Markdown table of results file ``name`` (its rows and its stamp line)."""
    rows, settings = data["rows"], data["settings"]
    if name == "training":
        lines = _rows(["model", "params", "step, CPU s", "step, wall s", "tokens per CPU-s", "vs GPT (CPU)",
                       "vs GPT (wall)", "MFU"],
                      [[r["arch"], _n(r["params"]), _n(r["step_cpu_s"]), _n(r["step_s"]), _n(r["tokens_per_cpu_s"]),
                        f"{r['vs_gpt_cpu']:.2f}x", f"{r['vs_gpt_wall']:.2f}x",
                        "-" if r["mfu"] is None else f"{100 * r['mfu']:.1f}%"] for r in rows])
    elif name == "kernels":
        batches = settings["batch_sizes"]
        base = next((r for r in rows if r["arch"] == "gpt"), rows[0])
        recall = "recall, {batch} x {seq_len}".format(**RECALL_SHAPE)
        lines = _rows(["model", recall, *(f"{b} x {settings['seq_len']}" for b in batches), f"fused, {recall}",
                       f"fused, {batches[0]} x {settings['seq_len']}", "fused vs GPT"],
                      [[r["arch"], _n(r["recall"]), *(_n(r[f"b{b}"]) for b in batches), _n(r["fused_recall"]),
                        _n(r["fused"]), f"{r['fused'] / base['fused']:.1f}x"] for r in rows])
    elif name == "memory":
        lines = _rows(["model", "params", "peak RSS, MiB", "before the step, MiB", "the step adds, MiB"],
                      [[r["arch"], _n(r["params"]), _n(r["peak_rss_mb"], 4), _n(r["rss_before_mb"], 4),
                        _n(r["peak_rss_mb"] - r["rss_before_mb"], 4)] for r in rows])
    elif name == "decode":
        at = settings["decode_at"]
        lines = _rows(["model", "params", *(f"ms at {p} (CPU ms)" for p in at), *(f"state KiB at {p}" for p in at)],
                      [[r["arch"], _n(r["params"]), *(f"{_n(r[f'ms_at_{p}'])} ({_n(r[f'cpu_ms_at_{p}'])})"
                                                      for p in at),
                        *(_n(r[f"state_kib_at_{p}"]) for p in at)] for r in rows])
    elif name == "commands":
        lines = _rows(["command", "CPU s", "wall s"], [[f"`{r['command']}`", _n(r["cpu_s"]), _n(r["wall_s"])]
                                                       for r in rows])
    else:
        raise ValueError(f"no table named {name!r} (known: {', '.join(QUESTIONS)})")
    return "\n".join([*lines, "", stamp_line(data)])


MARKER = re.compile(r"(<!-- table:(\w+) -->\n)(.*?)(<!-- /table -->)", re.S)


def render(docs: str, results: Path) -> str:
    """``docs`` with the text between each ``<!-- table:NAME -->`` and ``<!-- /table -->`` replaced by the table
    of ``results``/NAME.json."""
    def replace(match: re.Match) -> str:
        path = results / f"{match.group(2)}.json"
        if not path.is_file():
            fail(f"{path} does not exist: run `python scripts/benchmark.py {match.group(2)}` first")
        return match.group(1) + table(match.group(2), json.loads(path.read_text())) + "\n" + match.group(4)

    return MARKER.sub(replace, docs)


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("question", choices=[*QUESTIONS, "tables", "memory_child", "kernels_fused_child"],
                        help="what to measure, or `tables`: regenerate docs/benchmarks.md's tables")
    parser.add_argument("--archs", nargs="+", default=None, help=f"catalogue names (default: {', '.join(names())})")
    parser.add_argument("--width", type=int, default=None, help="scale every model to this width (default: its YAML)")
    parser.add_argument("--n_layer", type=int, default=4, help="with --width: the number of blocks")
    parser.add_argument("--head_dim", type=int, default=64, help="with --width: the attention heads' width")
    parser.add_argument("--batch_size", type=int, default=4)
    parser.add_argument("--batch_sizes", type=int, nargs="+", default=[1, 8], help="kernels: the batch sizes")
    parser.add_argument("--seq_len", type=int, default=256)
    parser.add_argument("--vocab_size", type=int, default=50304)
    parser.add_argument("--decode_at", type=int, nargs="+", default=[64, 256], help="decode: positions")
    parser.add_argument("--commands", nargs="+", choices=list(COMMANDS), default=list(COMMANDS),
                        help="commands: which (`quickstart`: the README's fit on the GPT)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--nanogpt", default=None, metavar="PATH",
                        help="training: also karpathy/nanoGPT's GPT from this local copy of its model.py")
    parser.add_argument("--out", default=str(RESULTS), help="the folder of the results files")
    parser.add_argument("--docs", default=str(DOCS), help="tables: the page whose tables are regenerated")
    args = parser.parse_args(argv)
    args.archs = args.archs or names()
    torch.set_num_threads(args.threads)
    # Products of tiny decay factors (Titans' memory, xLSTM's gates) reach float32 denormals, very slow on CPUs.
    torch.set_flush_denormal(True)
    if args.question == "memory_child":
        return memory_child(args)
    if args.question == "kernels_fused_child":
        return kernels_fused_child(args)
    if args.question == "tables":
        docs = Path(args.docs)
        docs.write_text(render(docs.read_text(), Path(args.out)))
        print(f"wrote {docs}")
        return
    settings, rows = QUESTIONS[args.question](args)
    settings = {**{k: getattr(args, k) for k in ("batch_size", "seq_len", "vocab_size", "width", "n_layer",
                                                 "repeats", "decode_at")}, **settings}
    out = Path(args.out) / f"{args.question}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"stamp": stamp(argv), "settings": settings, "rows": rows}, indent=1) + "\n")
    print(table(args.question, json.loads(out.read_text())))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
