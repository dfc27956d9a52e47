"""Model FLOPs and the machine's limit: FLOPs per token of any backbone, and the peak FLOP/s that MFU divides by;
and the timing pieces the measurement scripts share (``scripts/benchmark.py``, ``scripts/gpu_check.py``): a synced
median timer, a training step through ltcx's loss, the state a decode step is timed from, peak memory, and the
number of device kernels one training step launches (``kernels_per_step``, counted at dispatch; ``device_kernels``,
as the profiler saw them launched).

MFU (model FLOPs utilisation) = tokens/s x training FLOPs per token / peak FLOP/s of the device.
"""

from __future__ import annotations

import functools
import resource
import statistics
import sys
import time
from collections import Counter
from contextlib import AbstractContextManager, nullcontext
from typing import Any, Callable, NamedTuple

import torch
import torch.nn as nn
from torch.utils._python_dispatch import TorchDispatchMode

# Dense bf16 tensor-core peaks (no sparsity), FLOP/s, from NVIDIA's data sheets; matched in this order against
# the lower-cased device name. Lightning's table lists some of these at their 2:4-sparsity figure.
GPU_BF16_PEAKS = (
    ("h200 nvl", 835e12),
    ("h200", 989e12),
    ("h100 nvl", 835e12),
    ("h100 pcie", 756e12),
    ("h100", 989e12),
    ("a100", 312e12),
    ("l40s", 362e12),
    ("l4", 121e12),
)


def model_flops_per_token(backbone: nn.Module, seq_len: int) -> float:
    """Training FLOPs per token: the backbone's ``flops_per_token(seq_len)``, or 6 N (N = its parameter count:
    2 FLOPs per weight per token forward, twice that backward) for a backbone that does not say."""
    if hasattr(backbone, "flops_per_token"):
        return float(backbone.flops_per_token(seq_len))
    return 6.0 * sum(p.numel() for p in backbone.parameters())


def loggers_write_now(trainer: Any) -> bool:
    """Whether Lightning's loggers write what this training batch logs: every ``trainer.log_every_n_steps`` optimizer
    steps and when training stops (Lightning's own test). The per-step metrics are logged on those batches only:
    a value logged in between is never written, and each ``self.log`` costs Python time in every step."""
    return trainer._logger_connector.should_update_logs


def best_rate(run: Callable[[], object], work: float, trials: int = 5, budget_s: float = 0.25,
              clock: Callable[[], float] = time.perf_counter) -> float:
    """The highest ``work / seconds`` over up to ``trials`` timed calls of ``run``, starting no new trial once
    ``budget_s`` seconds have gone by (one trial at least).

    The best trial, not the mean: on a shared machine another process can only slow a trial down, never speed
    it up, so the fastest trial is the closest to the machine's peak rate.
    """
    start = clock()
    best = 0.0
    for _ in range(max(1, trials)):
        before = clock()
        run()
        after = clock()
        if after > before:
            best = max(best, work / (after - before))
        if after - start >= budget_s:
            break
    if best == 0.0:
        raise RuntimeError("the clock did not advance during any trial")
    return best


@functools.lru_cache(maxsize=None)
def measured_matmul_flops(threads: int, size: int = 1024, trials: int = 5, budget_s: float = 0.25) -> float:
    """FLOP/s of a float32 ``size`` x ``size`` matmul on this CPU with ``threads`` threads: ``best_rate`` of up to
    ``trials`` products within ``budget_s`` seconds after one warm-up (2.1 GFLOP each, tens of ms on two cores:
    about 0.3 s in all). Cached per process and thread count."""
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        a, b = torch.randn(size, size), torch.randn(size, size)
        a @ b  # warm-up: thread pool, caches
        return best_rate(lambda: a @ b, 2.0 * size**3, trials, budget_s)
    finally:
        torch.set_num_threads(previous)


def gpu_bf16_peak(device: torch.device) -> float | None:
    """Dense bf16 peak FLOP/s of a known GPU, else Lightning's figure for it (None when unknown)."""
    name = torch.cuda.get_device_name(device).lower()
    for key, peak in GPU_BF16_PEAKS:
        if key in name:
            return peak
    from lightning.fabric.utilities.throughput import get_available_flops

    return get_available_flops(device, torch.bfloat16)


def default_peak_flops(device: torch.device) -> tuple[float | None, str]:
    """(peak FLOP/s of one device, where the figure comes from): a GPU's dense bf16 peak, a CPU's measured
    float32 matmul rate (the CPU has no published peak that a framework reaches)."""
    if device.type == "cuda":
        peak = gpu_bf16_peak(device)
        return peak, f"dense bf16 peak of {torch.cuda.get_device_name(device)}"
    if device.type == "cpu":
        threads = torch.get_num_threads()
        measured_on = f"{threads} CPU thread{'s' if threads != 1 else ''}"
        return measured_matmul_flops(threads), f"best of a few float32 1024^3 matmuls measured on {measured_on}"
    return None, f"no known peak for a {device.type} device"


# -- timing, shared by the measurement scripts ----------------------------------------------------------------


