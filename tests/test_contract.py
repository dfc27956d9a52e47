"""The backbone contract (docs/architecture.md), checked for every entry of the catalogue
(``ltcx.models.catalog.CATALOG``) at its tiny shape and at each of its variants' (``Architecture.shapes``): a new
architecture, or a new variant of one, gets every check here by being catalogued.

    pieces == whole (with the state, several split points, single-token steps), cached decode == full forward,
    inference after an optimizer step sees the step, reorder_cache, causality, batch independence, gradients
    reach every parameter, config_dict rebuilds, bf16 generation, torch.compile of the training logits, and a CLI
    fit -> resume -> validate/test/predict -> generate round trip of the entry's YAML.

Equation tests (float64 references of each architecture's maths) stay in the per-architecture modules.

torch.compile: the default run compiles the training step with the ``aot_eager`` backend (TorchDynamo's graph
capture and AOTAutograd's joint graph, where a model breaks under compile, without Inductor's C++ code generation;
about a minute per tiny model on a 2-core machine) for ``COMPILE_QUICK`` only; generation through the compiled
backbone is checked there for the GPTs only, as recurrent states recompile for a few steps. ``pytest -m slow
tests/test_contract.py`` runs the other entries, generation for every entry and all of it again with Inductor
(which needs a C++ compiler; skipped without one).
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import re
import shutil
import sys

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from helpers import assert_generates, assert_mentions, read_events, relative_error, run_in_pieces, write_corpus
from ltcx.generation import generate
from ltcx.lm import LanguageModel
from ltcx.models.base import Backbone
from ltcx.models.catalog import CATALOG, Architecture, add_to_catalog, config_path, remove_from_catalog
from ltcx.models.state import map_state_tensors

# Tolerances: max |error| / max |reference| (helpers.relative_error, norm="max").
F64_REL = 1e-10  # float64: pieces, cached decode and reorder_cache against the whole batch run
F32_REL = 1e-5  # float32 pieces (single-token steps included) vs whole; the tiny shapes measure below 1e-6
EXACT_ATOL = 1e-12  # float64 causality and batch independence: the unaffected logits are (nearly) bit-identical
COMPILE_RTOL, COMPILE_ATOL = 1e-5, 1e-5  # compiled vs eager loss (gradients: rtol 1e-4)

VOCAB = 64
B, T = 2, 19  # T = 19 crosses Titans' segments and memory chunks (4) and xLSTM's chunks (4)
SPLITS = ([19], [5, 1, 7, 6], [3, 4, 12], [1] * 19)  # the last one: cached decode, token by token

pytestmark = pytest.mark.usefixtures("one_thread")


def tokens(batch: int, length: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, VOCAB, (batch, length), generator=torch.Generator().manual_seed(seed))


def tiny(entry: Architecture, dtype=torch.float32, seed: int = 0, variant: str = "tiny") -> nn.Module:
    torch.manual_seed(seed)
    return entry.build_tiny(VOCAB, variant).to(dtype).eval()


# -- the checks: each takes a catalogue entry and one of its shapes -----------------------------------------


def check_pieces_equal_whole(entry: Architecture, variant: str = "tiny") -> None:
    """Feeding a sequence in pieces with the returned state gives the logits of feeding it whole (float64 and
    float32), and the state after the pieces continues like the state after the whole."""
    idx = tokens(B, T + 2)
    for dtype, tol in ((torch.float64, F64_REL), (torch.float32, F32_REL)):
        model = tiny(entry, dtype, variant=variant)
        with torch.no_grad():
            whole, whole_state = model(idx[:, :T])
            following, _ = model(idx[:, T:], whole_state)
            for sizes in SPLITS:
                logits, state = run_in_pieces(model, idx[:, :T], sizes)
                assert logits.shape == (B, T, VOCAB)
                assert relative_error(logits, whole, norm="max") < tol, (dtype, sizes)
                continued, _ = model(idx[:, T:], state)
                assert relative_error(continued, following, norm="max") < tol, (dtype, sizes)


def check_cached_decode_equals_full_forward(entry: Architecture, variant: str = "tiny") -> None:
    """Greedy decoding with the state picks the tokens of recomputing the whole prefix each step (float64)."""
    model = tiny(entry, torch.float64, variant=variant)
    prompt = tokens(B, 4, seed=1)
    with torch.no_grad():
        cached = generate(model, prompt, 12, temperature=0.0)
        sequence = prompt
        for _ in range(12):
            logits, _ = model(sequence)
            sequence = torch.cat([sequence, logits[:, -1].argmax(-1, keepdim=True)], dim=1)
    assert torch.equal(cached, sequence)


def check_inference_sees_each_optimizer_step(entry: Architecture, variant: str = "tiny") -> None:
    """A no-grad forward (a validation) after steps of torch's fused AdamW (ltcx's optimizer), which writes the
    weights without bumping their version counters, equals the forward with gradients on (every weight derived
    afresh): no derived weight kept from an earlier inference call serves it the weights of an earlier step. A
    generation between the steps keeps nothing past its end either."""
    model = tiny(entry, torch.float32, variant=variant)
    idx = tokens(B, T, seed=6)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.05, fused=True)
    for _ in range(2):
        with torch.no_grad():
            model(idx)
            generate(model, idx[:, :3], 2, temperature=0.0)
        logits, _ = model(idx)
        logits.float().pow(2).mean().backward()
        optimizer.step()
        optimizer.zero_grad()
    with torch.no_grad():
        inferred, _ = model(idx)
    derived_afresh, _ = model(idx)
    torch.testing.assert_close(inferred, derived_afresh, rtol=0, atol=0)


def check_reorder_cache(entry: Architecture, variant: str = "tiny") -> None:
    """Permuting (and repeating) the batch of a state, then continuing, equals continuing the permuted batch."""
    model = tiny(entry, torch.float64, variant=variant)
    idx = tokens(3, 13, seed=2)
    index = torch.tensor([2, 0, 0, 1])
    with torch.no_grad():
        _, state = model(idx[:, :9])
        continued, _ = model(idx[index, 9:], model.reorder_cache(state, index))
        direct, _ = model(idx[index])
    assert relative_error(continued, direct[:, 9:], norm="max") < F64_REL


def check_causality(entry: Architecture, variant: str = "tiny") -> None:
    """Changing the tokens from t on leaves the logits before t unchanged (and changes those from t)."""
    model = tiny(entry, torch.float64, variant=variant)
    idx = tokens(B, T, seed=3)
    with torch.no_grad():
        logits, _ = model(idx)
        for t in (1, 8, T - 1):
            changed = idx.clone()
            changed[:, t:] = (changed[:, t:] + 1) % VOCAB
            other, _ = model(changed)
            torch.testing.assert_close(other[:, :t], logits[:, :t], rtol=0, atol=EXACT_ATOL, msg=f"t={t}")
            assert (other[:, t:] - logits[:, t:]).abs().max() > 1e-6, t


def check_batch_independence(entry: Architecture, variant: str = "tiny") -> None:
    """A row's logits do not depend on the other rows, with or without a state."""
    model = tiny(entry, torch.float64, variant=variant)
    idx = tokens(3, T, seed=4)
    other = idx.clone()
    other[1] = tokens(1, T, seed=5)[0]
    with torch.no_grad():
        logits, state = model(idx[:, :-1])
        changed, changed_state = model(other[:, :-1])
        alone, alone_state = model(idx[:1, :-1])
        step, _ = model(idx[:, -1:], state)
        changed_step, _ = model(other[:, -1:], changed_state)
        alone_step, _ = model(idx[:1, -1:], alone_state)
    for rows in ([0, 2],):
        torch.testing.assert_close(changed[rows], logits[rows], rtol=0, atol=EXACT_ATOL)
        torch.testing.assert_close(changed_step[rows], step[rows], rtol=0, atol=EXACT_ATOL)
    assert relative_error(alone, logits[:1], norm="max") < F64_REL
    assert relative_error(alone_step, step[:1], norm="max") < F64_REL


