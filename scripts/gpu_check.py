"""The GPU check, in one call under 10 minutes on one NVIDIA GPU: the fused Triton kernels against their torch forms,
then every catalogued architecture eager, compiled and fused; written as JSON and as Markdown for docs/benchmarks.md.

    python scripts/gpu_check.py                 # on a GPU machine: gpu_check.json and gpu_check.md
    python scripts/gpu_check.py --tiny          # the same code end to end on a CPU at tiny shapes (the tests run it)

1. Two checks through the CLI: a 2-step DDP fit (configs/gpt.yaml + configs/trainer/ddp.yaml, the built-in sample,
   every visible GPU) and a bf16 ``ltcx generate`` from its checkpoint.
2. The kernel checks (``KERNEL_CASES``): Titans' memory (``neural_memory_triton`` against ``neural_memory``) and the
   sLSTM scan (``slstm_scan_head_major_triton`` against ``slstm_scan_head_major``) at the 29M configs' shapes, 509
   tokens fed as 37 + 472 (no chunk divides either) with the state carried between the calls, and the mLSTM
   (``mlstm_parallel_triton`` against ``mlstm_parallel``, 509 tokens from the empty state): the largest absolute
   and relative differences of the outputs, the final state and every input's gradient, pass or fail against
   ``KERNEL_TOL``; float32, and bf16 where the torch form takes bf16. On CUDA also ``FLA_CASES``: Gated DeltaNet's
   and Mamba-2's ``backend: kernels`` (flash-linear-attention) against ltcx's chunked forms (``fla_case``).
3. Each catalogue entry (its configs/<arch>.yaml, vocabulary 50,304) at batch 24 x 512 under bf16 autocast, one
   training step (``LanguageModel.loss`` with its fused head, backward, AdamW: ``ltcx.throughput.loss_step``) in
   three forms: eager, compiled (as ``--model.compile true``) and fused (the Triton backend, ``FUSED_BACKENDS``;
   "n/a" without one). Per form: tokens/s, peak memory allocated, device kernels per step (``device_kernels``);
   eager and fused also ``ltcx.throughput.kernels_per_step``, eager MFU; the best form's tokens/s over the GPT's
   (target ``TARGET_VS_GPT``). Then eager: the peak memory through the full ``[B, T, V]`` logits, a cached decode
   step at batch 1 and 16 after 128 and 2,048 tokens, and the ``scaled_dot_product_attention`` kernel that ran.

Every measurement is guarded: one that fails records its first line and the rest go on. The kernel checks run in a
child process with a time limit; the models in a worker process, one after another, each with an equal share of
what is left of ``--budget_s``: a model still running past its share is stopped (its unmeasured figures say so) and
a new worker goes on (as after a CUDA error, which leaves a process's CUDA context unusable). The exit status is 1
when anything failed, after the report is written.

``--tiny``: the tiny shapes at batch 2 x 8, float32 on the CPU, a few steps, decode after 8 and 80 tokens (past the
tiny GPTs' context), ``torch.compile``'s ``eager`` backend, the kernels in Triton's interpreter (``TRITON_INTERPRET=1``
in the children's environment: Triton reads it on import; "skipped (no triton)" without Triton), device kernels
counted as the aten ops at the top of the profile, and the DDP fit with gloo on ``--ddp_processes`` processes.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import gc
import importlib.util
import json
import math
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
from ltcx.throughput import FUSED_BACKENDS  # noqa: E402

VOCAB = 50304  # the GPT-2 vocabulary padded to a multiple of 64, as the data module pads it
TINY_VOCAB = 512
GRACE_S = 15.0  # past a model's share before its worker is stopped (a measurement may end just after)
PROMPT = "Once upon a time"
TARGET_VS_GPT = 0.7  # the training tokens/s every architecture should reach, as a share of the GPT's
KERNEL_TOL = {"float32": 1e-4, "bf16": 1e-2}
"""max |fused - torch| / max |torch| of every output, state and gradient: float32 over a 512-step recurrence in
another order of operations; bf16 outputs differ by their last bit (both forms compute in float32 inside)."""
KERNEL_CASES = (("titans_memory", "float32"), ("titans_memory", "bf16"), ("slstm_scan", "float32"),
                ("slstm_scan", "bf16"), ("mlstm", "float32"), ("mlstm", "bf16"))
FORMS = ("eager", "compiled", "fused")


def triton_installed() -> bool:
    return importlib.util.find_spec("triton") is not None


class Shape:
    """What one mode measures: the training batch, the decode points, repeats and the compile backend."""

    def __init__(self, tiny: bool, compile_backend: str | None):
        self.tiny = tiny
        self.batch, self.seq_len = (2, 8) if tiny else (24, 512)
        self.dtype = "float32" if tiny else "bf16"
        self.decode_batches = (1, 2) if tiny else (1, 16)
        self.decode_positions = (8, 80) if tiny else (128, 2048)
        self.train_warmup, self.train_repeats, self.train_budget_s = (1, 2, 5.0) if tiny else (2, 10, 3.0)
        self.decode_warmup, self.decode_repeats = (1, 3) if tiny else (3, 20)
        self.compile_backend = compile_backend or ("eager" if tiny else "inductor")

    def decode_fields(self) -> list[str]:
        return [f"decode_ms_b{b}_at_{p}" for p in self.decode_positions for b in self.decode_batches]

    def fields(self) -> list[str]:
        """Every figure of one model, in the tables' order."""
        return ["params", "context", *(f"{form}_{figure}" for form in FORMS
                                       for figure in ("tokens_per_s", "peak_memory_mb", "device_kernels")),
                "eager_kernels_per_step", "fused_kernels_per_step", "mfu", "compile_s", "peak_memory_full_logits_mb",
                *self.decode_fields(), "sdpa_train", "sdpa_decode"]


