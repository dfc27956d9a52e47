"""The GPU check: every catalogued architecture at the reference shape on one NVIDIA GPU, in under 8 minutes,
written as JSON and as a Markdown table to paste into docs/benchmarks.md.

    python scripts/gpu_check.py                 # on a GPU machine: gpu_check.json and gpu_check.md
    python scripts/gpu_check.py --tiny          # the same code end to end on a CPU at tiny shapes (the tests run it)

For each entry of the catalogue (ltcx/models/catalog.py; its configs/<arch>.yaml, vocabulary 50,304), at batch
24 x 512 under bf16 autocast (what ``precision: bf16-mixed`` trains with):

* training tokens/s (``LanguageModel.loss`` with its fused head, backward, AdamW: ``ltcx.throughput.loss_step``,
  as a fit trains) and MFU against the GPU's dense bf16 peak (``ltcx.throughput``); the peak memory allocated while
  training, and while training through the full ``[B, T, V]`` logits instead (the path before the fused head);
* the ``torch.compile``'d (Inductor) training step, compiled as ``--model.compile true`` compiles it: its compile
  time, tokens/s and speed-up over eager;
* one cached decode step at batch 1 and 16 after 128 and 2,048 tokens ("n/a (context 512)" for a model whose
  learned position embeddings end its context there);
* which ``scaled_dot_product_attention`` kernel ran, in a training forward and in a decode step: the aten op the
  profiler recorded (``_scaled_dot_product_flash_attention`` is flash, ``..._efficient_attention`` the
  memory-efficient kernel, ``..._cudnn_attention`` cuDNN, ``..._attention_math`` the unfused fallback): what
  ran, not what might have.

Then two checks through the CLI: a 2-step DDP fit (``configs/gpt.yaml`` + ``configs/trainer/ddp.yaml`` on the
built-in sample, every visible GPU) and a bf16 ``ltcx generate`` from its checkpoint.

Every measurement is guarded: one that fails records its error (one line) and the others go on. The CLI checks
run first; the models then run one after another in a worker process, each given an equal share of the time left
of ``--budget_s``; a model still running at the end of its share (a compile that does not finish) is stopped,
what it had not measured is recorded as timed out, and a new worker goes on with the next model (as after a CUDA
error, which leaves a process's CUDA context unusable). The exit status is 1 when anything failed, after the report
is written.

``--tiny``: the catalogue's tiny shapes (``build_tiny``, ``tiny_cli``) at batch 2 x 8, float32 on the CPU (bf16
autocast is emulated there, and slow), a couple of steps, decode at batch 1 and 2 after 8 and 80 tokens (beyond the
tiny GPTs' context of 64), ``torch.compile`` with the ``eager`` backend (graph capture without Inductor's C++
build), the DDP fit with gloo on ``--ddp_processes`` CPU processes.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import gc
import json
import os
import platform
import re
import shlex
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from contextlib import contextmanager, nullcontext
from pathlib import Path
from unittest import mock

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from ltcx.models.catalog import CATALOG, build_configured  # noqa: E402

VOCAB = 50304  # the GPT-2 vocabulary padded to a multiple of 64, as the data module pads it
TINY_VOCAB = 512
GRACE_S = 15.0  # past a model's share before its worker is stopped (a measurement may end just after)
PROMPT = "Once upon a time"


class Shape:
    """What one mode measures: the training batch, the decode points, repeats and the compile backend."""

    def __init__(self, tiny: bool, compile_backend: str | None):
        self.tiny = tiny
        self.batch, self.seq_len = (2, 8) if tiny else (24, 512)
        self.dtype = "float32" if tiny else "bf16"
        self.decode_batches = (1, 2) if tiny else (1, 16)
        self.decode_positions = (8, 80) if tiny else (128, 2048)
        self.train_warmup, self.train_repeats, self.train_budget_s = (1, 2, 5.0) if tiny else (3, 20, 10.0)
        self.decode_warmup, self.decode_repeats = (1, 3) if tiny else (5, 50)
        self.compile_backend = compile_backend or ("eager" if tiny else "inductor")

    def decode_fields(self) -> list[str]:
        return [f"decode_ms_b{b}_at_{p}" for p in self.decode_positions for b in self.decode_batches]

    def fields(self) -> list[str]:
        """Every figure of one model, in the table's order."""
        return ["params", "context", "train_tokens_per_s", "mfu", "peak_memory_mb", "peak_memory_full_logits_mb",
                "kernels_per_step", "compile_s", "compiled_tokens_per_s", "compile_speedup", *self.decode_fields(),
                "sdpa_train", "sdpa_decode"]