def check_gradients_reach_every_parameter(entry: Architecture, variant: str = "tiny") -> None:
    """A next-token loss gives every parameter a finite gradient, nonzero somewhere."""
    model = tiny(entry, variant=variant).train()
    idx = tokens(B, T + 1, seed=6)
    logits, _ = model(idx[:, :-1])
    F.cross_entropy(logits.reshape(-1, VOCAB), idx[:, 1:].reshape(-1)).backward()
    for name, param in model.named_parameters():
        assert param.grad is not None, name
        assert torch.isfinite(param.grad).all(), name
        assert param.grad.abs().max() > 0, name


def check_hidden_without_state(entry: Architecture, variant: str = "tiny") -> None:
    """``forward_hidden(idx, state, with_state=False)`` (the losses', which discard the state) returns no state and
    the hidden states and gradients of ``forward_hidden(idx, state)``, bit for bit, in training mode: at lengths
    that end on and inside a chunk (Titans' memory, the xLSTM's mLSTM), from the start and continuing a state. A
    """
    model = tiny(entry, torch.float64, variant=variant).train()
    idx = tokens(B, T + 16, seed=9)
    with torch.no_grad():
        _, state = model.forward_hidden(idx[:, :3])
    for piece, given in ((idx[:, :16], None), (idx[:, :T], None), (idx[:, 3:T + 16], state)):
        outputs = []
        for with_state in (True, False):
            model.zero_grad(set_to_none=True)
            hidden, new_state = model.forward_hidden(piece, given, with_state=with_state)
            assert (new_state is None) != with_state
            hidden.square().mean().backward()
            outputs.append((hidden.detach(), {n: p.grad for n, p in model.named_parameters()}))
        (kept, kept_grads), (hidden, grads) = outputs
        torch.testing.assert_close(hidden, kept, rtol=0, atol=0)
        for name, grad in grads.items():
            torch.testing.assert_close(grad, kept_grads[name], rtol=0, atol=0, msg=name)


