"""Speed and memory of each architecture, measured as ratios within one run.

    python scripts/benchmark.py --archs gpt ltc --batch_size 4 --seq_len 256
    python scripts/benchmark.py --archs gpt xlstm titans_mag --width 256 --n_layer 4 --repeats 5   # a scaled shape
    python scripts/benchmark.py --archs gpt --nanogpt /tmp/nanogpt_model.py   # karpathy/nanoGPT's model.py beside
    python scripts/benchmark.py --archs gpt --generate_tokens 512      # cached vs uncached generation
    python scripts/benchmark.py --archs gpt titans_mag titans_mag:memory_chunk_size=64   # override init_args
    python scripts/benchmark.py --archs gpt xlstm --peak_memory --batch_size 24 --seq_len 512   # peak RSS per model
    python scripts/benchmark.py --data_loader sample --batch_size 24 --seq_len 512 --resume_tokens 10000000
    python scripts/benchmark.py --archs gpt ltc --compile          # also the torch.compile'd training step
    python scripts/benchmark.py --archs titans_mag --compile ops   # ... with only Titans' memory compiled
    python scripts/benchmark.py --archs gpt titans_mag --free_memory_op   # ... and with its memory op costing nothing
    python scripts/benchmark.py --archs gpt xlstm --products_alone   # the training step's matrix products timed alone
    python scripts/benchmark.py --archs gpt gpt gta --decode_at 128   # gpt twice: the noise between two copies
    python scripts/benchmark.py --archs xlstm --nx_xlstm /tmp/nxpkgs --batch_size 1 --seq_len 128 --decode_at 128
    python scripts/benchmark.py --archs xlstm titans_mag --profile   # op calls and top ops of a training step
    python scripts/benchmark.py --startup      # CPU seconds of commands answering without training; a study run

For each architecture (its model block of configs/<arch>.yaml, or with ``--width`` and ``--n_layer`` the
catalogue's scaling of it, ``Architecture.scaled``; vocabulary ``--vocab_size``, 50,304) it reports training
tokens/s and its MFU (tokens/s x the backbone's flops_per_token / the peak FLOP/s of the device: a known GPU's
dense bf16 peak, on a CPU the float32 matmul rate measured here, or --peak_flops), prefill latency, cached decode
latency per token, cache/state bytes per token and peak memory, prints a table and writes JSON.

Training is timed as ltcx trains: ``LanguageModel.loss`` (the fused head and cross-entropy), backward, AdamW. All
models' steps run interleaved in one process, round after round (the first model rotating), and each model's
figure is the median of ``--repeats`` (at least 5) steps after one warm-up, so a load that drifts on a shared machine
hits all alike and the ratios hold. Like an ``ltcx`` command, the process keeps the memory a step frees for the next
step (``ltcx/cli/allocator.py``): models sharing a process then pay far less for each other's freed memory.
``--nanogpt PATH`` adds karpathy/nanoGPT's ``GPT`` read from a local copy of its model.py (never vendored), built at
the shape of the first ``gpt`` model (multi-head attention, nanoGPT's own loss from full logits) and timed in the
same rounds; ``--compile`` adds each model's ``torch.compile``d loss path
(``LanguageModel(compile=True)``; ``--compile ops``: ``compile="ops"``, where a backbone names ops for it) to the
rounds, with its compile time (wall: Inductor compiles in worker processes). ``--nx_xlstm DIR`` adds NX-AI's
``xLSTMLMModel`` (the ``xlstm`` package found in DIR, e.g. its wheel unpacked there; never vendored) built at the
first ``xlstm`` model's shape, to the ``--decode_at`` rounds: its own ``step`` after the same prompt.
``--free_memory_op`` adds each Titans model's training step with its chunkwise memory op (``neural_memory``)
replaced by a stand-in that costs nothing (y = q + k + v, the state passed on unchanged), to the same rounds: the
most that any faster form of that op could give the model. Its row also gives the op's FLOP rate, its training
products (``Titans.memory_op_flops_per_token``) over the time the stand-in saves, to set against the matmul rate,
with the op's time in the step (``memory_op_s``, what the stand-in saves), its calls' time run again alone
(``memory_op_alone_s``), and the time their products take, each timed on its own at its shape
(``memory_op_products_s``, ``memory_op_times``): the least that any form of the op built on torch's products can
take. ``--products_alone`` does the same for each model's whole training step: the time its products take, each
alone at its shape (``products_alone_s``), and their share of the step (``products_share``).

``--peak_memory`` measures each model's peak training memory instead: one training step in a fresh process per
(model, loss path) (``--memory_loss fused full``: ``LanguageModel.loss`` or the full ``[B, T, V]`` logits and
``F.cross_entropy``), its peak resident set (``resource.getrusage`` max RSS) and its resident set before the step.

``--data_loader TEXT`` measures the data instead: a corpus made of TEXT's training files repeated (each copy's
paragraphs tagged with the copy number, so that deduplication keeps them) is read as streaming text and, prepared
once by ``ltcx prepare``, as token shards; it reports loader tokens/s (one process, no dataloader workers) and, with
``--resume_tokens N``, the time to the first batch after resuming at N trained tokens in each mode.

``--profile [TOP]`` profiles each model's training step instead (``torch.profiler``, one step after two warm-ups):
its op calls and its TOP ops by self time, with their calls and share.

``--startup`` measures the commands instead: the CPU time (user + system, which other jobs on the machine do not
change, unlike the wall time) of ``ltcx --help``, each command's ``--help``, and one-line errors, each a fresh
process, median of ``--repeats``; then a study run cut to one step, as a fresh interpreter and forked from the fork
server that ``ltcx study`` starts its runs from without a GPU.

One script because every measurement shares its set-up and output: the models built from the catalogue's YAMLs,
the interleaved rounds that make the ratios fair, and one table and JSON.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import importlib.util
import io
import json
import math
import os
import platform
import resource
import statistics
import sys
import time
from pathlib import Path
from unittest import mock

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from ltcx.cli.allocator import keep_freed_memory  # noqa: E402
from ltcx.generation import generate  # noqa: E402
from ltcx.lm import LanguageModel  # noqa: E402
from ltcx.models import titans as titans_module  # noqa: E402
from ltcx.models.catalog import CATALOG, build_configured  # noqa: E402
from ltcx.models.inference_cache import keeping_derived  # noqa: E402
from ltcx.models.state import map_state_tensors  # noqa: E402
from ltcx.throughput import (  # noqa: E402
    best_rate,
    default_peak_flops,
    measured_matmul_flops,
    model_flops_per_token,
    peak_memory_mb,
    prefilled_state,
    sync,
    timed,
)
from ltcx.throughput import loss_step as throughput_loss_step  # noqa: E402


def fail(message: str) -> None:
    """A user error: one line, exit 2."""
    print(f"benchmark: error: {message}", file=sys.stderr)
    raise SystemExit(2)


def build_backbone(arch: str, args, min_context: int) -> torch.nn.Module:
    """The backbone of ``arch`` (a catalogue name, optionally ``name:key=value,...``): from its YAML, or with
    ``--width`` the catalogue's scaling of it to ``--width`` x ``--n_layer`` (heads of ``--head_dim``)."""
    try:
        if args.width is None:
            return build_configured(arch, args.vocab_size, min_context)
        import yaml

        name, _, overrides = arch.partition(":")
        entry = CATALOG[name]
        fields = entry.scaled(args.width, args.n_layer, args.seq_len, head_dim=args.head_dim)
        for assignment in filter(None, overrides.split(",")):
            key, _, value = assignment.partition("=")
            fields[key] = yaml.safe_load(value)
        if "block_size" in fields:
            fields["block_size"] = max(fields["block_size"] or 0, min_context)
        return entry.backbone_class()(**fields, vocab_size=args.vocab_size)
    except KeyError as error:
        fail(str(error.args[0]))