# -- the kernel checks: each fused kernel against its torch form -------------------------------------------------


def objective(tensors):
    """A loss that reads every tensor: fixed random weights (float32, seeded) on each."""
    import torch

    g = torch.Generator().manual_seed(1)
    return sum((x.float() * torch.randn(x.shape, generator=g).to(x.device)).sum() for x in tensors)


def titans_memory_case(tiny: bool, device, dtype):
    """(run(memory_fn) -> (outputs, gradients), shape): the memory of configs/titans_*.yaml (6 heads, keys 64, hidden
    128, chunks of 16) over 509 tokens fed as 37 + 472, so that the second call starts mid-chunk from a carried
    state; the gradients of q, k, v, the gates and M_0 flow through it."""
    import torch
    import torch.nn.functional as F

    from ltcx.ops.titans import initial_memory_state

    B, H, dk, dm, chunk, pieces = (2, 2, 8, 16, 4, (3, 8)) if tiny else (24, 6, 64, 128, 16, (37, 472))
    T, g = sum(pieces), torch.Generator().manual_seed(0)
    q, k = (F.normalize(torch.randn(B, H, T, dk, generator=g), dim=-1) for _ in range(2))
    v = torch.randn(B, H, T, dk, generator=g)
    retain, momentum, rate = (torch.randn(B, H, T, generator=g) for _ in range(3))
    step = torch.sigmoid(rate) * torch.sigmoid(-momentum) / chunk
    w1, w2 = torch.randn(H, dm, dk, generator=g) / dk**0.5, torch.randn(H, dk, dm, generator=g) / dm**0.5
    gates = F.logsigmoid(3.0 - retain), F.logsigmoid(momentum), step
    inputs = [x.to(device, dtype) for x in (q, k, v, *gates, w1, w2)]

    def run(memory_fn):
        leaves = [x.clone().requires_grad_() for x in inputs]
        state, ys, position = initial_memory_state(leaves[6], leaves[7], B), [], 0
        for n in pieces:
            part = (x[:, :, position:position + n] for x in leaves[:6])
            y, state = memory_fn(*part, state, position, chunk, True)
            ys.append(y)
            position += n
        outputs = [torch.cat(ys, dim=2), *state]
        return outputs, torch.autograd.grad(objective(outputs), leaves)

    return run, f"B {B}, heads {H}, keys {dk}, hidden {dm}, chunk {chunk}, T {' + '.join(map(str, pieces))}"


