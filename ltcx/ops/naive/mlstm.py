"""Slow reference for ``ltcx/ops/mlstm.py``: the stabilised parallel mLSTM of one head, built with plain
Python loops over queries and keys."""

from __future__ import annotations

import math

import torch

from ltcx.ops.mlstm import EPS


def mlstm_parallel_naive(q, k, v, i_pre, f_pre):
    """log D_ij = sum_{l=j+1..i} log f_l + i~_j, m_i = max_j log D_ij, C = (q k^T/sqrt(d)) exp(log D - m),
    h_i = sum_j C_ij v_j / (max(|sum_j C_ij|, exp(-m_i)) + eps), built with plain loops; f = sigmoid(f~).

    One head: q, k, v [T, D]; i_pre, f_pre [T] (the gate pre-activations i~, f~) -> h [T, D] float64.
    ``mlstm_parallel`` on the same inputs with batch and head dimensions of 1 must equal it."""
    T, D = q.shape
    log_f = [math.log(1.0 / (1.0 + math.exp(-x))) for x in f_pre.tolist()]
    h_ref = torch.zeros(T, D, dtype=torch.float64)
    for i in range(T):
        log_d = [sum(log_f[j + 1 : i + 1]) + i_pre[j].item() for j in range(i + 1)]
        m = max(log_d)
        c = [float(q[i] @ k[j]) / math.sqrt(D) * math.exp(log_d[j] - m) for j in range(i + 1)]
        den = max(abs(sum(c)), math.exp(-m)) + EPS
        h_ref[i] = sum(c[j] * v[j] for j in range(i + 1)) / den
    return h_ref