def check_config_dict_rebuilds(entry: Architecture, variant: str = "tiny") -> None:
    """``type(m)(**m.config_dict())`` rebuilds the same state_dict shapes, and with the weights the same logits;
    the contract's other members answer."""
    model = tiny(entry, variant=variant)
    clone = type(model)(**model.config_dict())
    assert {k: v.shape for k, v in clone.state_dict().items()} == {k: v.shape for k, v in model.state_dict().items()}
    assert clone.config_dict() == model.config_dict()
    clone.load_state_dict(model.state_dict())
    clone.eval()
    idx = tokens(1, 7, seed=7)
    with torch.no_grad():
        torch.testing.assert_close(clone(idx)[0], model(idx)[0], rtol=0, atol=0)
    assert model.parameter_count() > 0 and model.flops_per_token(T) > 0
    assert model.max_seq_len is None or model.max_seq_len >= T
    names = set(model.no_weight_decay_param_names())
    assert names <= {name for name, _ in model.named_parameters()}


def check_bf16_generation(entry: Architecture, variant: str = "tiny", *, mode: str) -> None:
    """Generation runs with bf16 weights and under bf16 autocast, and the state it leaves continues."""
    model = tiny(entry, variant=variant)
    prompt = tokens(B, 5, seed=8)
    with torch.no_grad():
        if mode == "bf16 weights":
            model = model.to(torch.bfloat16)
            out = generate(model, prompt, 6, temperature=0)
            _, state = model(out[:, :-1])
            logits, state = model(out[:, -1:], state)
        else:
            with torch.autocast("cpu", dtype=torch.bfloat16):
                out = generate(model, prompt, 6, temperature=0)
                _, state = model(out[:, :1])
                logits, state = model(out[:, 1:2], state)  # a cached step
    assert out.shape == (B, 11) and torch.isfinite(logits.float()).all()
    dtypes = set()
    map_state_tensors(state, lambda t: dtypes.add(t.dtype) or t)
    assert {d for d in dtypes if d.is_floating_point} <= {torch.bfloat16, torch.float32}, dtypes