def slstm_scan_case(tiny: bool, device, dtype):
    """(run(scan) -> (outputs, gradients), shape): the scan of configs/xlstm.yaml's sLSTM block (4 heads of 101) over
    509 steps fed as 37 + 472, from a given state carried between the calls; steps in ``dtype`` (bf16: as a block
    would hand them), the recurrent maps and the state float32."""
    import torch

    T1, T2, H, B, Dh = (3, 4, 2, 2, 5) if tiny else (37, 472, 4, 24, 101)
    g = torch.Generator().manual_seed(0)
    steps = torch.randn(T1 + T2, H, B, 4 * Dh, generator=g)
    steps[..., Dh:2 * Dh] += 2.0  # forget gates mostly open, as the block's biases start
    R = 0.5 * torch.randn(4, H, Dh, Dh, generator=g) / Dh**0.5
    c, h, m = (torch.randn(B, H, Dh, generator=g) for _ in range(3))
    n = 1.0 + torch.rand(B, H, Dh, generator=g)  # n >= 1, as a scan leaves it
    inputs = [steps.to(device, dtype), *(x.to(device) for x in (R, c, n, h, m))]

    def run(scan):
        leaves = [x.clone().requires_grad_() for x in inputs]
        first, state = scan(leaves[0][:T1], leaves[1], tuple(leaves[2:]))
        second, state = scan(leaves[0][T1:], leaves[1], state)
        outputs = [torch.cat([first, second]), *state]
        grads = torch.autograd.grad(objective(outputs), leaves, allow_unused=True)
        return outputs, [torch.zeros_like(x) if d is None else d for x, d in zip(leaves, grads)]

    return run, f"B {B}, heads {H} x {Dh}, T {T1} + {T2}"


def mlstm_case(tiny: bool, device, dtype):
    """(run(form) -> (outputs, gradients), shape): the mLSTM of configs/xlstm.yaml's blocks (4 heads of 208) over 509
    tokens from the empty state, as training runs it; q, k, v in ``dtype`` (bf16: as a block hands them under
    autocast), the gates float32; the gradients of every input."""
    import torch

    B, H, T, D = (2, 2, 11, 5) if tiny else (24, 4, 509, 208)
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(B, H, T, D, generator=g).to(device, dtype) for _ in range(3))
    i_pre = torch.randn(B, H, T, generator=g).to(device)
    f_pre = (torch.randn(B, H, T, generator=g) + 3.0).to(device)  # forget gates mostly open, as the biases start

    def run(form):
        leaves = [x.clone().requires_grad_() for x in (q, k, v, i_pre, f_pre)]
        h = form(*leaves)
        return [h], torch.autograd.grad(objective([h]), leaves)

    return run, f"B {B}, heads {H} x {D}, T {T}"


def differences(got, want) -> tuple[float, float]:
    """(max |got - want|, the same over max |want|) of the worst tensor of the two lists; inf for a non-finite one."""
    worst_abs = worst_rel = 0.0
    for a, e in zip(got, want):
        error = (a.float() - e.float()).abs().max().item()
        scale = e.float().abs().max().item()
        if not math.isfinite(error) or not math.isfinite(scale):
            return math.inf, math.inf
        worst_abs, worst_rel = max(worst_abs, error), max(worst_rel, error / max(scale, 1e-30))
    return worst_abs, worst_rel


def check_kernel(kernel: str, dtype_name: str, tiny: bool, device) -> dict:
    """One row of the kernel checks: the fused form and the torch form on the same inputs."""
    import torch

    row = {"kernel": kernel, "dtype": dtype_name, "tol": KERNEL_TOL[dtype_name]}
    if kernel == "titans_memory":
        if dtype_name == "bf16":
            return {**row, "status": "n/a (the memory runs in float32 under bf16 autocast)", "ok": True}
        from ltcx.ops.titans import neural_memory
        from ltcx.ops.titans_triton import neural_memory_triton as fused
        case, reference = titans_memory_case, neural_memory
    elif kernel == "mlstm":
        from ltcx.ops.mlstm import mlstm_parallel
        from ltcx.ops.mlstm_triton import mlstm_parallel_triton as fused

        def reference(*inputs):
            return mlstm_parallel(*inputs, with_state=False)[0]
        case = mlstm_case
    else:
        from ltcx.ops.slstm import slstm_scan_head_major as reference
        from ltcx.ops.slstm_triton import slstm_scan_head_major_triton as fused
        case = slstm_scan_case
    run, row["shape"] = case(tiny, device, torch.bfloat16 if dtype_name == "bf16" else torch.float32)
    (values, grads), (values_ref, grads_ref) = run(fused), run(reference)
    row["values_max_abs"], row["values_max_rel"] = differences(values, values_ref)
    row["grads_max_abs"], row["grads_max_rel"] = differences(grads, grads_ref)
    row["ok"] = max(row["values_max_rel"], row["grads_max_rel"]) <= row["tol"]
    row["status"] = "passed" if row["ok"] else "FAILED"
    return row


# -- flash-linear-attention's kernels (``backend: kernels``) against ltcx's chunked forms, on CUDA only: fla's kernels
# do not run in Triton's interpreter (tests/test_gated_deltanet.py and tests/test_mamba2.py check the bridge on a CPU)

