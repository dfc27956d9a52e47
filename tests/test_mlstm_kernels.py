"""``mlstm_backend: kernels``: NX-AI's ``mlstm_kernels`` (TFLA, the xLSTM reference implementation's kernels) behind
ltcx's mLSTM signature (``ltcx/ops/mlstm_kernels.py``), and when an xLSTM uses them (``mlstm_kernel_for``).

On a CPU these tests run the package's native PyTorch chunkwise kernel (``chunkwise--native_autograd``) through the
same bridge the Triton kernel goes through on CUDA (the key-scale conversion of (C, n), the empty state, the padding
to the kernel's lengths, the dtypes), against ltcx's parallel, chunkwise and recurrent forms: float64 to rounding with
eps = 0, within eps with ltcx's eps (the kernels start from m = 0, ltcx from m = -inf; the module docstring says why
only eps sees it), float32 within the tolerance ltcx's own forms keep, the state handed to and from ltcx's recurrent
step for generation, and the gradients.

Triton's interpreter can not run TFLA's kernels with the pinned Triton (3.9): they use ``tl.make_block_ptr``, which
raises NotImplementedError("Block pointers have been removed in favor of the tensor descriptor API"), interpreted
or compiled; ``test_triton_kernel_in_the_interpreter_matches_ltcx`` is skipped with that reason.

What only a GPU can confirm: the Triton kernels' numerics (float32 and bf16, forward and backward, against these
forms) and their speed. ``test_triton_kernel_matches_ltcx_on_cuda`` checks the numerics when CUDA and the package
are there; it was written without a GPU, so its tolerances are a guess to confirm on the first GPU run. Speed goes in
``scripts/benchmark.py``, never in a test.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from helpers import assert_rel, mlstm_inputs, relative_error, run_in_pieces
from ltcx import errors
from ltcx.errors import ConfigError, LtcxError
from ltcx.models import xlstm as xlstm_module
from ltcx.models.registry import class_path
from ltcx.models.xlstm import XLSTM, XLSTMConfig, mlstm_kernel_for
from ltcx.ops.mlstm import EPS, mlstm_chunkwise, mlstm_init_state, mlstm_parallel, mlstm_recurrent, mlstm_step
from ltcx.ops.mlstm_kernels import (
    NATIVE_KERNEL,
    TRITON_KERNEL,
    _has_block_pointers,
    kernels_unavailable,
    mlstm_chunkwise_kernels,
    padded_length,
)
from ltcx.ops.naive.mlstm import mlstm_parallel_naive
from ltcx.persist.file_fits import check_same_backbone

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny tensors: see conftest.py

needs_package = pytest.mark.skipif(
    importlib.util.find_spec("mlstm_kernels") is None,
    reason="mlstm_kernels is not installed (requirements.txt installs it; pip install 'ltcx[kernels]')",
)

LENGTHS = [16, 20, 141, 300]  # a kernel length; padded to 32; one chunk of 128 + 13 padded; two chunks + 44 padded


def _kernels(*args, **kwargs):
    return mlstm_chunkwise_kernels(*args, kernel=NATIVE_KERNEL, **kwargs)


def _prefix_state(f_bias: float, D: int = 8):
    """A realistic carried state: ltcx's recurrence over an unrelated prefix (finite m)."""
    _, state = mlstm_recurrent(*mlstm_inputs(T=9, D=D, f_bias=f_bias, seed=1))
    return state


def _assert_same_memory(state, reference, tol=1e-12):
    """Two (C, n, m) that hold the same memory: C exp(m) and n exp(m) agree (compared at the reference's m)."""
    C, n, m = state
    C_ref, n_ref, m_ref = reference
    rescale = torch.exp(m - m_ref)
    assert_rel(C * rescale[..., None, None], C_ref, tol, "C")
    assert_rel(n * rescale[..., None], n_ref, tol, "n")


def test_padded_length_follows_tfla_rule():
    """TFLA runs 16, 32 or 64 steps, or a multiple of its chunk of 128."""
    assert [padded_length(t) for t in (2, 16, 17, 33, 64, 65, 127, 128, 129, 300, 512)] == \
        [16, 16, 32, 64, 64, 128, 128, 128, 256, 384, 512]


