"""Titans attention ops (spec §A.5.0, A.8 test 8): rotate-half RoPE, persistent (position-free) key/value slots
next to RoPE'd token keys under a boolean mask, GQA, and the sliding-window mask, each against a slow reference
(``ltcx/ops/naive/attention.py``) written from the definition: explicit 2×2 rotation matrices, and a per-query loop
that lists the visible keys.
"""

from __future__ import annotations

import pytest
import torch

from helpers import assert_rel, rope_at
from ltcx.ops.attention import (
    attention_with_persistent,
    sliding_window_attention,
    sliding_window_mask,
    window_plan,
)
from ltcx.ops.naive.attention import reference_attention, reference_rope, rope_matrix

B, H, H_KV, D, N_P = 2, 4, 2, 8, 3


pytestmark = [pytest.mark.quick, pytest.mark.usefixtures("one_thread")]  # tiny tensors: see conftest.py


def _window(query_positions, key_positions, window):
    """Sliding window with absolute positions: key j visible to query i iff pos_i − window < pos_j ≤ pos_i."""
    return lambda i, j: query_positions[i] - window < key_positions[j] <= query_positions[i]


def _qkv(length, keys, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, length, D, generator=g, dtype=torch.float64)
    k, v = (torch.randn(B, H_KV, keys, D, generator=g, dtype=torch.float64) for _ in range(2))
    pk, pv = (torch.randn(H_KV, N_P, D, generator=g, dtype=torch.float64) for _ in range(2))
    return q, k, v, pk, pv


def _fast(q, k, v, pk, pv, query_positions, key_positions, mask):
    qp, kp = torch.tensor(query_positions), torch.tensor(key_positions)
    return attention_with_persistent(q, rope_at(q, qp), rope_at(k, kp), v, pk, pv, mask)


# ----------------------------------------------------------------------------- RoPE


def test_rope_reference_is_a_rotation_group_in_position():
    """The reference itself: R(p) is orthogonal, R(0) = I and R(a) R(b) = R(a + b) (hence (R_i q)·(R_j k) =
    q·R(j − i) k depends on i − j only)."""
    eye = torch.eye(D, dtype=torch.float64)
    assert_rel(rope_matrix(0, D), eye, what="R(0)")
    for a, b in ((3, 5), (17, -4), (1000, 7)):
        assert_rel(rope_matrix(a, D).T @ rope_matrix(a, D), eye, what="orthogonal")
        assert_rel(rope_matrix(a, D) @ rope_matrix(b, D), rope_matrix(a + b, D), what="group")