FLA_CASES = (("gated_delta_fla", "float32"), ("gated_delta_fla", "bf16"), ("ssd_fla", "float32"), ("ssd_fla", "bf16"))


def kernel_cases(tiny: bool) -> tuple:
    return KERNEL_CASES if tiny else KERNEL_CASES + FLA_CASES


def fla_case(kernel: str, device, dtype):
    """(run(form) -> (outputs, gradients), shape): configs/gated_deltanet.yaml's rule (6 heads, keys 48, values 96)
    or configs/mamba2.yaml's SSD (12 heads of 64, state 64) over 509 tokens fed as 37 + 472 from a given state carried
    between the calls; the projected inputs in ``dtype`` (as a block hands them under autocast), gates and state
    float32; the gradients of every input."""
    import torch
    import torch.nn.functional as F

    B, pieces, g = 24, (37, 472), torch.Generator().manual_seed(0)
    T = sum(pieces)
    if kernel == "gated_delta_fla":
        H, dk, dv = 6, 48, 96
        q, k = (F.normalize(torch.randn(B, H, T, dk, generator=g), dim=-1) for _ in range(2))
        inputs = [q.to(device, dtype), k.to(device, dtype), torch.randn(B, H, T, dv, generator=g).to(device, dtype),
                  (-F.softplus(torch.randn(B, H, T, generator=g)) / 4).to(device),
                  torch.rand(B, H, T, generator=g).to(device), torch.randn(B, H, dk, dv, generator=g).to(device)]
        time_dims, shape = (2, 2, 2, 2, 2), f"B {B}, heads {H}, keys {dk}, values {dv}"
    else:
        H, P, N = 12, 64, 64
        inputs = [torch.randn(B, H, T, P, generator=g).to(device, dtype),
                  (F.softplus(torch.randn(B, H, T, generator=g) - 3)).to(device),
                  (-torch.rand(H, generator=g) * 8).to(device),
                  *(torch.randn(B, T, N, generator=g).to(device, dtype) for _ in range(2)),
                  torch.randn(B, H, P, N, generator=g).to(device)]
        time_dims, shape = (2, 2, None, 1, 1), f"B {B}, heads {H} x {P}, state {N}"  # x, dt, A, B, C

    def run(form):
        leaves = [x.clone().requires_grad_() for x in inputs]
        state, outs, position = leaves[-1], [], 0
        for n in pieces:
            part = [x if dim is None else x.narrow(dim, position, n) for x, dim in zip(leaves, time_dims)]
            out, state = form(*part, state)
            outs.append(out)
            position += n
        outputs = [torch.cat(outs, dim=2), state]
        return outputs, torch.autograd.grad(objective(outputs), leaves)

    return run, f"{shape}, T {' + '.join(map(str, pieces))}"


def check_fla_kernel(kernel: str, dtype_name: str, tiny: bool, device) -> dict:
    """One row of the fla checks: ``ltcx/ops/fla_kernels.py``'s form and ltcx's chunked form on the same inputs."""
    import torch

    from ltcx.ops import fla_kernels
    from ltcx.ops.gated_delta import gated_delta_chunked
    from ltcx.ops.ssd import ssd_chunked

    row = {"kernel": kernel, "dtype": dtype_name, "tol": KERNEL_TOL[dtype_name]}
    if fla_kernels.kernels_unavailable() is not None:
        return {**row, "ok": True, "status": f"skipped ({fla_kernels.kernels_unavailable()})"}
    fused, reference = ((fla_kernels.gated_delta_fla, gated_delta_chunked) if kernel == "gated_delta_fla"
                        else (fla_kernels.ssd_fla, ssd_chunked))
    run, row["shape"] = fla_case(kernel, device, torch.bfloat16 if dtype_name == "bf16" else torch.float32)
    (values, grads), (values_ref, grads_ref) = run(fused), run(reference)
    row["values_max_abs"], row["values_max_rel"] = differences(values, values_ref)
    row["grads_max_abs"], row["grads_max_rel"] = differences(grads, grads_ref)
    row["ok"] = max(row["values_max_rel"], row["grads_max_rel"]) <= row["tol"]
    row["status"] = "passed" if row["ok"] else "FAILED"
    return row


