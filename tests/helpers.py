"""Helpers shared by several test modules (imported as ``from helpers import ...``, like ``fault_injection``):
relative errors of tensors against a reference, seeded mLSTM inputs, the checks that Gated DeltaNet and Mamba-2
share (a chunked rule's input gradients, a left-padded batch, the FLOPs formula, the kernels backend off CUDA),
Triton kernel tests in an interpreted child process, documents of a fixed byte length, feeding a backbone in pieces,
a small text corpus, TensorBoard events and a generation check for CLI runs, the arguments of a tiny `ltcx fit` run
(in process, as a `run.py` subprocess, or as 2 gloo processes under DDP or FSDP2), the facts of an error message,
one-line user errors and small checkpoints written without training. Fixtures live in conftest.py; no test module
imports another."""

from __future__ import annotations

import importlib
import os
import random
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
REL_TOL = 1e-12  # float64 agreement, relative to the largest magnitude of the compared tensors


def copy_tracked_files(destination: Path) -> Path:
    """A copy of the project as git tracks it (the working tree's files, no .git, no .venv) at ``destination``."""
    import shutil

    names = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout.split(b"\0")
    for name in filter(None, (n.decode() for n in names)):
        if (ROOT / name).is_file():
            (destination / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, destination / name)
    return destination


INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
"""Whether this process runs Triton kernels in the interpreter (a child of ``assert_passes_interpreted``)."""


def interpreted_module(name: str):
    """The kernel module ``name`` (``ltcx.ops.*_triton``) with its kernels interpreted, for a module-scoped fixture:
    Triton decorates its library at import, so outside a process started with TRITON_INTERPRET=1 the test is
    skipped and runs in the child of ``assert_passes_interpreted``."""
    if not INTERPRETED:
        pytest.skip("runs under TRITON_INTERPRET=1, in test_kernels_under_the_interpreter's child")
    pytest.importorskip("triton")
    return importlib.import_module(name)


def assert_passes_interpreted(test_file: str) -> None:
    """Every test of ``test_file`` that needs ``interpreted_module``, in a child pytest started with
    TRITON_INTERPRET=1; asserts that it passed."""
    if INTERPRETED:
        pytest.skip("this process is the interpreted run")
    pytest.importorskip("triton")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:xdist", "-p", "no:cacheprovider", test_file],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stdout[-6000:] + run.stderr[-2000:]
    assert " passed" in run.stdout and "skipped" in run.stdout  # the caller itself, in the child


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


def rope_at(x: torch.Tensor, positions: torch.Tensor, base: float = 10000.0) -> torch.Tensor:
    """``ltcx.ops.attention.apply_rope`` of x [..., T, D] at positions [T] or [B, T], its tables made for the call."""
    from ltcx.ops.attention import apply_rope, rope_tables

    return apply_rope(x, rope_tables(positions, x.shape[-1], x.dtype, base))


def assert_written_backward(written, plain, inputs, cotangents, *extra) -> tuple[tuple, tuple]:
    """A written backward (``written``, a ``torch.autograd.Function.apply``) against autograd of its forward
    (``plain``), both called as ``form(*leaves, *extra)`` on fresh leaves cloned from ``inputs``: the same outputs bit
    for bit, and the gradients of sum(output * cotangent) over every input within float64 rounding (1e-12). Returns
    the written form's (outputs, gradients)."""
    def run(form):
        leaves = [x.clone().requires_grad_() for x in inputs]
        outputs = form(*leaves, *extra)
        outputs = outputs if isinstance(outputs, tuple) else (outputs,)
        return outputs, torch.autograd.grad(sum((o * c).sum() for o, c in zip(outputs, cotangents)), leaves)

    (got, got_grads), (want, want_grads) = run(written), run(plain)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=0, atol=0)  # the same forward
    for a, b in zip(got_grads, want_grads):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-13)
    return got, got_grads


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