CORE_CHECKS = [
    check_pieces_equal_whole, check_cached_decode_equals_full_forward, check_inference_sees_each_optimizer_step,
    check_reorder_cache, check_causality,
    check_batch_independence, check_gradients_reach_every_parameter, check_hidden_without_state,
    check_config_dict_rebuilds,
    functools.partial(check_bf16_generation, mode="bf16 weights"),
    functools.partial(check_bf16_generation, mode="autocast"),
]


# -- every catalogue entry ----------------------------------------------------------------------------------

ALL = sorted(CATALOG)
SHAPES = [(name, variant) for name in ALL for variant in CATALOG[name].shapes()]  # every entry, every variant
SHAPE_IDS = [name if variant == "tiny" else f"{name}-{variant}" for name, variant in SHAPES]


@pytest.mark.quick
@pytest.mark.parametrize("name", ALL)
def test_constructor_is_the_config_declared_once(name):
    """The backbone's signature (what the CLI and checkpoints read) is its config dataclass's init fields, with the
    same defaults, and its docstring documents each field."""
    cls = CATALOG[name].backbone_class()
    fields = {f.name: f for f in dataclasses.fields(cls.config_class) if f.init}
    parameters = inspect.signature(cls).parameters
    assert list(parameters) == list(fields)
    assert all(p.kind is p.KEYWORD_ONLY and p.default == fields[n].default for n, p in parameters.items())
    assert all(f"    {n}: " in inspect.getdoc(cls.__init__) for n in fields)


@pytest.mark.quick
@pytest.mark.parametrize("check", CORE_CHECKS, ids=lambda check: getattr(check, "__name__", None) or (
    f"{check.func.__name__}-{check.keywords['mode'].replace(' ', '_')}"))
@pytest.mark.parametrize("name,variant", SHAPES, ids=SHAPE_IDS)
def test_contract(name, variant, check):
    check(CATALOG[name], variant)


@pytest.mark.quick
def test_catalogue_entries_have_their_yaml_and_class():
    for name, entry in CATALOG.items():
        assert config_path(name).is_file(), name
        assert f"class_path: {entry.class_path}" in config_path(name).read_text(), name


# -- torch.compile ------------------------------------------------------------------------------------------


def check_compiled_backbone(entry: Architecture, backend: str, monkeypatch, generation: bool) -> None:
    """A compiled training step (--model.compile true) equals the eager one; optionally generation runs through
    the compiled backbone and picks the eager tokens."""
    torch._dynamo.reset()
    real_compile = torch.compile
    graphs = []

    def counting_backend(graph, example_inputs):
        graphs.append(graph)
        return torch._dynamo.lookup_backend(backend)(graph, example_inputs)

    monkeypatch.setattr(torch, "compile", functools.partial(real_compile, backend=counting_backend, dynamic=False))
    torch.manual_seed(0)
    eager = LanguageModel(entry.build_tiny(VOCAB))
    compiled = LanguageModel(entry.build_tiny(VOCAB))
    compiled.load_state_dict(eager.state_dict())
    compiled.hparams.compile = True
    compiled.configure_model()  # what --model.compile true does
    assert list(compiled.state_dict()) == list(eager.state_dict())  # compiled in place: the same keys
    batch = torch.randint(0, VOCAB, (2, 9), generator=torch.Generator().manual_seed(1))
    for model in (eager, compiled):
        model.loss(batch).backward()
    assert graphs, "the compiled model's loss ran no compiled graph"
    torch.testing.assert_close(compiled.loss(batch), eager.loss(batch), rtol=COMPILE_RTOL, atol=COMPILE_ATOL)
    eager_grads = dict(eager.named_parameters())
    for param_name, param in compiled.named_parameters():
        torch.testing.assert_close(param.grad, eager_grads[param_name].grad, rtol=1e-4, atol=1e-5, msg=param_name)

    if not generation:
        return
    # Generation through the compiled backbone: a cache or state that grows each step recompiles, so let
    # TorchDynamo mark the growing dimensions dynamic (its default) instead of dynamic=False.
    backbone = real_compile(eager.backbone.eval(), backend=backend)
    prompt = batch[:1, :3]
    with torch.no_grad():
        tokens_ = generate(backbone, prompt, 5, temperature=0)
        torch.testing.assert_close(tokens_, generate(eager.backbone, prompt, 5, temperature=0))