def kernel_checks_main(args) -> None:
    """``--kernel_checks``: every row of ``KERNEL_CASES`` into ``<work_dir>/kernels.json``, rewritten after each."""
    import torch

    device = torch.device("cuda" if torch.cuda.is_available() and not args.tiny else "cpu")
    if args.threads:
        torch.set_num_threads(args.threads)
    path, rows = Path(args.work_dir) / "kernels.json", []
    for kernel, dtype_name in kernel_cases(args.tiny):
        try:
            check = check_fla_kernel if (kernel, dtype_name) in FLA_CASES else check_kernel
            rows.append(check(kernel, dtype_name, args.tiny, device))
        except Exception as error:  # noqa: BLE001 - a failing check is a result, the next one goes on
            traceback.print_exc()
            rows.append({"kernel": kernel, "dtype": dtype_name, "ok": False, "status": f"error: {first_line(error)}"})
            if "CUDA error" in str(error):  # this process's CUDA context is unusable: the rest are not run
                break
        finally:
            gc.collect()
        path.with_suffix(".tmp").write_text(json.dumps(rows, indent=1))
        os.replace(path.with_suffix(".tmp"), path)


def run_kernel_checks(args, work: Path, deadline: float) -> list[dict]:
    """The rows of the kernel checks, run by a child (interpreted with --tiny); a row it did not reach says why."""
    if not triton_installed():
        return [{"kernel": k, "dtype": d, "ok": True, "status": "skipped (no triton)"}
                for k, d in kernel_cases(args.tiny)]
    command = [sys.executable, str(Path(__file__).resolve()), "--kernel_checks", "--work_dir", str(work),
               *(["--tiny"] if args.tiny else []), *(["--threads", str(args.threads)] if args.threads else [])]
    limit = min(300.0 if args.tiny else 120.0, deadline - time.time())
    rows, error = [], "the time budget (--budget_s) was spent"
    if limit >= 1.0:
        _, _, error = run_child(command, work, limit, child_environment(args.tiny))
        rows = read_json(work / "kernels.json") or []
    reason = error or "the check ended before it"
    return rows + [{"kernel": k, "dtype": d, "ok": False, "status": f"not run: {reason}"}
                   for k, d in kernel_cases(args.tiny)[len(rows):]]


def child_environment(tiny: bool) -> dict:
    """The environment of the children: Triton's interpreter for --tiny (read when Triton is imported)."""
    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    return {**os.environ, "PYTHONPATH": path, **({"TRITON_INTERPRET": "1"} if tiny else {})}


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


def build(arch: str, shape: Shape, **overrides):
    """The backbone of ``arch`` (its tiny shape with --tiny, else its YAML's), seeded, with ``overrides``."""
    import torch

    torch.manual_seed(0)
    if shape.tiny:
        return CATALOG[arch].build_tiny(TINY_VOCAB, **overrides)
    spec = arch + (":" + ",".join(f"{key}={value}" for key, value in overrides.items()) if overrides else "")
    # min_context: the GPT family's null block_size is the data's length in a fit, here the reference 512
    return build_configured(spec, VOCAB, min_context=shape.seq_len)


def measure_training(record: Recorder, form: str, trained, idx, device, autocast, shape: Shape) -> None:
    """``<form>_tokens_per_s``, ``<form>_peak_memory_mb`` and ``<form>_device_kernels`` of ``trained``'s step (an
    ``ltcx.lm.LanguageModel``; ``compile_s`` too when it compiles, ``<form>_kernels_per_step`` unless it does)."""
    import torch

    from ltcx.throughput import device_kernels, kernels_per_step, loss_step, peak_memory_mb, sync, timed

    optimizer = trained.configure_optimizers()["optimizer"]
    step = loss_step(trained, idx, optimizer, autocast)
    with record.measuring(f"train {form}", f"{form}_tokens_per_s", f"{form}_peak_memory_mb",
                          *(["compile_s"] if form == "compiled" else [])):
        trained.train()
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        sync(device)
        start = time.perf_counter()
        step()  # the first step: a compiled one compiles its forward and backward here
        sync(device)
        if form == "compiled":
            record.set(compile_s=time.perf_counter() - start)
        seconds = timed(step, device, shape.train_repeats, shape.train_warmup, shape.train_budget_s)
        record.set(**{f"{form}_tokens_per_s": idx[:, 1:].numel() / seconds,
                      f"{form}_peak_memory_mb": peak_memory_mb(device)})
    with record.measuring(f"kernels {form}", f"{form}_device_kernels"):
        record.set(**{f"{form}_device_kernels": device_kernels(step, device)})
    if form != "compiled":  # the aten ops of the eager step, views left out
        with record.measuring(f"aten kernels {form}", f"{form}_kernels_per_step"):
            record.set(**{f"{form}_kernels_per_step": sum(kernels_per_step(trained, idx, optimizer,
                                                                           autocast).values())})
    del optimizer, step
    release_memory()