def mlstm_inputs(B=2, H=3, T=37, D=8, f_bias=0.0, dtype=torch.float64, seed=0):
    """Seeded mLSTM inputs: q, k, v ``[B, H, T, D]`` ~ N(0, 1), input-gate pre-activations ~ N(0, 4) and forget-gate
    pre-activations ~ N(f_bias, 1) ``[B, H, T]``."""
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(B, H, T, D, generator=g, dtype=dtype) for _ in range(3))
    i_pre = 2.0 * torch.randn(B, H, T, generator=g, dtype=dtype)
    f_pre = torch.randn(B, H, T, generator=g, dtype=dtype) + f_bias
    return q, k, v, i_pre, f_pre


def input_gradients(form, tensors: list[torch.Tensor], seed: int = 1) -> tuple[torch.Tensor, ...]:
    """The gradients of every tensor in ``tensors`` (leaves that want one) of a seeded weighted sum of a chunked
    rule's two outputs, ``(out, final state) = form(*tensors)``: the same weights for every form of the rule."""
    out, final = form(*tensors)
    gen = torch.Generator().manual_seed(seed)
    weights, state_weights = (torch.randn(t.shape, generator=gen, dtype=t.dtype) for t in (out, final))
    return torch.autograd.grad((out * weights).sum() + (final * state_weights).sum(), tensors)


def assert_left_padded_batch_equals_each_prompt(model, vocab: int = 64) -> None:
    """A recurrent backbone (float64) given a left-padded batch and its mask: each row's real logits, its state and
    the decoding after it are the prompt's alone."""
    gen = torch.Generator().manual_seed(2)
    prompts = [torch.randint(0, vocab, (n,), generator=gen) for n in (9, 4)]
    nexts = torch.randint(0, vocab, (2, 3), generator=gen)
    width = max(len(p) for p in prompts)
    idx = torch.stack([torch.nn.functional.pad(p, (width - len(p), 0)) for p in prompts])
    mask = torch.stack([torch.arange(width) >= width - len(p) for p in prompts])
    with torch.no_grad():
        logits, state = model(idx, mask=mask)
        decoded, _ = model(nexts, state)
        for row, prompt in enumerate(prompts):
            alone, alone_state = model(prompt[None])
            assert_rel(logits[row, width - len(prompt):], alone[0], what=f"row {row}'s logits")
            alone_decoded, _ = model(nexts[row:row + 1], alone_state)
            assert_rel(decoded[row], alone_decoded[0], what=f"row {row}'s decoding")
    assert torch.isfinite(logits).all()


def assert_flops_formula_counts_the_forward(model, length: int, vocab: int = 64) -> None:
    """``forward_flops_per_token(length)`` equals FlopCounterMode's count per token of a forward at batch 2."""
    from torch.utils.flop_counter import FlopCounterMode

    idx = torch.randint(0, vocab, (2, length), generator=torch.Generator().manual_seed(4))
    with FlopCounterMode(display=False) as counter:
        model(idx)
    assert counter.get_total_flops() / (2 * length) == pytest.approx(model.forward_flops_per_token(length), rel=1e-12)