def load_nanogpt(path: str):
    """karpathy/nanoGPT's model.py from a local copy: the module (its ``GPT`` and ``GPTConfig``)."""
    file = Path(path)
    if not file.is_file():
        fail(f"--nanogpt {path}: no such file; give a local copy of karpathy/nanoGPT's model.py")
    spec = importlib.util.spec_from_file_location("nanogpt_model", file)
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
    except Exception as error:  # noqa: BLE001 - whatever the file raises, one line
        fail(f"--nanogpt {path}: cannot be imported ({type(error).__name__}: {error})")
    if not all(hasattr(module, name) for name in ("GPT", "GPTConfig")):
        fail(f"--nanogpt {path}: no GPT and GPTConfig in it; give karpathy/nanoGPT's model.py")
    return module


class Trainee:
    """One model's training step (forward through its loss, backward, AdamW), a function of no arguments;
    ``memory_op_flops``: a ``--free_memory_op`` step's, the training FLOPs the freed op does in the real step."""

    def __init__(self, label: str, step, params: int, flops_per_token: float | None, tokens: int,
                 memory_op_flops: float | None = None) -> None:
        self.label, self.step, self.params, self.flops_per_token, self.tokens = (
            label, step, params, flops_per_token, tokens)
        self.memory_op_flops = memory_op_flops


def autocast_of(args, device: torch.device):
    """The context a step runs in: bf16 autocast with ``--dtype bf16``, else nothing."""
    return torch.autocast(device.type, dtype=torch.bfloat16) if args.dtype == "bf16" else contextlib.nullcontext()


def trainable(backbone: torch.nn.Module, **options) -> LanguageModel:
    """``backbone`` as ltcx trains it. Its schedule is given an end, which ``configure_optimizers`` asks for; the
    learning rate does not change a step's time."""
    return LanguageModel(backbone, decay_steps=1, **options)


def loss_step(model: LanguageModel, batch: torch.Tensor, autocast, path: str = "fused"):
    """``ltcx.throughput.loss_step`` of ``model`` on batch [B, T + 1] (``path`` "full": the full logits and
    ``F.cross_entropy``) with the AdamW of ``model.configure_optimizers`` (its two parameter groups, torch's fused
    kernel where the device has one)."""
    return throughput_loss_step(model, batch, model.configure_optimizers()["optimizer"], autocast, path)