def compiled_model(arch: str, shape: Shape, model, device):
    """A LanguageModel of a copy of ``model`` compiled as a fit with ``--model.compile true`` compiles it (in place:
    hence the copy), with torch.compile's default backend (Inductor) or ``shape.compile_backend``."""
    import torch

    from ltcx.lm import LanguageModel

    copy = build(arch, shape).to(device)
    copy.load_state_dict(model.state_dict())
    trained = LanguageModel(copy, decay_steps=1, compile=True)
    with mock.patch.object(torch, "compile", functools.partial(torch.compile, backend=shape.compile_backend)):
        trained.configure_model()
    return trained


def measure_model(arch: str, shape: Shape, device, peak: tuple, record: Recorder) -> None:
    """Every figure of ``arch`` into ``record``, each measurement guarded: the training forms first, then the rest."""
    import torch

    from ltcx.lm import LanguageModel
    from ltcx.throughput import loss_step, model_flops_per_token, peak_memory_mb, sync, timed

    autocast = torch.autocast(device.type, dtype=torch.bfloat16) if shape.dtype == "bf16" else nullcontext()
    model = None
    with record.measuring("build", "params", "context"):
        model = build(arch, shape).to(device)
        record.set(params=model.parameter_count(), context=model.max_seq_len)
    if model is None:
        for field in shape.fields():
            record.result["errors"].setdefault(field, "not measured: the model could not be built")
            record.result.setdefault(field, None)
        return
    vocab = TINY_VOCAB if shape.tiny else VOCAB
    idx = torch.randint(0, vocab, (shape.batch, shape.seq_len + 1), device=device)

    # as a fit trains it (the schedule's end does not change a step)
    measure_training(record, "eager", LanguageModel(model, decay_steps=1), idx, device, autocast, shape)
    eager = record.result.get("eager_tokens_per_s")
    with record.measuring("mfu", "mfu"):
        if peak[0] is None:
            raise RuntimeError(f"no known peak FLOP/s for this device ({peak[1]}): pass --peak_flops")
        if eager is None:
            raise RuntimeError("no eager tokens/s to compute it from")
        record.set(mfu=eager * model_flops_per_token(model, shape.seq_len) / peak[0])

    backends = FUSED_BACKENDS.get(type(model).__name__)
    if backends is None or not triton_installed():
        why = "n/a (no fused form)" if backends is None else "skipped (no triton)"
        record.set(**{f"fused_{figure}": why for figure in ("tokens_per_s", "peak_memory_mb", "device_kernels",
                                                             "kernels_per_step")})
    else:
        fused = None
        with record.measuring("build fused", "fused_tokens_per_s", "fused_peak_memory_mb", "fused_device_kernels",
                              "fused_kernels_per_step"):
            fused = build(arch, shape, **backends).to(device)
            fused.load_state_dict(model.state_dict())
        if fused is not None:
            measure_training(record, "fused", LanguageModel(fused, decay_steps=1), idx, device, autocast, shape)
        del fused

    torch._dynamo.reset()
    compiled = None
    with record.measuring("compile", "compiled_tokens_per_s", "compiled_peak_memory_mb", "compiled_device_kernels",
                          "compile_s"):
        compiled = compiled_model(arch, shape, model, device)
    if compiled is not None:
        measure_training(record, "compiled", compiled, idx, device, autocast, shape)
    compiled = None
    torch._dynamo.reset()
    release_memory()

    trained = LanguageModel(model, decay_steps=1)
    with record.measuring("train with full logits", "peak_memory_full_logits_mb"):
        # the peak before the fused head: the [B, T, V] logits, their float32 copy and F.cross_entropy
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        full = loss_step(trained, idx, trained.configure_optimizers()["optimizer"], autocast, path="full")
        for _ in range(2):
            full()
        sync(device)
        record.set(peak_memory_full_logits_mb=peak_memory_mb(device))
        del full, trained
        release_memory()

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


def worker_main(args) -> None:
    """``--worker``: measure ``args.archs`` in turn, each within an equal share of the time to ``args.deadline``."""
    import torch

    from ltcx.throughput import default_peak_flops

    shape = Shape(args.tiny, args.compile_backend)
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.set_flush_denormal(True)  # CPU: products of tiny decay factors reach slow float32 denormals
    device = torch.device("cuda" if torch.cuda.is_available() and not args.tiny else "cpu")
    peak = (args.peak_flops, "--peak_flops") if args.peak_flops is not None else default_peak_flops(device)
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
                            ("--peak_flops", args.peak_flops), ("--tiny", args.tiny or None)):
            command += [] if value is None else [flag] if value is True else [flag, str(value)]
        # its own group, stopped with its children; Triton's interpreter for --tiny's fused forms
        worker = subprocess.Popen(command, start_new_session=True, env=child_environment(args.tiny))
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