def sync(device: torch.device) -> None:
    """Wait for the device's queued work (CUDA runs asynchronously; a CPU needs nothing)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class Timing(NamedTuple):
    """Median seconds of a call: ``wall_s`` between two device syncs, ``cpu_s`` of this process's CPU time (all its
    threads: what other jobs on a shared machine change far less than the wall time)."""

    wall_s: float
    cpu_s: float


def timings(fn: Callable[[], object], device: torch.device, repeats: int, warmup: int = 1,
            budget_s: float | None = None) -> Timing:
    """Median wall and process CPU seconds of ``fn()`` over ``repeats`` runs after ``warmup`` runs, each between two
    device syncs; with ``budget_s``, no new run starts once that many seconds of timed runs have gone by (one run at
    least)."""
    for _ in range(warmup):
        fn()
    walls: list[float] = []
    cpus: list[float] = []
    for _ in range(max(1, repeats)):
        sync(device)
        start, cpu_start = time.perf_counter(), time.process_time()
        fn()
        sync(device)
        walls.append(time.perf_counter() - start)
        cpus.append(time.process_time() - cpu_start)
        if budget_s is not None and sum(walls) >= budget_s:
            break
    return Timing(statistics.median(walls), statistics.median(cpus))


def timed(fn: Callable[[], object], device: torch.device, repeats: int, warmup: int = 1,
          budget_s: float | None = None) -> float:
    """Median wall seconds of ``fn()``: ``timings(...).wall_s``."""
    return timings(fn, device, repeats, warmup, budget_s).wall_s


def loss_step(model: nn.Module, idx: torch.Tensor, optimizer: torch.optim.Optimizer,
              autocast: AbstractContextManager, path: str = "fused") -> Callable[[], None]:
    """One training step of ``model`` (an ``ltcx.lm.LanguageModel``) on idx [B, T + 1], as a function of no
    arguments: ``model.loss`` (the fused head where the backbone allows, as a fit trains; ``path`` "full": the full
    ``[B, T, V]`` logits and ``F.cross_entropy``, the path before the fused head), backward, the optimizer's step.
    ``autocast`` (entered around the forward and the loss at every step) is a context manager that can be re-entered,
    e.g. ``torch.autocast(...)`` or ``contextlib.nullcontext()``."""
    from ltcx.metrics import cross_entropy

    if path not in ("fused", "full"):
        raise ValueError(f"path ({path!r}) must be 'fused' or 'full'")

    def step() -> None:
        with autocast:
            if path == "fused":
                loss = model.loss(idx)
            else:
                loss = cross_entropy(model(idx[:, :-1])[0], idx[:, 1:])
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return step


def prefilled_state(backbone: nn.Module, batch: int, position: int, device: torch.device) -> tuple[torch.Tensor, Any]:
    """(token [batch, 1], the backbone's state after ``position`` tokens): what one cached decode step at that
    position is timed from (``backbone(token, state)``; the states are not updated in place, so the same step can
    be repeated). ``ValueError`` when the backbone's context (``max_seq_len``) holds no token after ``position``."""
    context = getattr(backbone, "max_seq_len", None)
    if context is not None and position >= context:
        raise ValueError(f"no decode step after {position} tokens within a context of {context}")
    token = torch.zeros(batch, 1, dtype=torch.long, device=device)
    return token, backbone(token.expand(-1, position).contiguous())[1]


def peak_memory_mb(device: torch.device) -> float:
    """CUDA: the most allocated on ``device`` since the last ``torch.cuda.reset_peak_memory_stats``; CPU: the
    process's peak RSS so far (cumulative over everything the process did)."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**10  # process peak RSS (Linux: KiB)


# -- kernels per training step --------------------------------------------------------------------------------

NO_KERNEL_OPS = frozenset({
    "_unsafe_view", "empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided", "resize_", "set_",
    "detach_", "_has_compatible_shallow_copy_type", "is_same_size", "sym_size", "sym_stride", "sym_numel",
    "sym_storage_offset", "record_stream", "_foreach_zero_grad"})
"""aten ops that dispatch but launch no device kernel although their schema is not a view's: allocation without
initialisation, shape metadata, and ``_unsafe_view`` (a view whose schema does not say so)."""


def launches_kernel(func: torch._ops.OpOverload) -> bool:
    """Whether aten op ``func`` launches a device kernel when it runs: not when it is a view or an alias (its schema
    returns an alias of an input without writing it: ``view``, ``t``, ``transpose``, ``expand``, ``as_strided``,
    ``slice``, ``select``, ``permute``, ``split``, ``unbind``, ``detach``, ``alias``, ``lift_fresh``, ...), nor when
    it is among ``NO_KERNEL_OPS``, nor when it neither returns a tensor nor writes one (``promote_types``,
``result_type``: host work). Everything else counts, one kernel per call: in-place ops, copies (``clone``,
    ``copy_``, ``_to_copy``, which only dispatches when the dtype or device changes), fills (``zeros``, ``fill_``),
    ``.item()`` (a copy to the host), and a fused or ``_foreach`` op as one (on CUDA it launches one kernel per
    group of tensors, so a few)."""
    if func.is_view or func.overloadpacket.__name__ in NO_KERNEL_OPS:
        return False
    schema = func._schema
    returns_tensor = any(isinstance(r.type, (torch.TensorType, torch.ListType, torch.OptionalType))
                         and "Tensor" in str(r.type) for r in schema.returns)
    # an op with no tensor out and none written (promote_types, result_type) computes on the host only
    return returns_tensor or schema.is_mutable or func.overloadpacket.__name__ == "_local_scalar_dense"


FUSED_BACKENDS = {"XLSTM": {"slstm_backend": "triton", "mlstm_backend": "triton"},
                  "Titans": {"memory_backend": "triton"}}
"""A backbone class's fused form: the config fields that choose its Triton kernels."""


class KernelCounter(TorchDispatchMode):
    """Counts, by op name, the aten ops dispatched inside it that ``launches_kernel`` (autograd's backward included:
    the mode follows the engine), and each Triton kernel launched inside it as one kernel, ``triton:<name>``: the
    launch (``JITFunction.run``, or ``InterpretedFunction.run`` under ``TRITON_INTERPRET=1``) is wrapped while the
    counter is active, and the aten ops that Triton's interpreter dispatches to run a kernel on the CPU are not
    counted (on a GPU the launch is one kernel). ``counts``: a Counter {op name: calls}; ``total``: their sum."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: Counter[str] = Counter()
        self._launching = 0  # depth of Triton launches under way
        self._unwrap: list[Callable[[], None]] = []

    def __enter__(self):
        for launcher in _triton_launchers():
            self._unwrap.append(self._wrap(launcher))
        return super().__enter__()

    def __exit__(self, *exc):
        try:
            return super().__exit__(*exc)
        finally:
            while self._unwrap:
                self._unwrap.pop()()

    def _wrap(self, cls: type) -> Callable[[], None]:
        run = cls.__dict__["run"]

        @functools.wraps(run)
        def counted(kernel, *args, **kwargs):
            if self._launching == 0 and not kwargs.get("warmup"):
                self.counts[f"triton:{getattr(kernel.fn, '__name__', 'kernel')}"] += 1
            self._launching += 1
            try:
                return run(kernel, *args, **kwargs)
            finally:
                self._launching -= 1

        cls.run = counted
        return lambda: setattr(cls, "run", run)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if self._launching == 0 and launches_kernel(func):
            self.counts[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))

    @property
    def total(self) -> int:
        return sum(self.counts.values())


def _triton_launchers() -> list[type]:
    """The classes whose ``run`` launches a Triton kernel, if Triton is loaded (this module never imports it)."""
    found = []
    for module, name in (("triton.runtime.jit", "JITFunction"), ("triton.runtime.interpreter", "InterpretedFunction")):
        cls = getattr(sys.modules.get(module), name, None)
        if cls is not None and "run" in cls.__dict__:
            found.append(cls)
    return found


def kernels_per_step(model: nn.Module, idx: torch.Tensor, optimizer: torch.optim.Optimizer | None = None,
                     autocast: AbstractContextManager | None = None) -> Counter[str]:
    """{aten op: calls} of the device kernels one training step of ``model`` (an ``ltcx.lm.LanguageModel``) on idx
    [B, T + 1] launches, eager: ``loss_step`` (``model.loss``, backward, the optimizer's step; ``optimizer``: the
    AdamW of ``model.configure_optimizers()`` by default), counted by ``KernelCounter`` on the second of two steps, so
    that the optimizer's lazily built state and a backbone's derived weights are not counted. Deterministic for a
    given model, shape and torch version; ``sum(...values())`` is the total."""
    if optimizer is None:
        configured = model.configure_optimizers()
        optimizer = configured["optimizer"] if isinstance(configured, dict) else configured
    step = loss_step(model, idx, optimizer, autocast if autocast is not None else nullcontext())
    step()
    with KernelCounter() as counter:
        step()
    return counter.counts


def device_kernels(run: Callable[[], object], device: torch.device) -> int:
    """What one call of ``run()`` launched, as the profiler saw it: on CUDA the device's events (kernels, Triton's
    and Inductor's included, copies and fills); on a CPU, which launches none, the aten ops at the top of the
    profile (an op called inside another is not counted again)."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    cuda = device.type == "cuda"
    with profile(activities=[ProfilerActivity.CPU, *([ProfilerActivity.CUDA] if cuda else [])]) as prof:
        run()
        sync(device)
    events = prof.events()
    if cuda:  # not the GPU-side copies of record_function ranges ("gpu_user_annotation"): no launch
        return sum(event.device_type == DeviceType.CUDA and "annotation" not in str(event.activity_type)
                   for event in events)

    def on_top(event) -> bool:
        parent = event.cpu_parent
        while parent is not None and not parent.name.startswith("aten::"):
            parent = parent.cpu_parent
        return parent is None

    return sum(event.name.startswith("aten::") and on_top(event) for event in events)