class NXAIStepper(torch.nn.Module):
    """NX-AI's ``xLSTMLMModel`` as ``(logits, state) = model(idx, state)``: its ``step``, token by token."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, idx: torch.Tensor, state=None):
        logits = None
        for t in range(idx.shape[1]):
            logits, state = self.model.step(idx[:, t:t + 1], state=state)
        return logits, state


def nx_xlstm(folder: str, ours: torch.nn.Module, context: int, device: torch.device) -> tuple[torch.nn.Module, int]:
    """NX-AI's xLSTMLMModel (the ``xlstm`` package in ``folder``) at the shape of ltcx's ``ours``: the same blocks,
    widths, heads, kernel and block sizes (its sLSTM on the ``vanilla`` backend, which runs on a CPU); the same
    parameter count, or one line. ``context``: its context_length (it keeps a [context, context] mask). Returns the
    stepper and that count."""
    sys.path.insert(0, str(Path(folder).resolve()))
    try:
        import xlstm as nx
    except Exception as error:  # noqa: BLE001 - whatever the package raises, one line
        fail(f"--nx_xlstm {folder}: xlstm cannot be imported ({type(error).__name__}: {error})")
    c = ours.config
    mlstm = nx.mLSTMLayerConfig(conv1d_kernel_size=c.conv_kernel_size, qkv_proj_blocksize=c.qkv_proj_blocksize,
                                num_heads=c.num_heads, proj_factor=c.mlstm_proj_factor,
                                round_proj_up_to_multiple_of=c.proj_round_to)
    slstm = nx.sLSTMLayerConfig(backend="vanilla", num_heads=c.slstm_num_heads, conv1d_kernel_size=c.conv_kernel_size,
                                bias_init="powerlaw_blockdependent")
    feedforward = nx.FeedForwardConfig(proj_factor=c.slstm_ffn_factor, act_fn="gelu",
                                       round_proj_up_to_multiple_of=c.proj_round_to)
    config = nx.xLSTMLMModelConfig(
        mlstm_block=nx.mLSTMBlockConfig(mlstm=mlstm),
        slstm_block=nx.sLSTMBlockConfig(slstm=slstm, feedforward=feedforward), context_length=context,
        num_blocks=c.num_layers, embedding_dim=c.embedding_dim, bias=c.bias,
        slstm_at=[i for i, kind in enumerate(c.block_types) if kind == "s"], vocab_size=c.vocab_size,
        tie_weights=c.tie_embeddings)
    model = nx.xLSTMLMModel(config)
    model.reset_parameters()
    theirs, mine = sum(p.numel() for p in model.parameters()), sum(p.numel() for p in ours.parameters())
    if theirs != mine:
        fail(f"--nx_xlstm: NX-AI's model at this shape has {theirs:,} parameters against ltcx's {mine:,}; "
             "this xlstm version builds another model")
    return NXAIStepper(model).to(device), theirs


def nanogpt_trainee(module, shape: dict, args, device: torch.device, autocast) -> Trainee:
    """nanoGPT's GPT at ``shape`` (a GPT's n_layer, n_head, n_embd, bias): its forward(idx, targets) loss and the
    AdamW of its own ``configure_optimizers`` (fused on CUDA only, as its code chooses)."""
    torch.manual_seed(0)
    config = module.GPTConfig(block_size=args.seq_len, vocab_size=args.vocab_size, n_layer=shape["n_layer"],
                              n_head=shape["n_head"], n_embd=shape["n_embd"], dropout=0.0, bias=shape["bias"])
    model = module.GPT(config).to(device).train()
    batch = torch.randint(0, args.vocab_size, (args.batch_size, args.seq_len + 1), device=device)
    inputs, targets = batch[:, :-1].contiguous(), batch[:, 1:].contiguous()  # its loss views the targets flat
    with contextlib.redirect_stdout(io.StringIO()):  # it prints its parameter groups
        optimizer = model.configure_optimizers(0.1, 1e-4, (0.9, 0.95), device.type)

    def step() -> None:
        with autocast:
            _, loss = model(inputs, targets)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    params = sum(p.numel() for p in model.parameters())  # tied weights once, position embeddings included
    return Trainee("nanogpt", step, params, None, args.batch_size * args.seq_len)


def interleaved_medians(trainees: list[Trainee], device: torch.device, repeats: int) -> dict[str, float]:
    """{label: median seconds of a step}: one warm-up step each, then ``repeats`` rounds of one step of every
    model, the first model rotating round by round."""
    for trainee in trainees:
        trainee.step()
    samples: dict[str, list[float]] = {t.label: [] for t in trainees}
    for round_index in range(repeats):
        shift = round_index % len(trainees)
        for trainee in trainees[shift:] + trainees[:shift]:
            sync(device)
            start = time.perf_counter()
            trainee.step()
            sync(device)
            samples[trainee.label].append(time.perf_counter() - start)
    return {label: statistics.median(values) for label, values in samples.items()}


def profile_step(trainee: Trainee, top: int) -> dict:
    """``torch.profiler`` over one training step of ``trainee`` after two warm-ups: every op call (views
    included) and the ``top`` ops with the most self time, each with its calls and its share of the step's self
    time (the shares move with the load; the counts do not)."""
    from torch.profiler import ProfilerActivity, profile

    trainee.step()
    trainee.step()
    with profile(activities=[ProfilerActivity.CPU]) as profiler:
        trainee.step()
    ops = [e for e in profiler.key_averages() if not e.key.startswith(("Optimizer.", "Optimizer#"))]
    total = sum(e.self_cpu_time_total for e in ops) or 1.0
    ranked = sorted(ops, key=lambda e: e.self_cpu_time_total, reverse=True)[:top]
    return {"op_calls": sum(e.count for e in ops),
            "top_ops": [{"op": e.key.removeprefix("aten::"), "calls": e.count,
                         "self_share": e.self_cpu_time_total / total} for e in ranked]}


def memory_child(args) -> None:
    """One training step of ``--memory_child`` in this (fresh) process; prints {"rss_before_mb", "peak_rss_mb"}."""
    torch.set_flush_denormal(True)
    torch.manual_seed(0)
    device = torch.device(args.device)
    if args.memory_child == "nanogpt":
        trainee = nanogpt_trainee(load_nanogpt(args.nanogpt), json.loads(args.nanogpt_shape), args, device,
                                  contextlib.nullcontext())
        step = trainee.step
    else:
        model = trainable(build_backbone(args.memory_child, args, args.seq_len)).to(device).train()
        batch = torch.randint(0, args.vocab_size, (args.batch_size, args.seq_len + 1), device=device)
        step = loss_step(model, batch, contextlib.nullcontext(), args.memory_child_loss)
    before = _resident_mb()
    step()
    print(json.dumps({"rss_before_mb": before, "peak_rss_mb": peak_memory_mb(torch.device("cpu"))}))


def _resident_mb() -> float | None:
    status = Path("/proc/self/status")
    if not status.is_file():
        return None
    for line in status.read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return None


def bench_peak_memory(args, gpt_shape: dict | None) -> list[dict]:
    """Each (model, loss path) in a fresh process: its peak resident set over one training step."""
    import subprocess

    results = []
    archs = list(args.archs) + (["nanogpt"] if args.nanogpt else [])
    for arch in archs:
        for path in (["full"] if arch == "nanogpt" else args.memory_loss):
            command = [sys.executable, str(Path(__file__).resolve()), "--memory_child", arch, "--memory_child_loss",
                       path, "--batch_size", str(args.batch_size), "--seq_len", str(args.seq_len),
                       "--vocab_size", str(args.vocab_size), "--device", args.device]
            if args.width is not None:
                command += ["--width", str(args.width), "--n_layer", str(args.n_layer), "--head_dim",
                            str(args.head_dim)]
            if arch == "nanogpt":
                command += ["--nanogpt", args.nanogpt, "--nanogpt_shape", json.dumps(gpt_shape)]
            env = {**os.environ, **({"OMP_NUM_THREADS": str(args.threads)} if args.threads else {})}
            run = subprocess.run(command, capture_output=True, text=True, env=env)
            if run.returncode != 0:
                fail(f"peak memory of {arch} ({path}): {(run.stderr.strip().splitlines() or ['failed'])[-1]}")
            result = {"arch": arch, "loss": path, **json.loads(run.stdout.strip().splitlines()[-1])}
            results.append(result)
            print(f"{arch:<40} {path:<6} peak RSS {result['peak_rss_mb']:8.0f} MiB "
                  f"(before the step {result['rss_before_mb'] or 0:6.0f} MiB)", flush=True)
    return results


def state_bytes(state) -> int:
    total = 0

    def count(t):
        nonlocal total
        total += t.numel() * t.element_size()
        return t

    map_state_tensors(state, count)
    return total


def build_arch(arch: str, args, device: torch.device) -> tuple[torch.nn.Module, list[Trainee]]:
    """The backbone of ``arch`` and its training steps: eager, and compiled with ``--compile`` (``--compile ops``:
    only the ops the backbone names, ``compile: ops``; a backbone without them gets no compiled step)."""
    torch.manual_seed(0)
    model = build_backbone(arch, args, max(args.seq_len, args.generate_tokens)).to(device).train()
    autocast = autocast_of(args, device)
    batch = torch.randint(0, args.vocab_size, (args.batch_size, args.seq_len + 1), device=device)
    tokens, flops = args.batch_size * args.seq_len, model_flops_per_token(model, args.seq_len)
    trainees = [Trainee(arch, loss_step(trainable(model), batch, autocast), model.parameter_count(), flops,
                        tokens)]
    if args.compile is True or (args.compile == "ops" and callable(getattr(model, "compile_ops", None))):
        # compile: ops marks the backbone's own modules, so it gets a copy (compile: true wraps a function around it)
        compiled = trainable(copy.deepcopy(model) if args.compile == "ops" else model, compile=args.compile)
        compiled.configure_model()  # as a fit with compile: true (forward_hidden) or compile: ops does
        trainees.append(Trainee(arch + " (compiled)", loss_step(compiled, batch, autocast), model.parameter_count(),
                                flops, tokens))
    if args.free_memory_op and any(isinstance(m, titans_module.NeuralMemory) for m in model.modules()):
        # no MFU: its FLOPs are the model's less what the stand-in leaves out
        trainees.append(Trainee(arch + " (free memory op)", with_free_memory_op(trainees[0].step),
                                model.parameter_count(), None, tokens,
                                memory_op_flops=tokens * model.memory_op_flops_per_token(args.seq_len)))
    return model, trainees


def free_memory_op(q, k, v, log_retain, log_momentum, step, state, *_, with_state=True):
    """A stand-in for ``neural_memory`` (called as it is) that costs nothing: y = q + k + v (every input still gets a
    gradient), the state passed on unchanged."""
    return q + k + v, state if with_state else None


_PRODUCTS = {"aten::mm": 0, "aten::bmm": 0, "aten::addmm": 1, "aten::addmm_": 1, "aten::baddbmm": 1,
             "aten::baddbmm_": 1}
"""The product ops, each with the index of its first factor among its inputs (after an added tensor, if any)."""


def _detached_copies(value, copies: dict):
    """``value`` (a tensor, or tuples and named tuples of them) copied off the graph, each tensor a leaf that wants
    a gradient where the original did; one tensor seen twice is one copy (the memory op tells M_0 by identity)."""
    if isinstance(value, torch.Tensor):
        if id(value) not in copies:
            copies[id(value)] = value.detach().clone().requires_grad_(value.requires_grad)
        return copies[id(value)]
    if isinstance(value, tuple):
        items = [_detached_copies(item, copies) for item in value]
        return type(value)(*items) if hasattr(value, "_fields") else tuple(items)
    return value


_PROFILED_DTYPES = {"float": torch.float32, "double": torch.float64, "c10::BFloat16": torch.bfloat16,
                    "c10::Half": torch.float16}
"""torch.profiler's names of the dtypes a product's operands may have."""


def _time_alone(name: str, shapes: list[list[int]], dtypes: list[str], device: torch.device) -> float:
    """Seconds of one call of product ``name`` at ``shapes`` and ``dtypes`` (as the profiler names them) on its own:
    fresh contiguous operands, its output written in place (``out=``), cache hot; the best of three runs of enough
    calls to take about 10 ms each (``best_rate``)."""
    first = _PRODUCTS[name]
    function = getattr(torch, name.removeprefix("aten::").rstrip("_"))
    operands = [torch.randn(shape, device=device, dtype=_PROFILED_DTYPES[dtype])
                for shape, dtype in zip(shapes[:first + 2], dtypes)]
    out = function(*operands)
    one = timed(lambda: function(*operands, out=out), device, repeats=1, warmup=3)
    calls = max(5, min(10_000, int(0.01 / max(one, 1e-7))))

    def batch() -> None:
        for _ in range(calls):
            function(*operands, out=out)
        sync(device)

    return 1.0 / best_rate(batch, calls, trials=3, budget_s=float("inf"))


def memory_op_times(step, device: torch.device, repeats: int = 5) -> dict:
    """The memory op's own calls in one training ``step``, forward and backward, run again on copies of their inputs:
    ``memory_op_alone_s``, their time (median of ``repeats``); ``memory_op_products_s``, the time of their products,
    each timed alone at its shape (``_time_alone``), the least that any form of the op built on torch's products can
    take, whatever it does between them; ``memory_op_products_flops``, those products' FLOPs (FlopCounterMode's,
    tests/test_benchmark.py), found by ``torch.profiler``."""
    calls, leaves, real = [], [], titans_module.neural_memory

    def recording(*args, **kwargs):
        copies: dict = {}
        calls.append((_detached_copies(args, copies), kwargs))
        leaves.extend(x for x in copies.values() if x.requires_grad)
        return real(*args, **kwargs)

    with mock.patch.object(titans_module, "neural_memory", recording):
        step()

    def run_calls() -> None:
        for args, kwargs in calls:
            y, _ = real(*args, **kwargs)
            y.backward(torch.ones_like(y))
        for leaf in leaves:  # as in the step, where the op's inputs are not leaves: nothing accumulates
            leaf.grad = None

    flops, products_s = products_alone(run_calls, device)
    return {"memory_op_alone_s": timed(run_calls, device, repeats), "memory_op_products_s": products_s,
            "memory_op_products_flops": flops}


def products_alone(run, device: torch.device) -> tuple[float, float]:
    """(FLOPs, seconds) of the products one call of ``run`` makes, found by ``torch.profiler`` and each timed alone
    at its shape (``_time_alone``): the least time those products take, whatever runs between them."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as profiler:
        run()
    counts: dict[tuple, int] = {}
    for event in profiler.events():
        if event.name in _PRODUCTS:
            key = (event.name, tuple(tuple(shape) for shape in event.input_shapes), tuple(event.input_dtypes))
            counts[key] = counts.get(key, 0) + 1
    flops = seconds = 0.0
    for (name, shapes, dtypes), count in counts.items():
        left, right = shapes[_PRODUCTS[name]:_PRODUCTS[name] + 2]
        flops += count * 2 * math.prod(left) * right[-1]
        seconds += count * _time_alone(name, [list(shape) for shape in shapes], list(dtypes), device)
    return flops, seconds