def assert_kernels_backend_runs_the_torch_form_off_cuda(torch_model, kernels_model, capsys, vocab: int = 64) -> None:
    """A model with ``backend: kernels`` off CUDA: the torch form's logits bit for bit, and one notice saying so."""
    idx = torch.randint(0, vocab, (2, 11), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        torch.testing.assert_close(kernels_model(idx)[0], torch_model(idx)[0], rtol=0, atol=0)
    assert "runs on CUDA only" in capsys.readouterr().err


def write_corpus(folder: Path, train_docs: int = 300, val_docs: int = 30, test_docs: int | None = None) -> Path:
    """train.txt, validation.txt and test.txt (``test_docs``, default ``val_docs``: ``ltcx test`` reads it) of
    40-word documents from a 19-word vocabulary (seeded) in ``folder``."""
    rng = random.Random(0)
    words = "the cat dog ran sat on a mat big small red blue happy sad tree house sun moon".split()
    folder.mkdir(parents=True, exist_ok=True)
    test_docs = val_docs if test_docs is None else test_docs
    for name, count in (("train.txt", train_docs), ("validation.txt", val_docs), ("test.txt", test_docs)):
        if not count:
            continue
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


# -- tiny `ltcx fit` runs ---------------------------------------------------------------------------------------

TINY_SHAPE = [
    "--model.backbone.init_args.n_layer", "1", "--model.backbone.init_args.n_embd", "32",
    "--model.backbone.init_args.n_head", "2", "--model.backbone.init_args.block_size", "64",
    "--model.warmup_steps", "2",
]
TINY_MODEL = [*TINY_SHAPE, "--model.backbone.init_args.n_kv_head", "1"]


def fit_args(data: Path, *extra: str) -> list[str]:
    return [
        "fit", "--config", str(ROOT / "configs/gpt.yaml"), "--config", str(ROOT / "configs/trainer/smoke.yaml"),
        "--data.path", str(data), "--data.block_size", "32", "--data.batch_size", "4", "--data.val_batches", "2",
        "--trainer.val_check_interval", "2", "--trainer.log_every_n_steps", "1",
        "--trainer.enable_progress_bar", "false", *TINY_MODEL, *extra,
    ]


def run_cli(args: list[str], cwd: Path, **env) -> subprocess.CompletedProcess:
    environment = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{ROOT / 'tests'}", "HF_HUB_OFFLINE": "1", **env}
    result = subprocess.run([sys.executable, str(ROOT / "run.py"), *args], cwd=cwd, env=environment,
                            capture_output=True, text=True, timeout=600)
    return result


def lean_fit_args(tmp_path: Path, data: Path, *extra: str, every: int = 100, keep_runs: str = "") -> list[str]:
    """fit_args without validation or samples; checkpoints every ``every`` steps to checkpoints/gpt."""
    callbacks = tmp_path / "lean.yaml"
    callbacks.write_text(
        "trainer:\n  callbacks:\n    - class_path: ltcx.callbacks.ModelCheckpoint\n      init_args:\n"
        f"        dirpath: checkpoints/gpt\n        save_last: true\n        every_n_train_steps: {every}\n"
        + (f"        keep_runs: {keep_runs}\n" if keep_runs else "")
        + "    - class_path: ltcx.callbacks.FiniteLossGuard\n"
    )
    return fit_args(data, "--config", str(callbacks), "--trainer.limit_val_batches", "0", *extra)


# -- 2 CPU processes (gloo) through `run.py fit` ------------------------------------------------------------------

DDP = ["--trainer.accelerator", "cpu", "--trainer.devices", "2", "--trainer.strategy", "ddp"]
FSDP = ["--config", str(ROOT / "configs/trainer/fsdp.yaml"), "--trainer.accelerator", "cpu", "--trainer.devices", "2"]
RANKS_TIMEOUT = 180  # s; a run takes ~10-20 s on an idle machine, a hang is caught well before pytest's patience ends


def run_ddp(args: list[str], cwd: Path, exits: Path, strategy: list[str] = DDP) -> subprocess.CompletedProcess:
    """``ltcx fit ... --trainer.devices 2`` (DDP, or ``strategy=FSDP``: FSDP2 through configs/trainer/fsdp.yaml) in
    its own process group; every rank's exit status lands in ``exits``."""
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{ROOT / 'tests'}", "HF_HUB_OFFLINE": "1",
           "LTCX_EXIT_DIR": str(exits)}
    proc = subprocess.Popen([sys.executable, str(ROOT / "tests/record_exit.py"), *args, *strategy], cwd=cwd, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=RANKS_TIMEOUT)  # returns once every rank has closed the pipes
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(f"2-process run still going after {RANKS_TIMEOUT} s (a rank hangs):\n{err[-3000:]}")
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def rank_exits(exits: Path) -> dict[str, int]:
    """Each rank's exit status, as tests/record_exit.py wrote it: {"rank0": 0, "rank1": 0}."""
    return {p.name: int(p.read_text()) for p in sorted(exits.iterdir())}