def run_child(command: list[str], cwd: Path, timeout: float, environment: dict
              ) -> tuple[subprocess.CompletedProcess | None, float, str]:
    """(the finished process or None, seconds, an error line or "") of ``command``; at ``timeout`` its whole process
    group (DDP's other ranks, compile workers) is stopped."""
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


def run_cli(command: list[str], cwd: Path, timeout: float) -> tuple[subprocess.CompletedProcess | None, float, str]:
    """``run_child`` of ``python run.py ...`` offline."""
    return run_child(command, cwd, timeout, {**child_environment(False), "HF_HUB_OFFLINE": "1",
                                             "HF_DATASETS_OFFLINE": "1"})


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


def against_gpt(results: dict[str, dict]) -> None:
    """Each result's ``best_form`` (its fastest training form) and ``vs_gpt``: that form's tokens/s over the GPT's
    best form's."""
    def best(result: dict) -> tuple[str | None, float | None]:
        figures = [(result.get(f"{form}_tokens_per_s"), form) for form in FORMS]
        figures = [(value, form) for value, form in figures if isinstance(value, float)]
        return max(figures)[::-1] if figures else (None, None)

    _, gpt = best(results["gpt"]) if "gpt" in results else (None, None)
    for result in results.values():
        result["best_form"], tokens_per_s = best(result)
        if "gpt" not in results:
            result["vs_gpt"] = "n/a (gpt not in --archs)"
        elif tokens_per_s is None or gpt is None:
            result["vs_gpt"] = None
            result["errors"].setdefault("vs_gpt", "no training tokens/s " + ("of the GPT" if gpt is None else ""))
        else:
            result["vs_gpt"] = tokens_per_s / gpt
        if result["best_form"] is None:
            result["errors"].setdefault("best_form", "no training form was measured")


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


def table(head: list[str], rows: list[list[str]]) -> list[str]:
    return ["| " + " | ".join(head) + " |", "|---|" + "---:|" * (len(head) - 1),
            *("| " + " | ".join(row) + " |" for row in rows), ""]


