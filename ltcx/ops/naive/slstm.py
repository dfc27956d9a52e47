"""Slow reference for ``ltcx/ops/slstm.py``: the paper's sLSTM, unstabilised, one token at a time."""

from __future__ import annotations

import torch


def slstm_reference(gates_x, R, forget_gate="sigmoid"):
    """The paper's sLSTM equations, unstabilised, one token at a time, with the full block-diagonal
    recurrent matrices: i = exp(i~), f = sigmoid(f~) (or exp), z = tanh, o = sigmoid,
    c = f c + i z, n = f n + i, h = o c / n, pre-activations W x + b + R h_{t-1}.

    gates_x [B, T, 4, H, Dh] (input parts W x + b, gate order i, f, z, o); R [4, H, Dh, Dh] block-diagonal
    recurrent weights; state starts at zero -> h [B, T, H, Dh]. Checks ``slstm_scan``."""
    B, T, _, H, Dh = gates_x.shape
    R_full = [torch.block_diag(*R[g]) for g in range(4)]  # [H*Dh, H*Dh], head h maps h_in -> h_out
    c = torch.zeros(B, H * Dh, dtype=gates_x.dtype)
    n = torch.zeros_like(c)
    h = torch.zeros_like(c)
    out = []
    for t in range(T):
        pre = [gates_x[:, t, g].reshape(B, H * Dh) + h @ R_full[g] for g in range(4)]
        i = torch.exp(pre[0])
        f = torch.sigmoid(pre[1]) if forget_gate == "sigmoid" else torch.exp(pre[1])
        z, o = torch.tanh(pre[2]), torch.sigmoid(pre[3])
        c = f * c + i * z
        n = f * n + i
        h = o * c / n
        out.append(h.reshape(B, H, Dh))
    return torch.stack(out, dim=1)