@needs_package
@pytest.mark.parametrize("f_bias", [4.0, -2.0], ids=["long-memory", "short-memory"])
@pytest.mark.parametrize("with_state", [False, True], ids=["empty-state", "carried-state"])
@pytest.mark.parametrize("T", LENGTHS)
def test_kernels_equal_ltcx_forms_float64_without_eps(T, with_state, f_bias):
    """With eps = 0 the kernels' outputs equal ltcx's parallel and chunkwise forms to rounding, padded or not, and
    their final state holds the same memory (the same m too, from a carried state)."""
    args = mlstm_inputs(T=T, f_bias=f_bias)
    state = _prefix_state(f_bias) if with_state else None
    h_par, s_par = mlstm_parallel(*args, state, eps=0.0)
    h_chunk, _ = mlstm_chunkwise(*args, state, chunk_size=16, eps=0.0)
    h, s = _kernels(*args, state, eps=0.0)
    assert h.shape == h_par.shape and h.dtype == torch.float64 and all(x.dtype == torch.float64 for x in s)
    assert_rel(h, h_par, what="h vs parallel")
    assert_rel(h, h_chunk, what="h vs chunkwise")
    _assert_same_memory(s, s_par)
    if with_state:
        assert_rel(s[2], s_par[2], what="m")


@needs_package
def test_kernels_equal_the_formula_written_out():
    """One head against the slow reference (``ltcx/ops/naive/mlstm.py``), with ltcx's eps: from the empty state the
    kernels' m is at least the reference's, so eps weighs at most exp(m) more: here, with eps-sized differences."""
    q, k, v, i_pre, f_pre = (x[:1, :1] for x in mlstm_inputs(T=6, D=3, f_bias=1.0, seed=3))
    h_ref = mlstm_parallel_naive(q[0, 0], k[0, 0], v[0, 0], i_pre[0, 0], f_pre[0, 0])
    h, _ = _kernels(q, k, v, i_pre, f_pre)
    assert_rel(h[0, 0], h_ref, tol=10 * EPS, what="h vs the written-out formula")


@needs_package
@pytest.mark.parametrize("T", [20, 141])
def test_kernels_with_eps_differ_from_ltcx_by_eps_only(T):
    """ltcx's eps (1e-6) enters as eps exp(m) against max(|n.q|, 1) in unscaled units; the kernels' empty state has
    m = 0 where ltcx's has m = -inf, so the outputs differ by about eps relative, no more; from a carried state (the
    same m) they agree to rounding."""
    args = mlstm_inputs(T=T, f_bias=1.0)
    h_ref, _ = mlstm_chunkwise(*args, chunk_size=16)
    h, _ = _kernels(*args)
    assert_rel(h, h_ref, tol=10 * EPS, what="h from the empty state")
    assert (h - h_ref).abs().max() > 0  # eps is there: the two empty states do differ
    state = _prefix_state(1.0)
    h_ref, s_ref = mlstm_chunkwise(*args, state, chunk_size=16)
    h, s = _kernels(*args, state)
    assert_rel(h, h_ref, what="h from a carried state")
    for x, ref, name in zip(s, s_ref, "Cnm"):
        assert_rel(x, ref, what=name)


@needs_package
def test_state_hands_over_between_kernels_and_ltcx_step():
    """Generation: a prompt through the kernels, then ltcx's recurrent step from their state, equals ltcx's forms
    throughout; a state from ltcx's step (or ltcx's empty state, m = -inf) feeds the kernels as it feeds ltcx."""
    prompt = mlstm_inputs(T=20, f_bias=2.0)
    steps = mlstm_inputs(T=5, f_bias=2.0, seed=4)
    _, s_kernels = _kernels(*prompt, eps=0.0)
    _, s_ltcx = mlstm_chunkwise(*prompt, chunk_size=8, eps=0.0)
    for t in range(5):
        token = [x[:, :, t] for x in steps]
        h_k, s_kernels = mlstm_step(*token, s_kernels, eps=0.0)
        h_l, s_ltcx = mlstm_step(*token, s_ltcx, eps=0.0)
        assert_rel(h_k, h_l, what=f"step {t}")
    _assert_same_memory(s_kernels, s_ltcx)
    # and back: the kernels continue from a stepped state as ltcx's chunkwise does (the same m: eps included)
    rest = mlstm_inputs(T=37, f_bias=2.0, seed=5)
    h_k, s_k = _kernels(*rest, s_ltcx)
    h_l, s_l = mlstm_chunkwise(*rest, s_ltcx, chunk_size=8)
    assert_rel(h_k, h_l, what="h after the handover")
    for x, ref, name in zip(s_k, s_l, "Cnm"):
        assert_rel(x, ref, what=name)
    empty = mlstm_init_state(2, 3, 8, dtype=torch.float64)
    h_empty, _ = _kernels(*rest, empty)
    h_none, _ = _kernels(*rest)
    torch.testing.assert_close(h_empty, h_none, rtol=0, atol=0)