def with_free_memory_op(step):
    """``step`` with Titans' chunkwise memory op replaced by ``free_memory_op`` while it runs."""
    def run() -> None:
        with mock.patch.object(titans_module, "neural_memory", free_memory_op):
            step()

    return run


def bench_arch(arch: str, model: torch.nn.Module, args, device: torch.device) -> dict:
    """Prefill, decode, state size (and generation, the token loop's training) of one built model."""
    autocast = autocast_of(args, device)
    idx = torch.randint(0, args.vocab_size, (args.batch_size, args.seq_len + 1), device=device)
    result = {}
    model.eval()
    with torch.no_grad(), autocast, keeping_derived(model):  # as in a generation: derived weights built once
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
        optimizer = trainable(model).configure_optimizers()["optimizer"]  # as loss_step's

        def recurrent_step() -> None:
            with autocast:
                logits = model.forward_recurrent(idx[:, :-1])[0]
                loss = LanguageModel._cross_entropy(logits, idx[:, 1:])
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

        seconds = timed(recurrent_step, device, 1, 0)
        result["recurrent_train_tokens_per_s"] = args.batch_size * args.seq_len / seconds
    result["peak_memory_mb"] = peak_memory_mb(device)
    return result


def decode_at(models: dict, args, device: torch.device) -> dict:
    """{arch: {"decode_ms_at_P": ms}}: one cached decode step (batch --decode_batch) after P tokens, for every
    model in turn, round after round (the median of each; the first model rotates), so a load that drifts on a
    shared machine hits all alike."""
    times = {arch: {} for arch in models}
    with torch.no_grad(), contextlib.ExitStack() as generations:
        for model in models.values():  # as in a generation: derived weights built once
            generations.enter_context(keeping_derived(model))
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


