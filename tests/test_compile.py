"""torch.compile (``--model.compile true``): for every backbone a compiled training step equals the eager one and
generation runs through the compiled backbone, on tiny models on a CPU.

The default run compiles the training step with the ``aot_eager`` backend: TorchDynamo's graph capture and
AOTAutograd's joint forward/backward graph, which is where a model breaks under compile, without Inductor's
C++ code generation (about a minute per tiny model on this project's 2-core machine); generation through the
compiled backbone is checked there for the GPTs only, as the recurrent states recompile for a few steps
(half a minute or more per Titans variant), and of Titans only MAL is compiled. ``pytest -m slow
tests/test_compile.py`` runs the other variants, generation for every backbone and all of it again with
Inductor (which needs a C++ compiler; skipped without one).
"""

from __future__ import annotations

import functools
import shutil

import pytest
import torch

from ltcx.generation import generate
from ltcx.lm import LanguageModel
from ltcx.models.gpt import GPT
from ltcx.models.ltc import LTCGPT
from ltcx.models.titans import Titans
from ltcx.models.xlstm import XLSTM

VOCAB = 64
TINY = {
    "gpt": lambda: GPT(block_size=16, vocab_size=VOCAB, n_layer=2, n_head=2, n_kv_head=1, n_embd=16, bias=False),
    "ltc": lambda: LTCGPT(block_size=16, vocab_size=VOCAB, n_layer=2, n_head=2, n_kv_head=1, n_embd=16, bias=False,
                          num_decay_modes=4),
    "xlstm": lambda: XLSTM(vocab_size=VOCAB, embedding_dim=16, num_layers=2, slstm_at=[1], num_heads=2,
                           slstm_num_heads=2, chunk_size=4, proj_round_to=8),
    **{
        f"titans_{variant}": functools.partial(
            Titans, vocab_size=VOCAB, n_embd=16, n_layer=2, variant=variant, n_head=2, n_kv_head=1, mlp_hidden=32,
            window=4, segment=4, n_persistent=2, mem_heads=2, mem_head_dim=8, mem_hidden=16, memory_chunk_size=4,
        )
        for variant in ("mag", "mac", "mal", "lmm")
    },
}


def check_compiled_backbone(name: str, backend: str, monkeypatch, generation: bool) -> None:
    torch._dynamo.reset()
    real_compile = torch.compile
    monkeypatch.setattr(torch, "compile", functools.partial(real_compile, backend=backend, dynamic=False))
    torch.manual_seed(0)
    eager = LanguageModel(TINY[name]())
    compiled = LanguageModel(TINY[name]())
    compiled.load_state_dict(eager.state_dict())
    compiled.hparams.compile = True
    compiled.configure_model()  # what --model.compile true does
    assert "_compiled_logits" in compiled.__dict__
    batch = torch.randint(0, VOCAB, (2, 9), generator=torch.Generator().manual_seed(1))
    for model in (eager, compiled):
        model.loss(batch).backward()
    torch.testing.assert_close(compiled.loss(batch), eager.loss(batch), rtol=1e-5, atol=1e-5)
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
        tokens = generate(backbone, prompt, 5, temperature=0)
        torch.testing.assert_close(tokens, generate(eager.backbone, prompt, 5, temperature=0))


# MAL has both of Titans' block kinds (memory layer, sliding-window attention layer); MAG and MAC, whose
# unrolled memory chunks take a minute each to trace here, and LMM run with -m slow.
QUICK = ["gpt", "ltc", "xlstm", "titans_mal"]


@pytest.mark.parametrize("name", [*QUICK, *(pytest.param(n, marks=pytest.mark.slow) for n in sorted(TINY) if n not in QUICK)])
def test_compiled_step_equals_eager(name, monkeypatch):
    check_compiled_backbone(name, "aot_eager", monkeypatch, generation=name in ("gpt", "ltc"))


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(TINY))
def test_generation_runs_through_the_compiled_backbone(name, monkeypatch):
    check_compiled_backbone(name, "aot_eager", monkeypatch, generation=True)


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("g++") is None and shutil.which("c++") is None,
                    reason="Inductor compiles C++ on a CPU and no C++ compiler is installed (apt-get install g++)")
@pytest.mark.parametrize("name", sorted(TINY))
def test_inductor_compiled_step_equals_eager_and_generation_runs(name, monkeypatch):
    check_compiled_backbone(name, "inductor", monkeypatch, generation=True)