def markdown(report: dict) -> str:
    """The report as Markdown: a stamp line, the kernel checks, the training forms, decode and the rest, the CLI
    checks, every error."""
    meta, shape = report["meta"], report["meta"]["shape"]
    positions, batches = shape["decode_positions"], shape["decode_batches"]
    lines = [
        f"**GPU check: {meta['device_name']}** ({meta['visible_gpus']} visible), {meta['date']}, commit "
        f"{meta['commit']}, torch {meta['torch']} (CUDA {meta['cuda']}, cuDNN {meta['cudnn']}), Python "
        f"{meta['python']}; {meta['seconds']:.0f} s in all (budget {meta['budget_s']:.0f} s):",
        "",
        f"    {meta['command']}",
        "",
        "Fused kernels against their torch forms, two calls with the state carried: the largest difference of the "
        "outputs and final state (values) and of every input's gradient, absolute and relative to the torch form's "
        "largest magnitude.",
        "",
    ]
    lines += table(["kernel", "dtype", "shape", "values abs / rel", "gradients abs / rel", "tolerance", "result"], [
        [row["kernel"], row["dtype"], row.get("shape", "-"),
         *(f"{row[f'{what}_max_abs']:.2e} / {row[f'{what}_max_rel']:.2e}" if f"{what}_max_abs" in row else "-"
           for what in ("values", "grads")), f"{row['tol']:.0e}" if "tol" in row else "-", row["status"]]
        for row in report["kernels"]])
    lines += [
        f"Training, batch {shape['batch']} x {shape['seq_len']}, {shape['dtype']}"
        f"{' autocast (bf16-mixed)' if shape['dtype'] == 'bf16' else ''}, vocabulary {shape['vocab']:,}: "
        "`LanguageModel.loss` (the fused head) + backward + AdamW, as a fit trains; eager / compiled (`torch.compile` "
        f"({shape['compile_backend']}), as `--model.compile true`) / fused (the Triton backend); best vs GPT = the "
        f"fastest form's tokens/s over the GPT's fastest (target {TARGET_VS_GPT}x); device kernels = what the "
        "profiler saw one step launch; aten kernels = `ltcx.throughput.kernels_per_step` (a Triton launch counts one); "
        f"MFU (eager) against {meta['peak_flops'] or 0:.3g} FLOP/s ({meta['peak_source']}).",
        "",
    ]
    slash = " / ".join
    lines += table(["model", "parameters", "tokens/s eager / compiled / fused", "best vs GPT", "MFU",
                    "peak memory eager / compiled / fused", "device kernels eager / compiled / fused",
                    "aten kernels eager / fused", "compile time"], [
        [r["arch"], cell(r, "params"), slash(cell(r, f"{form}_tokens_per_s") for form in FORMS),
         cell(r, "vs_gpt", suffix="x") + (f" ({r['best_form']})" if r.get("best_form") else ""), cell(r, "mfu"),
         slash(cell(r, f"{form}_peak_memory_mb", " MiB") for form in FORMS),
         slash(cell(r, f"{form}_device_kernels") for form in FORMS),
         slash(cell(r, f"{form}_kernels_per_step") for form in ("eager", "fused")), cell(r, "compile_s", " s")]
        for r in report["results"]])
    lines += ["Eager: the peak memory of the step through the full [B, T, V] logits and `F.cross_entropy`; one "
              "cached decode step, ms, at batch b after p tokens; SDPA = the kernel that ran (profiler), training "
              "forward / decode step.", ""]
    lines += table(["model", "peak, full logits", *(f"decode b{b} @{p} (ms)" for p in positions for b in batches),
                    "SDPA"], [
        [r["arch"], cell(r, "peak_memory_full_logits_mb", " MiB"),
         *(cell(r, f"decode_ms_b{b}_at_{p}") for p in positions for b in batches),
         f"{cell(r, 'sdpa_train')} / {cell(r, 'sdpa_decode')}"] for r in report["results"]])
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
                        help="seconds for the whole check (default 520, --tiny 400; a model may overrun its "
                             "share by 15 s); the models share what the CLI and kernel checks leave")
    parser.add_argument("--out", default="gpu_check", help="writes OUT.json and OUT.md")
    parser.add_argument("--compile_backend", default=None,
                        help="torch.compile backend (default inductor; --tiny eager)")
    parser.add_argument("--peak_flops", type=float, default=None,
                        help="FLOP/s of the device for MFU (default: a known GPU's dense bf16 peak)")
    parser.add_argument("--ddp_processes", type=int, default=2, help="--tiny: gloo processes of the DDP fit")
    parser.add_argument("--threads", type=int, default=None, help="torch's CPU threads in the worker")
    parser.add_argument("--commit", default=None, help="the commit to stamp (default: git's HEAD of this tree)")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--kernel_checks", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--work_dir", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--deadline", type=float, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    unknown = [arch for arch in args.archs if arch not in CATALOG]
    if unknown:
        parser.error(f"unknown architecture(s) {', '.join(unknown)} (known: {', '.join(CATALOG)})")
    if args.worker or args.kernel_checks:
        (worker_main if args.worker else kernel_checks_main)(args)
        return

    import torch

    started = time.time()
    budget = args.budget_s if args.budget_s is not None else (400.0 if args.tiny else 520.0)
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
        print("gpu_check: the fused kernels against their torch forms", flush=True)
        kernels = run_kernel_checks(args, work, deadline)
        for row in kernels:
            print(f"gpu_check: {row['kernel']} {row['dtype']}: {row['status']}", flush=True)
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
        "fields": [*shape.fields(), "best_form", "vs_gpt"], "kernel_tol": KERNEL_TOL, "target_vs_gpt": TARGET_VS_GPT,
    }
    for result in results.values():
        for key in ("deadline", "done", "phase", "phase_fields", "share_s", "device_name", "peak_flops",
                    "peak_source"):
            result.pop(key, None)
    against_gpt(results)
    report = {"meta": meta, "kernels": kernels, "results": [results[arch] for arch in args.archs], "cli": cli}
    Path(f"{args.out}.json").write_text(json.dumps(report, indent=2))
    Path(f"{args.out}.md").write_text(markdown(report))
    print(markdown(report))
    print(f"gpu_check: wrote {args.out}.json and {args.out}.md in {meta['seconds']:.0f} s")
    failures = (sum(len(r["errors"]) for r in report["results"]) + sum(not c["ok"] for c in cli.values())
                + sum(not row["ok"] for row in kernels))
    if failures:
        print(f"gpu_check: {failures} measurement(s) or check(s) failed: the report lists them", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()