def bench_study_starts(args) -> list[dict]:
    """CPU seconds of one study run as ``ltcx study`` starts it (``runner._child``), the quick-recall preset's first
    fit cut to one step: in a fresh interpreter, and forked from the fork server (``ltcx/study/prestart.py``). A forked
    run's CPU time reaches this process when the server is reaped, so a forked run's figure is the difference between
    a server that started 1 + ``repeats`` runs and one that started 1, over ``repeats``; the server's own start is the
    latter less one run."""
    import tempfile
    from unittest import mock

    from ltcx.study import prestart, runner
    from ltcx.study.spec import find_spec, load_spec

    spec = load_spec(find_spec("quick-recall"))
    run = runner.make_run(spec, runner.plan_shapes(spec)[0], spec.learning_rates[0], spec.tune_seed)

    def cpu_of(runs: int, forked: bool) -> float:
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        with tempfile.TemporaryDirectory() as folder, mock.patch.dict(os.environ,
                                                                      LTCX_STUDY_FORKSERVER=str(int(forked))):
            for index in range(runs):
                root = Path(folder) / str(index)
                root.mkdir()
                fit = [*runner.fit_args(spec, run, root), "--trainer.max_steps", "1"]
                if runner._child(fit, root / "run.log", run.label, env={"OMP_NUM_THREADS": "1"}):
                    fail(f"the study run failed: {runner.last_line(root / 'run.log')}")
            prestart.stop()
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        return after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime

    fresh = statistics.median(cpu_of(1, False) for _ in range(args.repeats))
    one = cpu_of(1, True)
    forked = (cpu_of(1 + args.repeats, True) - one) / args.repeats
    results = [{"command": f"a study run ({run.label}, 1 step), {how}", "cpu_s": cpu}
               for how, cpu in (("fresh interpreter", fresh), ("forked from the fork server", forked),
                                ("the fork server's own start, once per study", one - forked))]
    for result in results:
        print(f"{result['command']:<70} {result['cpu_s']:6.2f} s CPU", flush=True)
    return results