# -- the worker: the models, one after another -----------------------------------------------------------------


SDPA_KERNELS = {  # aten op (what the dispatcher chose) -> backend
    "_scaled_dot_product_flash_attention": "flash",
    "_scaled_dot_product_flash_attention_for_cpu": "flash (CPU)",
    "_scaled_dot_product_efficient_attention": "efficient",
    "_scaled_dot_product_cudnn_attention": "cudnn",
    "_scaled_dot_product_attention_math": "math",
    "_scaled_dot_product_fused_attention_overrideable": "overrideable",
}


def sdpa_kernels(run) -> str:
    """The scaled_dot_product_attention backends that ``run()`` dispatched to, read from the aten ops the profiler
    recorded (CPU-side dispatch: no CUPTI needed); "none (no SDPA call)" for a model that does not call it."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        run()
    ops = {event.key.removeprefix("aten::") for event in prof.key_averages()}
    found = sorted({backend for op, backend in SDPA_KERNELS.items() if op in ops})
    if found:
        return ", ".join(found)
    if "scaled_dot_product_attention" in ops:  # called, through a kernel this table does not know
        return "unknown: " + ", ".join(sorted(op for op in ops if "attention" in op))
    return "none (no SDPA call)"


def first_line(error: BaseException) -> str:
    lines = str(error).strip().splitlines()
    return f"{type(error).__name__}: {lines[0] if lines else ''}"[:300]


class Recorder:
    """One model's figures in ``<work>/<arch>.json``, rewritten (atomically) after every measurement, so that what
    was measured survives a worker stopped mid-way; ``phase`` and ``phase_fields`` say what was running."""

    def __init__(self, path: Path, arch: str, share_s: float):
        self.path = path
        self.result = {"arch": arch, "share_s": share_s, "deadline": time.time() + share_s, "done": False,
                       "phase": None, "phase_fields": [], "errors": {}}
        self.write()

    def write(self) -> None:
        temporary = self.path.with_suffix(".tmp")
        temporary.write_text(json.dumps(self.result, indent=1))
        os.replace(temporary, self.path)

    def set(self, **fields) -> None:
        self.result.update(fields)
        self.write()

    @contextmanager
    def measuring(self, phase: str, *fields: str):
        """Run the block as ``phase``; an exception in it records its first line for each of ``fields`` (their
        values None) and does not propagate."""
        self.set(phase=phase, phase_fields=list(fields))
        try:
            yield
        except Exception as error:  # noqa: BLE001 - a failing measurement is a result, the next one goes on
            traceback.print_exc()
            for field in fields:
                if self.result.get(field) is None:
                    self.result[field] = None
                    self.result["errors"][field] = first_line(error)
            if "CUDA error" in str(error):  # e.g. an illegal memory access: this process's CUDA context is unusable
                self.set(phase=None, phase_fields=[])
                sys.exit(3)  # the orchestrator records the rest of this model as not measured; a new worker goes on
            release_memory()
        self.set(phase=None, phase_fields=[])


def release_memory() -> None:
    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def decode_step(model, batch: int, position: int, device, autocast, measure):
    """``measure(step)`` of one cached decode step of ``model`` (eval mode, no gradients, under ``autocast``) at
    ``batch`` after ``position`` tokens; the state is freed on return."""
    import torch

    from ltcx.models.inference_cache import keeping_derived
    from ltcx.throughput import prefilled_state

    with torch.no_grad(), autocast, keeping_derived(model):  # as in a generation: derived weights built once
        token, state = prefilled_state(model, batch, position, device)
        return measure(lambda: model(token, state))


def measure_model(arch: str, shape: Shape, device, peak: tuple, record: Recorder) -> None:
    """Every figure of ``arch`` into ``record``, each measurement guarded."""
    import torch

    from ltcx.lm import LanguageModel
    from ltcx.throughput import (
        kernels_per_step,
        loss_step,
        model_flops_per_token,
        peak_memory_mb,
        sync,
        timed,
    )

    autocast = torch.autocast(device.type, dtype=torch.bfloat16) if shape.dtype == "bf16" else nullcontext()
    model = None
    with record.measuring("build", "params", "context"):
        torch.manual_seed(0)
        if shape.tiny:
            model = CATALOG[arch].build_tiny(TINY_VOCAB).to(device)
        else:
            # min_context: the GPT family's null block_size is the data's length in a fit, here the reference 512
            model = build_configured(arch, VOCAB, min_context=shape.seq_len).to(device)
        record.set(params=model.parameter_count(), context=model.max_seq_len)
    if model is None:
        for field in shape.fields():
            record.result["errors"].setdefault(field, "not measured: the model could not be built")
            record.result.setdefault(field, None)
        return
    vocab = TINY_VOCAB if shape.tiny else VOCAB
    idx = torch.randint(0, vocab, (shape.batch, shape.seq_len + 1), device=device)
    tokens = shape.batch * shape.seq_len
    trained = LanguageModel(model, decay_steps=1)  # as a fit trains it (the schedule's end does not change a step)
    optimizer = trained.configure_optimizers()["optimizer"]
    eager_tokens_per_s = None

    with record.measuring("train", "train_tokens_per_s", "mfu", "peak_memory_mb"):
        model.train()
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        step = loss_step(trained, idx, optimizer, autocast)
        seconds = timed(step, device, shape.train_repeats, shape.train_warmup, shape.train_budget_s)
        eager_tokens_per_s = tokens / seconds
        flops_per_token = model_flops_per_token(model, shape.seq_len)
        mfu = None if peak[0] is None else eager_tokens_per_s * flops_per_token / peak[0]
        record.set(train_tokens_per_s=eager_tokens_per_s, mfu=mfu, peak_memory_mb=peak_memory_mb(device))
        if mfu is None:
            record.result["errors"]["mfu"] = f"no known peak FLOP/s for this device ({peak[1]}): pass --peak_flops"

    with record.measuring("train with full logits", "peak_memory_full_logits_mb"):
        # the peak before the fused head: the [B, T, V] logits, their float32 copy and F.cross_entropy
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        full = loss_step(trained, idx, optimizer, autocast, path="full")
        full()
        full()
        sync(device)
        record.set(peak_memory_full_logits_mb=peak_memory_mb(device))
        release_memory()

    with record.measuring("kernels", "kernels_per_step"):  # the eager step's kernel launches, views left out
        record.set(kernels_per_step=sum(kernels_per_step(trained, idx, optimizer, autocast).values()))

    with record.measuring("sdpa", "sdpa_train", "sdpa_decode"):
        def training_forward():
            with autocast:
                model(idx[:, :-1])

        record.set(sdpa_train=sdpa_kernels(training_forward))
        model.eval()
        record.set(sdpa_decode=decode_step(model, 1, shape.decode_positions[0], device, autocast, sdpa_kernels))
        release_memory()

    model.eval()
    for position in shape.decode_positions:
        for batch in shape.decode_batches:
            field = f"decode_ms_b{batch}_at_{position}"
            with record.measuring(f"decode batch {batch} after {position}", field):
                context = model.max_seq_len
                if context is not None and position >= context:
                    record.set(**{field: f"n/a (context {context})"})
                    continue
                seconds = decode_step(model, batch, position, device, autocast,
                                      lambda step: timed(step, device, shape.decode_repeats, shape.decode_warmup))
                record.set(**{field: 1e3 * seconds})
                release_memory()

    with record.measuring("compile", "compile_s", "compiled_tokens_per_s", "compile_speedup"):
        model.train()
        torch._dynamo.reset()
        # as a fit with --model.compile true: the backbone's hidden states compiled, the fused head after them;
        # LanguageModel compiles with torch.compile's default backend (Inductor), --tiny swaps in its own
        compiled = LanguageModel(model, decay_steps=1, compile=True)
        with mock.patch.object(torch, "compile", functools.partial(torch.compile, backend=shape.compile_backend)):
            compiled.configure_model()
        step = loss_step(compiled, idx, optimizer, autocast)
        sync(device)
        start = time.perf_counter()
        step()  # compiles the forward and the backward
        sync(device)
        record.set(compile_s=time.perf_counter() - start)
        seconds = timed(step, device, shape.train_repeats, shape.train_warmup, shape.train_budget_s)
        record.set(compiled_tokens_per_s=tokens / seconds,
                   compile_speedup=None if eager_tokens_per_s is None else tokens / seconds / eager_tokens_per_s)
        if eager_tokens_per_s is None:
            record.result["errors"]["compile_speedup"] = "no eager figure to compare with"


def worker_main(args) -> None:
    """``--worker``: measure ``args.archs`` in turn, each within an equal share of the time to ``args.deadline``."""
    import torch

    from ltcx.throughput import default_peak_flops

    shape = Shape(args.tiny, args.compile_backend)
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.set_flush_denormal(True)  # CPU: products of tiny decay factors reach slow float32 denormals
    device = torch.device("cuda" if torch.cuda.is_available() and not args.tiny else "cpu")
    if args.peak_flops is not None:
        peak = (args.peak_flops, "--peak_flops")
    else:
        peak = default_peak_flops(device)
    device_name = torch.cuda.get_device_name(device) if device.type == "cuda" else (platform.processor() or "CPU")
    work = Path(args.work_dir)
    for index, arch in enumerate(args.archs):
        now = time.time()
        share = max(0.0, (args.deadline - now) / (len(args.archs) - index))
        record = Recorder(work / f"{arch}.json", arch, share)
        record.set(device_name=device_name, peak_flops=peak[0], peak_source=peak[1])
        print(f"gpu_check: {arch} ({share:.0f} s of the budget)", flush=True)
        start = time.perf_counter()
        if share < 1.0:
            for field in shape.fields():
                record.result[field] = None
                record.result["errors"][field] = "not measured: the time budget (--budget_s) was spent"
        else:
            measure_model(arch, shape, device, peak, record)
        release_memory()
        record.set(done=True, seconds=time.perf_counter() - start)
        print(f"gpu_check: {arch} done in {time.perf_counter() - start:.1f} s", flush=True)


# -- the orchestrator ------------------------------------------------------------------------------------------


def stop_group(process: subprocess.Popen) -> None:
    """SIGKILL the worker's process group (it and the compile workers it started)."""
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    process.wait()