# -- errors: a test checks the facts of a message (the option it names, the offending value, the fix), each a short
# phrase, so that rewording the sentence breaks no test but dropping a fact does ---------------------------------

def assert_mentions(text: str, *facts: str) -> None:
    """Each of ``facts`` appears in ``text``, in any order."""
    missing = [fact for fact in facts if fact not in text]
    assert not missing, f"{missing} not in {text!r}"


def assert_one_error_line(stderr: str) -> str:
    """The one ``ltcx: error: ...`` line of a run's stderr (and no traceback), which is returned."""
    errors = [line for line in stderr.splitlines() if line.startswith("ltcx: error: ")]
    assert len(errors) == 1 and "Traceback" not in stderr, stderr[-3000:]
    return errors[0]


def one_error_line(args, capsys) -> str:
    """Run ``ltcx args`` in process; it must exit 2 with exactly one line on stderr, which is returned."""
    from ltcx.cli import main

    with pytest.raises(SystemExit) as exit_info:
        main(args)
    assert exit_info.value.code == 2
    return assert_one_error_line(capsys.readouterr().err)


# -- checkpoints ------------------------------------------------------------------------------------------------

GPT_CONFIG = dict(block_size=64, vocab_size=320, n_layer=1, n_head=2, n_kv_head=1, n_embd=32)


def write_checkpoint(path: Path, tokenizer: str = "bytes", **meta) -> Path:
    """A small ltcx checkpoint written without training (what `ltcx fit` writes, minus the trainer state)."""
    from ltcx.lm import LanguageModel
    from ltcx.models.gpt import GPT

    torch.manual_seed(0)
    model = LanguageModel(GPT(**GPT_CONFIG), warmup_steps=2)
    checkpoint = {
        "state_dict": model.state_dict(),
        "hyper_parameters": dict(model.hparams),
        "global_step": 3,
        "ltcx": {"backbone_class": "ltcx.models.gpt.GPT", "backbone_config": model.backbone.config_dict(),
                 "tokenizer": tokenizer, "tokens_seen": 0, **meta},
    }
    torch.save(checkpoint, path)
    return path


def write_model_checkpoint(path: Path, backbone, tokenizer: str = "bytes", train_block_size: int | None = None) -> Path:
    """A checkpoint of ``backbone`` (any catalogue architecture) written without training; ``train_block_size`` is
    the data block size it records having trained on (Lightning's ``datamodule_hyper_parameters``)."""
    from ltcx.lm import LanguageModel
    from ltcx.models.registry import class_path

    model = LanguageModel(backbone, warmup_steps=2)
    checkpoint = {
        "state_dict": model.state_dict(),
        "hyper_parameters": dict(model.hparams),
        "global_step": 3,
        "ltcx": {"backbone_class": class_path(type(backbone)), "backbone_config": backbone.config_dict(),
                 "tokenizer": tokenizer, "tokens_seen": 0},
    }
    if train_block_size is not None:
        checkpoint["datamodule_hyper_parameters"] = {"block_size": train_block_size, "tokenizer": tokenizer}
    torch.save(checkpoint, path)
    return path


def step_and_weights(path: Path) -> tuple[int, dict]:
    from ltcx.persist import read_checkpoint

    state = read_checkpoint(path)
    return state["global_step"], state["state_dict"]


def damaged(tmp_path: Path, checkpoint: Path, how: str) -> Path:
    """A copy of ``checkpoint`` damaged ``how``: "empty", "truncated" (half its bytes) or "random" (4 KB of noise);
    any other ``how`` names a file that does not exist."""
    path = tmp_path / f"{how}.ckpt"
    if how == "empty":
        path.write_bytes(b"")
    elif how == "truncated":
        path.write_bytes(checkpoint.read_bytes()[: checkpoint.stat().st_size // 2])
    elif how == "random":
        path.write_bytes(os.urandom(4096))
    return path
