"""The padding mask (``backbone(idx, state, mask=...)``, docs/architecture.md), checked for every entry of the catalogue
and each of its variants: prompts of different lengths share a batch, left-padded, right-padded or with a gap, and each
real position's logits and the greedy continuation equal those of its prompt run alone (float64), in one call and in
pieces (the cached or recurrent step); a fully masked row leaves the others as they were, and its state stays empty.
The masked attention op against its reference."""

from __future__ import annotations

import pytest
import torch

from helpers import relative_error
from ltcx.generation import generate
from ltcx.models.catalog import CATALOG
from ltcx.ops.attention import causal_gqa_attention
from ltcx.ops.naive.attention import naive_attention

pytestmark = pytest.mark.usefixtures("one_thread")

F64_REL = 1e-10
VOCAB = 64
LENGTHS = (6, 2, 9)  # 9 crosses Titans' segments and memory chunks (4) and the xLSTM's chunks (4)
NEW = 5  # greedy tokens after each prompt
SHAPES = [(name, variant) for name in sorted(CATALOG) for variant in CATALOG[name].shapes()]
SHAPE_IDS = [name if variant == "tiny" else f"{name}-{variant}" for name, variant in SHAPES]


def tokens(length: int, seed: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (length,), generator=torch.Generator().manual_seed(seed))


def tiny(name: str, variant: str):
    torch.manual_seed(0)
    return CATALOG[name].build_tiny(VOCAB, variant).double().eval()


def padded(prompts: list[torch.Tensor], layout: str) -> tuple[torch.Tensor, torch.Tensor]:
    """prompts in one batch [B, W] (the padding random tokens, so that a leak shows) and its mask [B, W]: ``left``
    (padding first), ``right`` (padding last) or ``gap`` (one padding token first, two inside the prompt, the rest
    last)."""
    width = max(len(p) for p in prompts) + 3
    idx = torch.randint(0, VOCAB, (len(prompts), width), generator=torch.Generator().manual_seed(99))
    mask = torch.zeros(len(prompts), width, dtype=torch.bool)
    for row, prompt in enumerate(prompts):
        n = len(prompt)
        if layout == "left":
            places = torch.arange(width - n, width)
        elif layout == "right":
            places = torch.arange(n)
        else:
            half = n // 2
            places = torch.cat([torch.arange(1, 1 + half), torch.arange(3 + half, 3 + n)])
        idx[row, places], mask[row, places] = prompt, True
    return idx, mask


def greedy_after(model, logits: torch.Tensor, mask: torch.Tensor, state, step_mask: bool) -> torch.Tensor:
    """NEW greedy tokens [B, NEW] after a masked prefill's logits [B, W, V] (each row's next token from its last real
    position) and state, one decode step at a time (``step_mask``: each step given an all-true mask, else none)."""
    last = mask.shape[1] - 1 - mask.flip(1).to(torch.uint8).argmax(1)  # each row's last real position
    token = logits[torch.arange(len(last)), last].argmax(-1)
    out = [token]
    for _ in range(NEW - 1):
        step = torch.ones(len(token), 1, dtype=torch.bool) if step_mask else None
        logits, state = model(token[:, None], state, mask=step)
        assert torch.isfinite(logits).all()
        token = logits[:, -1].argmax(-1)
        out.append(token)
    return torch.stack(out, 1)


@pytest.mark.parametrize("layout", ["left", "right", "gap"])
@pytest.mark.parametrize("name,variant", SHAPES, ids=SHAPE_IDS)
@torch.no_grad()
def test_a_padded_batch_gives_each_prompt_its_own_logits_and_continuation(name, variant, layout):
    """Whole and in pieces of 3, 1 and the rest (the pieces' masks sliced from the batch's), each real position's
    logits are its prompt's alone, every logit is finite, and greedy decoding from either state continues each prompt
    as ``generate`` continues it alone."""
    model = tiny(name, variant)
    prompts = [tokens(n, seed) for seed, n in enumerate(LENGTHS)]
    idx, mask = padded(prompts, layout)
    alone = [model(p[None])[0][0] for p in prompts]
    continued = [generate(model, p[None], NEW, temperature=0)[0, len(p):] for p in prompts]

    whole, state = model(idx, mask=mask)
    cuts = [0, 3, 4, idx.shape[1]]
    pieces, piece_state = [], None
    for start, end in zip(cuts, cuts[1:]):
        logits, piece_state = model(idx[:, start:end], piece_state, mask=mask[:, start:end])
        pieces.append(logits)
    for logits, last_state, step_mask in ((whole, state, False), (torch.cat(pieces, 1), piece_state, True)):
        assert torch.isfinite(logits).all()
        for row in range(len(prompts)):
            assert relative_error(logits[row, mask[row]], alone[row], norm="max") < F64_REL, row
        new = greedy_after(model, logits, mask, last_state, step_mask)
        for row in range(len(prompts)):
            assert torch.equal(new[row], continued[row]), row