@pytest.mark.parametrize("name", ALL)
def test_the_training_loss_traces_as_one_graph(name):
    """--model.compile captures the whole loss in one graph, Titans' memory loop and the sLSTM scan included: a graph
    break returns to Python between graphs (a launch gap on a GPU, and often a wait for the device)."""
    backbone = CATALOG[name].build_tiny(VOCAB)
    torch._dynamo.reset()
    explained = torch._dynamo.explain(lambda idx: backbone(idx, targets=idx))(tokens(B, 9))
    assert explained.graph_break_count == 0, [str(r.reason).splitlines()[0] for r in explained.break_reasons]
    assert explained.graph_count == 1


def test_compile_reduce_overhead_asks_inductor_for_cuda_graphs(monkeypatch):
    """--model.compile reduce-overhead compiles the backbone in place in Inductor's CUDA-graph mode (on a CPU Inductor
    runs without graphs); the loss is eager's."""
    asked, real_compile = [], torch.compile

    def compile_eagerly(fn, **options):
        asked.append(options)
        return real_compile(fn, backend="eager")

    monkeypatch.setattr(torch, "compile", compile_eagerly)
    torch.manual_seed(0)
    eager = LanguageModel(CATALOG["gpt"].build_tiny(VOCAB))
    compiled = LanguageModel(CATALOG["gpt"].build_tiny(VOCAB), compile="reduce-overhead")
    compiled.load_state_dict(eager.state_dict())
    compiled.configure_model()
    batch = tokens(B, 9)
    torch.testing.assert_close(compiled.loss(batch), eager.loss(batch))
    assert asked == [{"mode": "reduce-overhead"}]


# MAL has both of Titans' block kinds (memory layer, sliding-window attention layer); MAG and MAC, whose
# unrolled memory chunks take a minute each to trace here, LMM and GTA (the GPT's path plus its attention) run
# with -m slow.
COMPILE_QUICK = ["gpt", "ltc", "xlstm", "titans_mal"]


@pytest.mark.parametrize(
    "name", [*COMPILE_QUICK, *(pytest.param(n, marks=pytest.mark.slow) for n in ALL if n not in COMPILE_QUICK)]
)
def test_compiled_step_equals_eager(name, monkeypatch):
    check_compiled_backbone(CATALOG[name], "aot_eager", monkeypatch, generation=name in ("gpt", "ltc"))


@pytest.mark.slow
@pytest.mark.parametrize("name", ALL)
def test_generation_runs_through_the_compiled_backbone(name, monkeypatch):
    check_compiled_backbone(CATALOG[name], "aot_eager", monkeypatch, generation=True)


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("g++") is None and shutil.which("c++") is None,
                    reason="Inductor compiles C++ on a CPU and no C++ compiler is installed (apt-get install g++)")
@pytest.mark.parametrize("name", ALL)
def test_inductor_compiled_step_equals_eager_and_generation_runs(name, monkeypatch):
    check_compiled_backbone(CATALOG[name], "inductor", monkeypatch, generation=True)


# -- compile: ops -------------------------------------------------------------------------------------------


def compiles_ops(name: str) -> bool:
    return callable(getattr(CATALOG[name].backbone_class(), "compile_ops", None))