def read_json(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def run_models(args, shape: Shape, work: Path, deadline: float) -> dict[str, dict]:
    """{arch: its figures}: the worker over the archs left until every arch has a record; a stopped or crashed
    worker's current arch keeps what it measured, the rest of its fields name why they are missing."""
    results: dict[str, dict] = {}
    pending = list(args.archs)
    while pending:
        command = [sys.executable, str(Path(__file__).resolve()), "--worker", "--work_dir", str(work),
                   "--deadline", repr(deadline), "--archs", *pending]
        for flag, value in (("--compile_backend", args.compile_backend), ("--threads", args.threads),
                            ("--peak_flops", args.peak_flops)):
            if value is not None:
                command += [flag, str(value)]
        if args.tiny:
            command.append("--tiny")
        worker = subprocess.Popen(command, start_new_session=True)  # its own group: stopped with its children
        why = None
        try:
            while worker.poll() is None:
                time.sleep(0.25)
                current = next((r for r in map(read_json, (work / f"{a}.json" for a in pending))
                                if r is not None and not r["done"]), None)
                if current is not None and time.time() > current["deadline"] + GRACE_S:
                    why = (f"timed out: stopped {GRACE_S:.0f} s after the end of {current['arch']}'s share of the "
                           f"budget ({current['share_s']:.0f} s), during {current['phase']}")
                    stop_group(worker)
        finally:
            if worker.poll() is None:  # the check itself was stopped (Ctrl-C): so is its worker
                stop_group(worker)
        if why is None and worker.returncode != 0:
            why = f"the worker process ended with exit code {worker.returncode}"
        finished = []
        for arch in pending:
            result = read_json(work / f"{arch}.json")
            if result is None:
                break
            if not result["done"]:
                reason = why or "the worker stopped"
                for field in shape.fields():
                    if field not in result:
                        result[field] = None
                        result["errors"].setdefault(
                            field, reason if field in result["phase_fields"] else f"not measured: {reason}")
            results[arch] = result
            finished.append(arch)
            if not result["done"]:
                break
        if not finished:  # the worker ended before it started any model
            for arch in pending:
                results[arch] = {"arch": arch, **{field: None for field in shape.fields()},
                                 "errors": {field: why or "the worker measured nothing" for field in shape.fields()}}
            break
        pending = pending[len(finished):]
    return results


def run_cli(command: list[str], cwd: Path, timeout: float) -> tuple[subprocess.CompletedProcess | None, float, str]:
    """(the finished process or None, seconds, an error line or "") of ``python run.py ...`` offline; at
    ``timeout`` its whole process group (DDP's other ranks too) is stopped."""
    environment = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
                   "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    start = time.perf_counter()
    process = subprocess.Popen(command, cwd=cwd, env=environment, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               text=True, start_new_session=True)
    try:
        stdout, stderr = process.communicate(timeout=max(1.0, timeout))
    except subprocess.TimeoutExpired:
        stop_group(process)
        return None, time.perf_counter() - start, f"timed out after {max(1.0, timeout):.0f} s"
    finally:
        if process.poll() is None:  # the check itself was stopped (Ctrl-C)
            stop_group(process)
    seconds = time.perf_counter() - start
    done = subprocess.CompletedProcess(command, process.returncode, stdout, stderr)
    if done.returncode != 0:
        tail = [line for line in done.stderr.strip().splitlines() if line.strip()][-3:]
        return done, seconds, f"exit code {done.returncode}: " + " | ".join(tail)[-600:]
    return done, seconds, ""


def shown(command: list[str], work: Path) -> str:
    """The command as a person would type it in the repository root (python, run.py and config paths relative)."""
    words = ["python", *command[1:]]
    return shlex.join(w.replace(str(ROOT) + os.sep, "").replace(str(work) + os.sep, "") for w in words)


def cli_checks(args, work: Path, deadline: float) -> dict:
    """A 2-step DDP fit of configs/gpt.yaml + configs/trainer/ddp.yaml on the built-in sample, then a bf16
    ``ltcx generate`` from its checkpoint, both through ``run.py``."""
    import torch

    python, run = sys.executable, str(ROOT / "run.py")
    fit = [python, run, "fit", "--config", str(ROOT / "configs/gpt.yaml"), "--config",
           str(ROOT / "configs/trainer/ddp.yaml"), "--data.path", "sample", "--data.val_batches", "1",
           "--trainer.max_steps", "2", "--trainer.val_check_interval", "2", "--trainer.log_every_n_steps", "1",
           "--trainer.enable_progress_bar", "false"]
    if args.tiny:
        fit += ["--trainer.accelerator", "cpu", "--trainer.devices", str(args.ddp_processes),
                "--trainer.precision", "32-true", "--data.block_size", "32", "--data.batch_size", "2",
                *CATALOG["gpt"].tiny_cli()]
    checks: dict = {}
    # Bounded, so a hung process group (e.g. NCCL waiting on a rank) cannot take the models' time.
    done, seconds, error = run_cli(fit, work, min(240.0 if args.tiny else 150.0, deadline - time.time()))
    checkpoint = work / "checkpoints/gpt/version_0/last.ckpt"
    ddp = {"command": shown(fit, work), "seconds": seconds, "error": error}
    if done is not None:
        members = re.findall(r"MEMBER: \d+/(\d+)", done.stdout + done.stderr)
        ddp["processes"] = int(members[0]) if members else None
    if not error:
        try:
            ddp["global_step"] = torch.load(checkpoint, map_location="cpu", weights_only=True)["global_step"]
            if ddp["global_step"] != 2:
                ddp["error"] = f"the checkpoint is at step {ddp['global_step']}, not 2"
        except Exception as failure:  # noqa: BLE001
            ddp["error"] = f"no readable checkpoint at {checkpoint.relative_to(work)}: {first_line(failure)}"
    ddp["ok"] = not ddp["error"]
    checks["ddp_fit"] = ddp

    generate = [python, run, "generate", "--ckpt_path", str(checkpoint), "--prompt", PROMPT, "--max_new_tokens",
                "32", "--temperature", "0", "--dtype", "bfloat16", *(["--device", "cpu"] if args.tiny else [])]
    if not checkpoint.is_file():
        checks["generate"] = {"command": shown(generate, work), "seconds": 0.0, "ok": False,
                              "error": "not run: the DDP fit left no checkpoint"}
        return checks
    done, seconds, error = run_cli(generate, work, min(90.0, deadline - time.time()))
    text = done.stdout.strip() if done is not None else ""
    if not error and not text.startswith(PROMPT):
        error = f"the output does not continue the prompt: {text[:80]!r}"
    checks["generate"] = {"command": shown(generate, work), "seconds": seconds, "ok": not error, "error": error,
                          "text": text[:300]}
    return checks


def commit_of_tree() -> str:
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                              timeout=10)
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT,
                               capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return "unknown (no git)"
    if head.returncode != 0:
        return "unknown (not a git checkout: pass --commit)"
    return head.stdout.strip() + (" (with uncommitted changes)" if dirty.stdout.strip() else "")