@pytest.mark.parametrize("name,variant", SHAPES, ids=SHAPE_IDS)
@torch.no_grad()
def test_a_fully_masked_row_leaves_the_batch_and_its_state_as_they_were(name, variant):
    """A row masked throughout leaves the other rows' logits as they are without it, its own finite, and its state
    empty: the tokens it is then fed give the logits of those tokens alone."""
    model = tiny(name, variant)
    prompts = [tokens(n, seed) for seed, n in enumerate(LENGTHS[:2])]
    idx, mask = padded(prompts, "left")
    empty = torch.zeros(1, idx.shape[1], dtype=torch.bool)
    logits, _ = model(idx, mask=mask)
    with_empty, state = model(torch.cat([idx, idx[:1]]), mask=torch.cat([mask, empty]))
    assert torch.isfinite(with_empty).all()
    assert relative_error(with_empty[:2][mask], logits[mask], norm="max") < F64_REL
    later = tokens(6, seed=7)
    fed = torch.cat([prompts[0][-1:].repeat(6), prompts[1][-1:].repeat(6), later]).view(3, 6)
    after, _ = model(fed, state)
    assert torch.isfinite(after).all()
    assert relative_error(after[2], model(later[None])[0][0], norm="max") < F64_REL


@pytest.mark.parametrize("past", [0, 3])
def test_masked_attention_leaves_the_masked_keys_out(past):
    """``causal_gqa_attention(..., key_mask=)``: each row's real queries attend to that row's real keys alone (the
    reference on the row's real tokens), and masked queries are finite."""
    g = torch.Generator().manual_seed(0)
    batch, heads, kv_heads, length, dim = 3, 4, 2, 7, 5
    q = torch.randn(batch, heads, length, dim, generator=g, dtype=torch.float64)
    k, v = (torch.randn(batch, kv_heads, past + length, dim, generator=g, dtype=torch.float64) for _ in range(2))
    key_mask = torch.rand(batch, past + length, generator=g) < 0.6
    key_mask[2] = False
    out = causal_gqa_attention(q, k, v, key_mask=key_mask)
    assert torch.isfinite(out).all()
    for b in range(batch):
        real = key_mask[b].nonzero().flatten()
        new_real = real[real >= past]
        if len(new_real):
            expected = naive_attention(q[b:b + 1, :, new_real - past], k[b:b + 1, :, real], v[b:b + 1, :, real])
            torch.testing.assert_close(out[b, :, new_real - past], expected[0], rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("name", sorted(CATALOG))
def test_lm_eval_generate_until_batches_requests_of_different_lengths(name):
    """The lm-eval adapter's ``generate_until`` runs requests of different lengths in one padded batch: the texts
    are those of each request alone (batch_size 1), float64 greedy."""
    pytest.importorskip("lm_eval")
    from lm_eval.api.instance import Instance

    from ltcx.eval.harness import LtcxLM
    from ltcx.tokenizers import get_tokenizer

    torch.manual_seed(0)
    backbone, tokenizer = CATALOG[name].build_tiny(320).double().eval(), get_tokenizer("bytes")
    requests = [Instance("generate_until", {}, (prompt, {"until": [], "max_gen_toks": 6}), i)
                for i, prompt in enumerate(["Once upon", "Hi", "A dog sat on", "x"])]
    batched = LtcxLM(backbone, tokenizer, batch_size=4).generate_until(requests, disable_tqdm=True)
    alone = LtcxLM(backbone, tokenizer, batch_size=1).generate_until(requests, disable_tqdm=True)
    assert batched == alone and all(batched)