@pytest.mark.parametrize("base", [10000.0, 500.0])
def test_apply_rope_equals_rotation_matrices(base):
    """``apply_rope`` (rotate-half, inv_freq_i = base^(−2i/D)) equals the explicit 2×2 rotation per frequency
    pair, on [B, H, T, D] inputs at arbitrary (non-contiguous) absolute positions, float64."""
    x = torch.randn(B, H, 6, D, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    positions = [0, 1, 5, 130, 4095, 100_003]
    assert_rel(rope_at(x, torch.tensor(positions), base=base), reference_rope(x, positions, base))


def test_per_row_rope_tables_rotate_each_row_at_its_own_positions():
    """Tables of per-row positions [B, T] rotate row b of x [B, H, T, D] as tables of its positions [T] do."""
    x = torch.randn(B, H, 4, D, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    positions = torch.tensor([[0, 1, 2, 2], [7, 8, 30, 31]])
    rotated = rope_at(x, positions)
    for row in range(B):
        assert torch.equal(rotated[row], rope_at(x[row], positions[row]))


def test_rope_scores_depend_only_on_the_offset():
    """(R_i q)·(R_j k) computed with ``apply_rope`` is the same for (i, j) and (i + s, j + s), s up to 10,000
    (tolerance 1e-11: an angle of 1e4 rad carries ~1e-12 absolute round-off in float64)."""
    g = torch.Generator().manual_seed(2)
    q, k = (torch.randn(D, generator=g, dtype=torch.float64) for _ in range(2))

    def score(i, j):
        return rope_at(q[None], torch.tensor([i])) @ rope_at(k[None], torch.tensor([j]))[0]

    for i, j in ((0, 0), (7, 3), (3, 7), (40, 1)):
        base_score = score(i, j)
        for shift in (1, 13, 1000, 10_000):
            assert_rel(score(i + shift, j + shift), base_score, tol=1e-11, what=f"({i},{j})+{shift}")


# ----------------------------------------------------------------------------- masks and attention


@pytest.mark.parametrize("window", [1, 3, 100])
def test_sliding_window_mask_definition(window):
    """Key j visible to query i iff pos_i − window < pos_j ≤ pos_i, for a cached prefix (keys start before the
    queries) and absolute positions far from 0."""
    query_positions, key_positions = list(range(505, 510)), list(range(498, 510))
    visible = _window(query_positions, key_positions, window)
    expected = torch.tensor([[visible(i, j) for j in range(len(key_positions))] for i in range(len(query_positions))])
    mask = sliding_window_mask(torch.tensor(query_positions), torch.tensor(key_positions), window)
    assert mask.dtype == torch.bool and torch.equal(mask, expected)


@pytest.mark.parametrize("window", [1, 3, 64], ids=lambda w: f"window={w}")
@pytest.mark.parametrize("prefix", [False, True], ids=["no-cache", "cached-prefix"])
def test_attention_with_persistent_equals_per_query_loop(prefix, window):
    """RoPE + persistent slots + sliding window + GQA (H = 4 over H_kv = 2) against the per-query loop, float64.
    With a cached prefix the T = 5 queries sit at P..P+T−1 (P = 40) and the L = 9 keys at P−L+T..P+T−1; window
    64 ≥ L is plain causal attention."""
    length, keys, start = (5, 9, 40) if prefix else (6, 6, 0)
    query_positions = list(range(start, start + length))
    key_positions = list(range(start + length - keys, start + length))
    q, k, v, pk, pv = _qkv(length, keys, seed=3)
    mask = sliding_window_mask(torch.tensor(query_positions), torch.tensor(key_positions), window)
    expected = reference_attention(q, k, v, pk, pv, query_positions, key_positions,
                                   _window(query_positions, key_positions, window))
    assert_rel(_fast(q, k, v, pk, pv, query_positions, key_positions, mask), expected)


SLIDING_CASES = {  # (queries T, cached keys before them, window, first position P)
    "one-block": (6, 0, 4, 0),  # L = 6 <= 2 window: the single call
    "blocks": (13, 0, 3, 0),  # blocks of 3, the last one short
    "blocks-exact": (12, 0, 3, 0),
    "window-1": (7, 0, 1, 0),  # each query sees itself alone
    "cached-prefix": (11, 2, 3, 40),  # a cache of window - 1 keys: the first block's span begins inside it
    "short-cache": (11, 1, 3, 40),  # fewer cached keys than the window (the span padded before them)
    "long-cache": (9, 6, 3, 40),  # more cached keys than any query sees (dropped)
    "one-query": (1, 2, 3, 17),  # a decode step
}


@pytest.mark.parametrize("case", SLIDING_CASES, ids=list(SLIDING_CASES))
def test_sliding_window_attention_equals_per_query_loop(case):
    """``sliding_window_attention`` (the single masked call, or queries in blocks of ``window`` each against its
    2 window - 1 keys) against the per-query loop in float64: outputs, and the gradients of every input equal
    the single call's (``attention_with_persistent`` under ``sliding_window_mask``, itself held to the loop
    above)."""
    length, cached, window, start = SLIDING_CASES[case]
    keys = cached + length
    query_positions = list(range(start, start + length))
    key_positions = list(range(start - cached, start + length))
    q, k, v, pk, pv = _qkv(length, keys, seed=7)
    qp, kp = torch.tensor(query_positions), torch.tensor(key_positions)
    leaves = [t.requires_grad_() for t in (q, k, v, pk, pv)]

    def blocked():
        plan = window_plan(start, length, keys, window, pk.shape[1], q.shape[0], q.device)
        return sliding_window_attention(q, rope_at(q, qp), rope_at(k, kp), v, pk, pv, plan)

    def single():
        return _fast(q, k, v, pk, pv, query_positions, key_positions, sliding_window_mask(qp, kp, window))

    expected = reference_attention(q.detach(), k.detach(), v.detach(), pk.detach(), pv.detach(), query_positions,
                                   key_positions, _window(query_positions, key_positions, window))
    out = blocked()
    assert_rel(out, expected, what="output")
    cotangent = torch.randn(out.shape, generator=torch.Generator().manual_seed(8), dtype=out.dtype)
    for name, grad, grad_single in zip("q k v pk pv".split(), torch.autograd.grad(out, leaves, cotangent),
                                       torch.autograd.grad(single(), leaves, cotangent)):
        assert_rel(grad, grad_single, what=f"d/d{name}")


def test_attention_with_persistent_any_mask_including_empty_rows():
    """The mask is any [T, L] boolean (MAC needs a non-window one): a random mask with one all-False row, whose
    query then reads the persistent slots only, against the per-query loop."""
    q, k, v, pk, pv = _qkv(5, 7, seed=4)
    mask = torch.rand(5, 7, generator=torch.Generator().manual_seed(5)) < 0.5
    mask[2] = False
    positions = list(range(7))
    expected = reference_attention(q, k, v, pk, pv, positions[2:], positions, lambda i, j: bool(mask[i, j]))
    assert_rel(_fast(q, k, v, pk, pv, positions[2:], positions, mask), expected)


def test_persistent_scores_do_not_depend_on_position():
    """Shifting every query and key position by 1,000 leaves the output unchanged (float64 ≤ 1e-12): token-token
    scores depend only on offsets and persistent slots are scored with the unrotated query. A persistent score
    taken with the RoPE'd query would move with the shift (checked: that output differs)."""
    q, k, v, pk, pv = _qkv(5, 9, seed=6)
    query_positions, key_positions = list(range(4, 9)), list(range(0, 9))
    mask = sliding_window_mask(torch.tensor(query_positions), torch.tensor(key_positions), 4)
    out = _fast(q, k, v, pk, pv, query_positions, key_positions, mask)
    shifted = _fast(q, k, v, pk, pv, [p + 1000 for p in query_positions], [p + 1000 for p in key_positions], mask)
    assert_rel(shifted, out)

    def rotated_persistent(shift):  # the wrong design: persistent slots scored with the rotated query
        q_rot = rope_at(q, torch.tensor(query_positions) + shift)
        return attention_with_persistent(q_rot, q_rot, rope_at(k, torch.tensor(key_positions) + shift), v,
                                         pk, pv, mask)

    assert (rotated_persistent(1000) - rotated_persistent(0)).abs().max() > 1e-3