@needs_package
def test_kernels_gradients_equal_ltcx_float64():
    """Training through the bridge (the native kernel's autograd, the padding sliced off) gives ltcx's gradients."""
    inputs = mlstm_inputs(B=1, H=2, T=141, f_bias=2.0)
    weight = torch.randn(1, 2, 141, 8, generator=torch.Generator().manual_seed(6), dtype=torch.float64)
    grads = []
    for form in (lambda *a: _kernels(*a, eps=0.0), lambda *a: mlstm_chunkwise(*a, chunk_size=32, eps=0.0)):
        leaves = [x.clone().requires_grad_() for x in inputs]
        h, _ = form(*leaves)
        (h * weight).sum().backward()
        grads.append([x.grad for x in leaves])
    for g, g_ref, name in zip(*grads, ("q", "k", "v", "i_pre", "f_pre")):
        assert_rel(g, g_ref, tol=1e-10, what=f"d/d{name}")


@needs_package
@pytest.mark.parametrize("f_bias", [8.0, -3.0])
def test_kernels_float32_within_ltcx_tolerance(f_bias):
    """float32 inputs: outputs within ltcx's own float32 tolerance of the float64 recurrence (5e-4 of the largest
    |h|, as tests/test_xlstm.py holds ltcx's forms to), states kept in float32."""
    args64 = mlstm_inputs(T=150, D=16, f_bias=f_bias)
    h_ref, s_ref = mlstm_recurrent(*args64)
    h, s = _kernels(*(x.float() for x in args64))
    assert h.dtype == torch.float32 and all(x.dtype == torch.float32 for x in s)
    assert_rel(h.double(), h_ref, tol=5e-4, what="h")
    _assert_same_memory([x.double() for x in s], s_ref, tol=5e-4)


# ----------------------------------------------------------------------------- the xLSTM model


def _tiny_model(dtype=torch.float64, **overrides) -> XLSTM:
    kw = dict(vocab_size=37, n_embd=32, n_layer=3, slstm_at=[1], n_head=2, slstm_n_head=2,
              chunk_size=4, qkv_proj_blocksize=4)
    kw.update(overrides)
    torch.manual_seed(0)
    model = XLSTM(**kw).to(dtype).eval()
    with torch.no_grad():  # gates away from their input-independent init
        for name, p in model.named_parameters():
            if "gate" in name or "skip" in name:
                p.add_(0.3 * torch.randn_like(p))
    return model


@pytest.fixture
def fresh_notices(monkeypatch):
    monkeypatch.setattr(errors, "_notices_given", set())