def gpt_shape(args) -> dict | None:
    """The shape nanoGPT is built at: the first ``gpt`` model's n_layer, n_head, n_embd and bias."""
    for arch in args.archs:
        if arch.partition(":")[0] == "gpt":
            config = build_backbone(arch, args, args.seq_len).config
            return {"n_layer": config.n_layer, "n_head": config.n_head, "n_embd": config.n_embd, "bias": config.bias}
    return None


def print_stamp(meta: dict) -> None:
    """The line a table in docs/ is stamped with: commit, command, machine and the load before and after."""
    line = f"commit {meta['commit']}, `{meta['command']}`, {meta['machine']}"
    if meta["load_average"] and meta.get("load_average_after"):
        line += (f", load average {meta['load_average'][0]:.2f} before, {meta['load_average_after'][0]:.2f} "
                 "after")
    print(line)


def write_results(out: str, meta: dict, results: list[dict]) -> None:
    """The JSON every mode writes: its stamp and arguments (``meta``) and its rows."""
    Path(out).write_text(json.dumps({"meta": meta, "results": results}, indent=2))
    print(f"wrote {out}")


def stamp(argv: list[str]) -> dict:
    """Commit, command, machine and load: what a table of these figures is stamped with."""
    import subprocess

    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no", "--", "ltcx", "scripts"], cwd=ROOT,
                           capture_output=True, text=True)
    return {"commit": (commit.stdout.strip() or None) and commit.stdout.strip() + ("+" if dirty.stdout.strip() else ""),
            "command": " ".join(["python", "scripts/benchmark.py", *argv]),
            "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, {platform.system()} {platform.release()}",
            "load_average": os.getloadavg() if hasattr(os, "getloadavg") else None}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--archs", nargs="+", default=["gpt"],
                        help=f"architectures ({', '.join(sorted(CATALOG))}), each optionally with :key=value,... "
                        "init_args")
    parser.add_argument("--batch_size", type=int, default=4)
    parser.add_argument("--seq_len", type=int, default=256)
    parser.add_argument("--width", type=int, default=None,
                        help="build every model at this width with the catalogue's scaling rule (default: the YAMLs)")
    parser.add_argument("--n_layer", type=int, default=4, help="with --width: the number of blocks")
    parser.add_argument("--head_dim", type=int, default=64, help="with --width: the attention heads' width")
    parser.add_argument("--vocab_size", type=int, default=50304)
    parser.add_argument("--repeats", type=int, default=5,
                        help="timed runs of each measurement (training: at least 5 interleaved rounds)")
    parser.add_argument("--dtype", choices=["float32", "bf16"], default="float32")
    parser.add_argument("--nanogpt", default=None, metavar="PATH",
                        help="also train karpathy/nanoGPT's GPT from this local copy of its model.py, at the first "
                             "gpt model's shape")
    parser.add_argument("--nx_xlstm", default=None, metavar="DIR",
                        help="with --decode_at: also time NX-AI's xLSTMLMModel step (the xlstm package in DIR) at the "
                             "first xlstm model's shape")
    parser.add_argument("--generate_tokens", type=int, default=0, help="also time generating this many tokens")
    parser.add_argument("--decode_at", type=int, nargs="*", default=[],
                        help="also time one cached decode step (batch --decode_batch) after this many tokens")
    parser.add_argument("--decode_batch", type=int, default=1, help="batch size of the --decode_at steps")
    parser.add_argument("--recurrent_baseline", action="store_true",
                        help="also time training through forward_recurrent (token by token), where a model has it")
    parser.add_argument("--compile", nargs="?", const=True, default=False, choices=["ops"],
                        help="also time each model's torch.compile'd loss path in the same rounds (ratio, compile s); "
                             "--compile ops: only the ops a backbone names for it (Titans' memory)")
    parser.add_argument("--free_memory_op", action="store_true",
                        help="also time each Titans model with its chunkwise memory op costing nothing (the most a "
                             "faster op could give)")
    parser.add_argument("--products_alone", action="store_true",
                        help="also time the matrix products of each model's training step, each alone at its shape "
                             "(the least time they take, whatever runs between them)")
    parser.add_argument("--peak_memory", action="store_true",
                        help="measure each model's peak training memory (a fresh process per model and loss path)")
    parser.add_argument("--memory_loss", nargs="+", choices=["fused", "full"], default=["fused"],
                        help="with --peak_memory: the loss paths (fused head, or full logits)")
    parser.add_argument("--memory_child", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--memory_child_loss", default="fused", help=argparse.SUPPRESS)
    parser.add_argument("--nanogpt_shape", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--profile", type=int, nargs="?", const=4, default=0, metavar="TOP",
                        help="profile one training step of each model instead: its op calls and its TOP (4) ops by "
                             "self time")
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
    keep_freed_memory()  # as an ltcx command: a step's freed memory kept for the next, in every model's process alike
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.memory_child:
        memory_child(args)
        return
    if args.data_loader or args.startup:
        results = bench_data(args) if args.data_loader else bench_startup(args) + bench_study_starts(args)
        write_results(args.out, vars(args), results)
        return
    meta = stamp(sys.argv[1:])
    nanogpt = load_nanogpt(args.nanogpt) if args.nanogpt else None  # a bad path: one line before any model
    shape = gpt_shape(args)
    if nanogpt is not None and shape is None:
        fail("--nanogpt is built at the shape of a gpt model: name gpt among --archs")
    xlstm_label = next((a for a in args.archs if a.partition(":")[0] == "xlstm"), None)
    if args.nx_xlstm and (xlstm_label is None or not args.decode_at):
        fail("--nx_xlstm times NX-AI's decode step at the shape of the xlstm model: name xlstm among --archs and "
             "give --decode_at")
    if args.nx_xlstm and not (Path(args.nx_xlstm) / "xlstm" / "__init__.py").is_file():
        fail(f"--nx_xlstm {args.nx_xlstm}: no xlstm package in it; unpack NX-AI's xlstm wheel there "
             "(pip download xlstm --no-deps; unzip)")
    if args.peak_memory:
        results = bench_peak_memory(args, shape)
        write_results(args.out, {**meta, **vars(args)}, results)
        return
    # Products of tiny decay factors (Titans' memory, xLSTM's gates) reach float32 denormals, which are
    # very slow on CPUs; flushing them to zero changes no figure that matters and times the real work.
    torch.set_flush_denormal(True)
    device = torch.device(args.device)
    matmul_flops = measured_matmul_flops(torch.get_num_threads()) if device.type == "cpu" else None
    if args.peak_flops is not None:
        peak_flops, source = args.peak_flops, "--peak_flops"
    else:
        peak_flops, source = default_peak_flops(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    models, trainees = {}, []
    for arch in args.archs:
        label = arch
        while label in models:  # the same architecture twice: the spread between the copies is the noise floor
            label += "'"
        models[label], built = build_arch(arch, args, device)
        for trainee in built:
            trainee.label = trainee.label.replace(arch, label, 1)
        trainees += built
    if nanogpt is not None:
        autocast = autocast_of(args, device)
        trainees.append(nanogpt_trainee(nanogpt, shape, args, device, autocast))
    if args.profile:
        results = [{"arch": t.label, **profile_step(t, args.profile)} for t in trainees]
        meta["load_average_after"] = os.getloadavg() if hasattr(os, "getloadavg") else None
        print_stamp(meta)
        print("arch | op calls | top ops: calls, share of self time")
        for r in results:
            tops = ", ".join(f"{o['op']} {o['calls']}x {100 * o['self_share']:.0f}%" for o in r["top_ops"])
            print(f"{r['arch']} | {r['op_calls']:,} | {tops}")
        write_results(args.out, {**meta, **vars(args)}, results)
        return
    compile_s = {}
    for trainee in trainees:
        if trainee.label.endswith(" (compiled)"):
            start = time.perf_counter()
            trainee.step()  # compiles forward and backward
            sync(device)
            compile_s[trainee.label] = time.perf_counter() - start
    step_s = interleaved_medians(trainees, device, max(5, args.repeats))
    steps = {trainee.label: trainee.step for trainee in trainees}
    base = trainees[0].tokens / step_s[trainees[0].label]
    results = []
    for trainee in trainees:
        rate = trainee.tokens / step_s[trainee.label]
        result = {"arch": trainee.label, "params": trainee.params, "train_step_s": step_s[trainee.label],
                  "train_tokens_per_s": rate, "vs_first": rate / base, "train_flops_per_token": trainee.flops_per_token,
                  "mfu": None if peak_flops is None or trainee.flops_per_token is None
                  else rate * trainee.flops_per_token / peak_flops}
        eager = trainee.label.removesuffix(" (compiled)")
        if trainee.label in compile_s:
            result["compile_s"] = compile_s[trainee.label]
            result["compiled_vs_eager"] = step_s[eager] / step_s[trainee.label]
        if args.products_alone and not trainee.label.endswith((" (compiled)", " (free memory op)")):
            flops, seconds = products_alone(trainee.step, device)
            result.update(products_alone_s=seconds, products_flops=flops,
                          products_share=seconds / step_s[trainee.label])
        if trainee.memory_op_flops is not None:  # the op's FLOP rate: its FLOPs over the time freeing it saves
            eager = trainee.label.removesuffix(" (free memory op)")
            op_s = step_s[eager] - step_s[trainee.label]
            result["memory_op_flop_rate"] = trainee.memory_op_flops / op_s if op_s > 0 else None
            result.update(memory_op_s=op_s, **memory_op_times(steps[eager], device))
        if trainee.label in models:
            result.update(bench_arch(trainee.label, models[trainee.label], args, device))
        results.append(result)
    if args.decode_at:
        decoders = dict(models)
        if args.nx_xlstm:
            decoders["nx-ai xlstm"], nx_params = nx_xlstm(args.nx_xlstm, models[xlstm_label], max(args.decode_at) + 1,
                                                          device)
        decode_times = decode_at(decoders, args, device)
        if args.nx_xlstm:
            results.append({"arch": "nx-ai xlstm", "params": nx_params, **decode_times["nx-ai xlstm"]})
        for result in results:
            result.update(decode_times.get(result["arch"], {}))
    meta["load_average_after"] = os.getloadavg() if hasattr(os, "getloadavg") else None
    columns = ["arch", "params", "train_tokens_per_s", "vs_first", "mfu", "prefill_ms", "decode_ms_per_token",
               "state_bytes_per_token", "state_bytes_per_sequence", "peak_memory_mb"]
    if args.compile:
        columns += ["compiled_vs_eager", "compile_s"]
    if args.products_alone:
        columns += ["products_alone_s", "products_share"]
    if args.free_memory_op:
        columns += ["memory_op_flop_rate", "memory_op_s", "memory_op_alone_s", "memory_op_products_s"]
    if args.generate_tokens:
        columns += ["generate_cached_s", "generate_uncached_s"]
    columns += [f"decode_ms_at_{p}" for p in args.decode_at]
    if args.recurrent_baseline:
        columns += ["recurrent_train_tokens_per_s"]
    print(f"device={device} dtype={args.dtype} batch={args.batch_size} seq_len={args.seq_len} "
          f"torch={torch.__version__}")
    print_stamp(meta)
    if matmul_flops is not None:
        print(f"measured float32 matmul rate: {matmul_flops / 1e9:.1f} GFLOP/s ({torch.get_num_threads()} threads)")
    print("MFU peak: "
          + (f"{peak_flops:.4g} FLOP/s ({source})" if peak_flops else f"none ({source}): set --peak_flops"))
    print(" | ".join(columns))
    for r in results:
        print(" | ".join(f"{r.get(c):.3g}" if isinstance(r.get(c), float) else str(r.get(c, "-")) for c in columns))
    meta.update({"device": str(device), "dtype": args.dtype, "batch_size": args.batch_size, "seq_len": args.seq_len,
                 "torch": torch.__version__, "processor": platform.processor() or platform.machine(),
                 "threads": torch.get_num_threads(), "peak_flops": peak_flops, "peak_source": source,
                 "matmul_fp32_flops": matmul_flops})
    write_results(args.out, meta, results)


if __name__ == "__main__":
    main()