def check_compiled_ops(entry: Architecture, variant: str, backend: str, monkeypatch) -> None:
    """--model.compile ops: the training step through the backbone's compiled ops equals the eager one, and the
    compiled function is what the step ran."""
    from ltcx.models import titans

    torch._dynamo.reset()
    real_compile, calls = torch.compile, []

    def counting_compile(fn, **kwargs):
        compiled = real_compile(fn, backend=backend, **kwargs)
        return lambda *args, **kw: (calls.append(fn.__name__), compiled(*args, **kw))[1]

    monkeypatch.setattr(torch, "compile", counting_compile)
    titans._compiled_neural_memory.cache_clear()
    try:
        torch.manual_seed(0)
        eager = LanguageModel(entry.build_tiny(VOCAB, variant))
        compiled = LanguageModel(entry.build_tiny(VOCAB, variant), compile="ops")
        compiled.load_state_dict(eager.state_dict())
        compiled.configure_model()  # what --model.compile ops does
        batch = torch.randint(0, VOCAB, (2, 9), generator=torch.Generator().manual_seed(1))
        losses = [model.loss(batch) for model in (eager, compiled)]
        assert calls, "the compiled ops did not run"
        for loss in losses:
            loss.backward()
        torch.testing.assert_close(losses[1], losses[0], rtol=COMPILE_RTOL, atol=COMPILE_ATOL)
        eager_grads = dict(eager.named_parameters())
        for param_name, param in compiled.named_parameters():
            torch.testing.assert_close(param.grad, eager_grads[param_name].grad, rtol=1e-4, atol=1e-5, msg=param_name)
        with torch.no_grad():  # evaluation stays eager: a new length never waits for a compile
            ran = len(calls)
            compiled.loss(batch[:, :5])
            assert len(calls) == ran
    finally:
        titans._compiled_neural_memory.cache_clear()


@pytest.mark.parametrize("name,variant", [
    pytest.param(name, variant, marks=() if variant == "tiny" else pytest.mark.slow)
    for name, variant in SHAPES if compiles_ops(name)])
def test_compiled_ops_step_equals_eager(name, variant, monkeypatch):
    check_compiled_ops(CATALOG[name], variant, "aot_eager", monkeypatch)


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("g++") is None and shutil.which("c++") is None,
                    reason="Inductor compiles C++ on a CPU and no C++ compiler is installed (apt-get install g++)")
@pytest.mark.parametrize("name", [name for name in ALL if compiles_ops(name)])
def test_inductor_compiled_ops_step_equals_eager(name, monkeypatch):
    check_compiled_ops(CATALOG[name], "tiny", "inductor", monkeypatch)


@pytest.mark.parametrize("name", [name for name in ALL if not compiles_ops(name)])
def test_compile_ops_is_one_line_for_a_backbone_without_ops(name):
    from ltcx.errors import ConfigError

    with pytest.raises(ConfigError) as raised:
        LanguageModel(CATALOG[name].build_tiny(VOCAB), compile="ops")
    assert_mentions(str(raised.value), "model.compile ('ops')", CATALOG[name].class_name, "no ops to compile",
                    "--model.compile true")
    assert "\n" not in str(raised.value)


# -- the CLI ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ALL)
def test_cli_fit_resume_and_generate(name, tmp_path, monkeypatch, capsys):
    """The entry's YAML at its tiny shape through the CLI (what run.py calls), in process: fit 2 steps with a
    sample (its validation's loss the one validating its checkpoint gives), resume to 3, validate / test / predict
    the checkpoint, generate from it."""
    from ltcx.cli import main

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "argv", ["ltcx"])
    data = write_corpus(tmp_path / "corpus", 60, 10)
    args = [
        "fit", "--config", str(config_path(name)), "--config", str(config_path("gpt").parent / "trainer/smoke.yaml"),
        "--data.path", str(data), "--data.block_size", "32", "--data.batch_size", "2", "--data.val_batches", "1",
        "--trainer.max_steps", "2", "--trainer.val_check_interval", "2", "--trainer.enable_progress_bar", "false",
        *CATALOG[name].tiny_cli(),
    ]
    main(args)
    checkpoint = tmp_path / f"checkpoints/{name}/version_0/last.ckpt"
    assert torch.load(checkpoint, weights_only=True)["global_step"] == 2
    samples = read_events(tmp_path / f"lightning_logs/{name}/version_0").Tensors("samples/text_summary")
    assert [e.step for e in samples] == [2] and samples[0].tensor_proto.string_val[0].decode().startswith("Once")
    main([*args, "--trainer.max_steps", "3", "--ckpt_path", "last"])
    checkpoint = tmp_path / f"checkpoints/{name}/version_1/last.ckpt"  # the resumed run saves in its own folder
    assert torch.load(checkpoint, weights_only=True)["global_step"] == 3
    for subcommand in ("validate", "test", "predict"):
        main([subcommand, *args[1:], "--ckpt_path", str(checkpoint)])
    # the first fit's validation at step 2 is its checkpoint's validated afresh (no weight derived at another step)
    [logged] = [e.value for e in read_events(tmp_path / f"lightning_logs/{name}/version_0").Scalars("val/loss")]
    capsys.readouterr()
    main(["validate", *args[1:], "--ckpt_path", str(tmp_path / f"checkpoints/{name}/version_0/last.ckpt")])
    validated = float(re.search(r"val/loss\W+([-+.e\d]+)", capsys.readouterr().out).group(1))
    assert validated == pytest.approx(logged, rel=1e-6)
    assert_generates(checkpoint, capsys)