# -- the report --------------------------------------------------------------------------------------------------


def number(value, digits: int = 3) -> str:
    """A figure for the table: thousands separated above 1,000, else ``digits`` significant digits."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return str(value)
    if abs(value) >= 1000:
        return f"{value:,.0f}"
    return f"{value:.{digits}g}"


def cell(result: dict, field: str, unit: str = "", suffix: str = "") -> str:
    value = result.get(field)
    if value is None:
        return "failed" if field in result.get("errors", {}) else "-"
    if isinstance(value, str):
        return value
    return f"{number(value)}{suffix}{unit}"


def markdown(report: dict) -> str:
    """The report as Markdown: a stamp line, the table of models, the CLI checks, every error."""
    meta, shape = report["meta"], report["meta"]["shape"]
    positions, batches = shape["decode_positions"], shape["decode_batches"]
    lines = [
        f"**GPU check: {meta['device_name']}** ({meta['visible_gpus']} visible), {meta['date']}, commit "
        f"{meta['commit']}, torch {meta['torch']} (CUDA {meta['cuda']}, cuDNN {meta['cudnn']}), Python "
        f"{meta['python']}; {meta['seconds']:.0f} s in all (budget {meta['budget_s']:.0f} s):",
        "",
        f"    {meta['command']}",
        "",
        f"Batch {shape['batch']} x {shape['seq_len']}, {shape['dtype']}"
        f"{' autocast (bf16-mixed)' if shape['dtype'] == 'bf16' else ''}, vocabulary {shape['vocab']:,}; "
        "training = `LanguageModel.loss` (the fused head) + backward + AdamW, as a fit trains; peak, full logits = "
        "the same step through the full [B, T, V] logits and `F.cross_entropy`; kernels = the eager step's "
        "(`ltcx.throughput.kernels_per_step`); MFU against "
        f"{meta['peak_flops'] or 0:.3g} FLOP/s ({meta['peak_source']}); compiled = `torch.compile` "
        f"({shape['compile_backend']}) of the training step, as `--model.compile true`; "
        f"decode = one cached step, ms, at batch b after p tokens; SDPA = the kernel that ran (profiler), "
        "training forward / decode step.",
        "",
    ]
    decode_heads = [f"decode b{b} @{p} (ms)" for p in positions for b in batches]
    head = ["model", "parameters", "train tokens/s", "MFU", "peak memory", "peak, full logits", "kernels per step",
            "compiled tokens/s",
            "compile speed-up",
            "compile time", *decode_heads, "SDPA"]
    lines.append("| " + " | ".join(head) + " |")
    lines.append("|---|" + "---:|" * (len(head) - 2) + "---|")
    for result in report["results"]:
        sdpa = f"{cell(result, 'sdpa_train')} / {cell(result, 'sdpa_decode')}"
        row = [result["arch"], cell(result, "params"), cell(result, "train_tokens_per_s"), cell(result, "mfu"),
               cell(result, "peak_memory_mb", " MiB"), cell(result, "peak_memory_full_logits_mb", " MiB"),
               cell(result, "kernels_per_step"), cell(result, "compiled_tokens_per_s"),
               cell(result, "compile_speedup", suffix="x"), cell(result, "compile_s", " s"),
               *(cell(result, f"decode_ms_b{b}_at_{p}") for p in positions for b in batches), sdpa]
        lines.append("| " + " | ".join(row) + " |")
    lines.append("")
    ddp, generate = report["cli"]["ddp_fit"], report["cli"]["generate"]
    processes = f" on {ddp['processes']} process(es)" if ddp.get("processes") else ""
    lines.append(f"* DDP fit, 2 steps{processes}: " + (f"passed in {ddp['seconds']:.0f} s" if ddp["ok"] else
                                                        f"**failed**: {ddp['error']}") + f" (`{ddp['command']}`)")
    lines.append("* bf16 generate: " + (f"passed in {generate['seconds']:.0f} s, {generate['text']!r}"
                                         if generate["ok"] else f"**failed**: {generate['error']}")
                 + f" (`{generate['command']}`)")
    errors = [(r["arch"], field, message) for r in report["results"] for field, message in r["errors"].items()]
    if errors:
        lines += ["", "Errors and gaps:", ""]
        lines += [f"* {arch} `{field}`: {message}" for arch, field, message in errors]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tiny", action="store_true",
                        help="tiny shapes, float32 on the CPU: the whole check in a minute")
    parser.add_argument("--archs", nargs="+", default=list(CATALOG), help="catalogue entries (default: all)")
    parser.add_argument("--budget_s", type=float, default=None,
                        help="seconds for the whole check (default 440, --tiny 300; a model may overrun its "
                             "share by 15 s); the models share what the CLI checks leave")
    parser.add_argument("--out", default="gpu_check", help="writes OUT.json and OUT.md")
    parser.add_argument("--compile_backend", default=None,
                        help="torch.compile backend (default inductor; --tiny eager)")
    parser.add_argument("--peak_flops", type=float, default=None,
                        help="FLOP/s of the device for MFU (default: a known GPU's dense bf16 peak)")
    parser.add_argument("--ddp_processes", type=int, default=2, help="--tiny: gloo processes of the DDP fit")
    parser.add_argument("--threads", type=int, default=None, help="torch's CPU threads in the worker")
    parser.add_argument("--commit", default=None, help="the commit to stamp (default: git's HEAD of this tree)")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--work_dir", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--deadline", type=float, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    unknown = [arch for arch in args.archs if arch not in CATALOG]
    if unknown:
        parser.error(f"unknown architecture(s) {', '.join(unknown)} (known: {', '.join(CATALOG)})")
    if args.worker:
        worker_main(args)
        return

    import torch

    started = time.time()
    budget = args.budget_s if args.budget_s is not None else (300.0 if args.tiny else 440.0)
    deadline = started + budget
    shape = Shape(args.tiny, args.compile_backend)
    if not args.tiny and not torch.cuda.is_available():
        print("gpu_check: torch sees no CUDA device; measuring on the CPU at the reference shape would take hours: "
              "run it on a GPU machine, or pass --tiny for the CPU check", file=sys.stderr)
        sys.exit(2)
    with tempfile.TemporaryDirectory(prefix="ltcx-gpu-check-") as folder:
        work = Path(folder)
        print("gpu_check: the DDP fit and bf16 generate through the CLI", flush=True)
        cli = cli_checks(args, work, deadline)
        for name, check in cli.items():
            print(f"gpu_check: {name}: " + ("passed" if check["ok"] else f"FAILED: {check['error']}"), flush=True)
        (work / "models").mkdir()
        results = run_models(args, shape, work / "models", deadline)
    first = next((r for r in results.values() if r.get("device_name")), {})
    meta = {
        "command": shlex.join(["python", "scripts/gpu_check.py", *(sys.argv[1:] if argv is None else argv)]),
        "commit": args.commit or commit_of_tree(),
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "device_name": first.get("device_name", "unknown"),
        "visible_gpus": torch.cuda.device_count(),
        "torch": torch.__version__, "cuda": torch.version.cuda, "cudnn": torch.backends.cudnn.version(),
        "python": platform.python_version(), "machine": platform.machine(),
        "peak_flops": first.get("peak_flops"), "peak_source": first.get("peak_source", "unknown"),
        "budget_s": budget, "seconds": time.time() - started,
        "shape": {"tiny": shape.tiny, "batch": shape.batch, "seq_len": shape.seq_len, "dtype": shape.dtype,
                  "vocab": TINY_VOCAB if shape.tiny else VOCAB, "decode_batches": list(shape.decode_batches),
                  "decode_positions": list(shape.decode_positions), "compile_backend": shape.compile_backend},
        "fields": shape.fields(),
    }
    for result in results.values():
        for key in ("deadline", "done", "phase", "phase_fields", "share_s", "device_name", "peak_flops",
                    "peak_source"):
            result.pop(key, None)
    report = {"meta": meta, "results": [results[arch] for arch in args.archs], "cli": cli}
    Path(f"{args.out}.json").write_text(json.dumps(report, indent=2))
    Path(f"{args.out}.md").write_text(markdown(report))
    print(markdown(report))
    print(f"gpu_check: wrote {args.out}.json and {args.out}.md in {meta['seconds']:.0f} s")
    failures = sum(len(r["errors"]) for r in report["results"]) + sum(not c["ok"] for c in cli.values())
    if failures:
        print(f"gpu_check: {failures} measurement(s) or check(s) failed: the report lists them", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()