def test_kernels_backend_on_cpu_runs_ltcx_chunkwise_with_one_notice(fresh_notices, capsys):
    """The same YAML runs on a CPU: ltcx's chunkwise form (the same logits), one notice saying so."""
    idx = torch.randint(0, 37, (2, 11), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        logits, _ = _tiny_model(mlstm_backend="kernels")(idx)
        again, _ = _tiny_model(mlstm_backend="kernels")(idx)
        reference, _ = _tiny_model(mlstm_backend="chunkwise")(idx)
    torch.testing.assert_close(logits, reference, rtol=0, atol=0)
    torch.testing.assert_close(again, reference, rtol=0, atol=0)
    lines = capsys.readouterr().err.splitlines()
    assert lines == ["ltcx: mlstm_backend 'kernels' runs on CUDA only; on cpu the mLSTM runs ltcx's chunkwise form "
                     "(the same function)"]


def test_kernels_backend_selection_on_cuda(fresh_notices, monkeypatch, capsys):
    """On CUDA: TFLA when installed; without the package, training is one error line naming the fix, evaluation and
    generation fall back to ltcx's form with one notice (a checkpoint trained with the kernels stays usable)."""
    cuda = torch.device("cuda")  # only its type is read: no GPU needed
    monkeypatch.setattr(xlstm_module, "kernels_unavailable", lambda: None)
    assert mlstm_kernel_for(cuda, training=True) == TRITON_KERNEL
    monkeypatch.setattr(xlstm_module, "kernels_unavailable", lambda: "the mlstm_kernels package is not installed")
    with pytest.raises(LtcxError, match=r"^mlstm_backend 'kernels': the mlstm_kernels package is not installed: "
                                        r"pip install 'ltcx\[kernels\]', or set mlstm_backend: chunkwise$"):
        mlstm_kernel_for(cuda, training=True)
    assert mlstm_kernel_for(cuda, training=False) is None
    assert mlstm_kernel_for(cuda, training=False) is None
    assert capsys.readouterr().err.splitlines() == [
        "ltcx: mlstm_backend 'kernels': the mlstm_kernels package is not installed; evaluating with ltcx's chunkwise "
        "mLSTM (the same function; pip install 'ltcx[kernels]' for NX-AI's kernels)"]
    assert mlstm_kernel_for(torch.device("cpu"), training=True) is None
    monkeypatch.setattr(xlstm_module, "kernels_unavailable", lambda: "Triton 3.9.0 has no block pointers")
    with pytest.raises(LtcxError, match=r"no block pointers: install a Triton older than 3\.9 .*or set mlstm_backend"):
        mlstm_kernel_for(cuda, training=True)


def test_kernels_unavailable_names_what_is_missing(tmp_path):
    reason = kernels_unavailable()
    if importlib.util.find_spec("mlstm_kernels") is None:
        assert reason == "the mlstm_kernels package is not installed"
    elif importlib.util.find_spec("triton") is None:
        assert reason.startswith("Triton is not installed")
    else:
        assert reason is None or "has no block pointers (tl.make_block_ptr)" in reason
    # a Triton without block pointers (its tl.make_block_ptr raises) is told apart from one with them
    (tmp_path / "language").mkdir()
    core = tmp_path / "language" / "core.py"
    core.write_text('def make_block_ptr(base):\n    raise NotImplementedError("Block pointers have been removed")\n')
    assert not _has_block_pointers([str(tmp_path)])
    core.write_text("def make_block_ptr(base):\n    return base\n")
    assert _has_block_pointers([str(tmp_path)])


def test_kernels_backend_needs_the_sigmoid_forget_gate():
    with pytest.raises(ConfigError, match=r"mlstm_backend 'kernels' needs forget_gate 'sigmoid'"):
        XLSTMConfig(mlstm_backend="kernels", forget_gate="exp")


def test_a_checkpoint_resumes_on_another_mlstm_backend():
    """The backend and chunk size compute the same function of the same weights: a chunkwise checkpoint resumes on the
    kernels (and back); a change of width is still another model."""
    stored = _tiny_model(mlstm_backend="chunkwise", chunk_size=4)
    meta = {"backbone_class": class_path(XLSTM), "backbone_config": stored.config_dict()}
    check_same_backbone(meta, _tiny_model(mlstm_backend="kernels", chunk_size=16), "last.ckpt")
    with pytest.raises(LtcxError, match=r"is of another model \(n_embd: 32 in the file, 64 configured\)"):
        check_same_backbone(meta, _tiny_model(mlstm_backend="kernels", n_embd=64), "last.ckpt")


@needs_package
def test_model_on_the_kernels_keeps_the_contract_float64(monkeypatch):
    """The model with its mLSTM blocks on the kernels (the native one standing in for Triton): pieces and steps equal
    the whole to rounding, the logits equal ltcx's chunkwise model's within eps, and training reaches every
    parameter."""
    monkeypatch.setattr(xlstm_module, "mlstm_kernel_for", lambda device, training: NATIVE_KERNEL)
    model = _tiny_model(mlstm_backend="kernels")
    idx = torch.randint(0, 37, (2, 21), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        logits, state = model(idx)
        pieces, s = run_in_pieces(model, idx, (5, 1, 7, 3, 5))
        assert_rel(pieces, logits, what="pieces vs whole")
        for x, ref in zip([t for blk in s for t in blk], [t for blk in state for t in blk]):
            assert_rel(x, ref, what="state")
        reference, _ = _tiny_model(mlstm_backend="chunkwise")(idx)
        assert_rel(logits, reference, tol=1e-5, what="kernels vs chunkwise model")
    model.train()
    logits, _ = model(idx)
    F.cross_entropy(logits[:, :-1].reshape(-1, 37), idx[:, 1:].reshape(-1)).backward()
    assert all(p.grad is not None and p.grad.abs().max() > 0 for p in model.parameters())


# ----------------------------------------------------------------------------- TFLA in Triton's interpreter

INTERPRETED_CHECK = """
import torch
from helpers import mlstm_inputs
from ltcx.ops.mlstm import mlstm_chunkwise
from ltcx.ops.mlstm_kernels import TRITON_KERNEL, mlstm_chunkwise_kernels
for T in (64, 141):
    inputs = [x.float() for x in mlstm_inputs(B=1, H=2, T=T, D=16, f_bias=3.0)]
    weight = torch.randn(1, 2, T, 16, generator=torch.Generator().manual_seed(2))
    runs = []
    for form in (lambda *a: mlstm_chunkwise_kernels(*a, kernel=TRITON_KERNEL),
                 lambda *a: mlstm_chunkwise(*a, chunk_size=16)):
        leaves = [x.clone().requires_grad_() for x in inputs]
        h, _ = form(*leaves)
        (h * weight).sum().backward()
        runs.append([h.detach()] + [x.grad for x in leaves])
    for got, want in zip(*runs):
        assert (got - want).abs().max() <= 1e-4 * want.abs().max(), (T, (got - want).abs().max())
"""


@pytest.mark.skipif(kernels_unavailable() is not None, reason=f"TFLA can not run: {kernels_unavailable()}")
def test_triton_kernel_in_the_interpreter_matches_ltcx():
    """TFLA's Triton kernels on a CPU in Triton's interpreter (a child process: TRITON_INTERPRET is read when Triton
    is imported), float32 against ltcx's chunkwise form: h and the gradients of q, k, v and the gates within 1e-4
    of the largest value, padded and not. Skipped with Triton 3.9, whose tl.make_block_ptr raises
    NotImplementedError("Block pointers have been removed in favor of the tensor descriptor API") in the
    interpreter as in compilation: TFLA's kernels load and store through block pointers."""
    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": os.pathsep.join([str(root), str(root / "tests")])}
    result = subprocess.run([sys.executable, "-c", INTERPRETED_CHECK], cwd=root, env=env, capture_output=True,
                            text=True)
    assert result.returncode == 0, result.stderr[-2000:]


# ----------------------------------------------------------------------------- what only a GPU can confirm


@pytest.mark.skipif(not torch.cuda.is_available() or kernels_unavailable() is not None,
                    reason="needs CUDA and mlstm_kernels with Triton (the GPU half of this module)")
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-2), (torch.bfloat16, 5e-2)])
@pytest.mark.parametrize("T", [64, 200])
def test_triton_kernel_matches_ltcx_on_cuda(T, dtype, tol):
    """TFLA (Triton) against ltcx's chunkwise form in float32 on the GPU: outputs, final state and the gradients of q,
    k, v and the gates, relative (Frobenius) error within ``tol`` (float32 may run TF32 matmuls). Untried: confirm
    or tighten the tolerances on the first GPU run."""
    inputs = [x.cuda() for x in mlstm_inputs(B=2, H=4, T=T, D=64, f_bias=3.0, dtype=torch.float32)]
    weight = torch.randn(2, 4, T, 64, device="cuda")
    results = []
    for form, cast in ((lambda *a: mlstm_chunkwise_kernels(*a, kernel=TRITON_KERNEL), dtype),
                       (lambda *a: mlstm_chunkwise(*a, chunk_size=64), torch.float32)):
        leaves = [x.clone().requires_grad_() for x in inputs]
        q, k, v = (x.to(cast) for x in leaves[:3])
        h, state = form(q, k, v, *leaves[3:])
        (h.float() * weight).sum().backward()
        results.append((h.float(), [s.detach() for s in state], [x.grad for x in leaves]))
    (h, (C, n, m), grads), (h_ref, (C_ref, n_ref, m_ref), grads_ref) = results
    assert relative_error(h, h_ref) <= tol
    rescale = torch.exp(m - m_ref)  # the same memory at ltcx's m (the kernels start from m = 0)
    assert relative_error(C * rescale[..., None, None], C_ref) <= tol
    assert relative_error(n * rescale[..., None], n_ref) <= tol
    for g, g_ref, name in zip(grads, grads_ref, ("q", "k", "v", "i_pre", "f_pre")):
        assert relative_error(g, g_ref) <= tol, name