# -- a new architecture gets the contract by construction ---------------------------------------------------


class ToyBackbone(Backbone):
    """A backbone keeping the contract in a few lines: logits from the current token's embedding plus the mean of
    the embeddings so far (bigram + cumulative mean). State: (running sum [B, C], count)."""

    def __init__(self, vocab_size: int, n_embd: int = 8):
        super().__init__()
        self.vocab_size, self.n_embd = vocab_size, n_embd
        self.wte = nn.Embedding(vocab_size, n_embd)
        self.mix = nn.Linear(2 * n_embd, n_embd)
        self.head = nn.Linear(n_embd, vocab_size, bias=False)

    def forward_hidden(self, idx, state=None, with_state=True):
        x = self.wte(idx)
        total, count = state if state is not None else (torch.zeros_like(x[:, 0]), 0)
        sums = total.unsqueeze(1) + x.cumsum(1)
        counts = count + torch.arange(1, idx.shape[1] + 1, device=idx.device, dtype=x.dtype)
        h = torch.tanh(self.mix(torch.cat([x, sums / counts[:, None]], dim=-1)))
        return h, (sums[:, -1], count + idx.shape[1]) if with_state else None

    def output_head(self):
        return self.head

    def config_dict(self) -> dict:
        return {"vocab_size": self.vocab_size, "n_embd": self.n_embd}

    def reorder_cache(self, state, index):
        return state[0].index_select(0, index), state[1]

    def flops_per_token(self, seq_len: int) -> int:
        return 6 * self.parameter_count()

    def no_weight_decay_param_names(self) -> list[str]:
        return ["mix.bias"]


class ForgetfulToy(ToyBackbone):
    """Breaks the contract: drops the state it is given (each piece starts afresh)."""

    def forward_hidden(self, idx, state=None, with_state=True):
        return super().forward_hidden(idx, None, with_state)


@pytest.fixture
def toy_entry():
    entry = add_to_catalog(Architecture("toy", __name__, "ToyBackbone", "", dict(n_embd=8), {"narrow": dict(n_embd=4)}))
    yield entry
    remove_from_catalog("toy")


def test_a_catalogued_toy_backbone_gets_the_contract_checks(toy_entry):
    assert "toy" in CATALOG and CATALOG["toy"].backbone_class() is ToyBackbone
    for check in CORE_CHECKS:
        for variant in CATALOG["toy"].shapes():
            check(CATALOG["toy"], variant)


def test_a_backbone_breaking_the_contract_fails_the_checks(toy_entry):
    """The checks are not vacuous: a toy that drops its state fails pieces == whole and cached decoding."""
    broken = Architecture("toy_forgetful", __name__, "ForgetfulToy", "", dict(n_embd=8))
    for check in (check_pieces_equal_whole, check_cached_decode_equals_full_forward):
        with pytest.raises(AssertionError):
            check(broken)


def test_added_entries_are_not_checkpoint_classes(toy_entry):
    """The registry's allow-list is the catalogue's own entries: adding one imports nothing and allows nothing."""
    from ltcx.errors import LtcxError
    from ltcx.models.registry import known_backbones, resolve_backbone

    assert toy_entry.class_path not in known_backbones()
    with pytest.raises(LtcxError) as error:
        resolve_backbone(toy_entry.class_path)
    assert_mentions(str(error.value), f"'{toy_entry.class_path}'", "not a registered ltcx backbone")
    assert {CATALOG[name].class_path for name in ALL if name != "toy"} <= set(known_backbones())
