"""Slow, obviously correct references for the ops in ``ltcx/ops/``, one module per op file (as
flash-linear-attention keeps ``naive.py`` beside its kernels): the equation written out, loops over tokens
and queries, float64 oracles. The tests compare the fast forms against them; users may too.

Nothing here is fast or meant for training, and ``ltcx.ops`` does not import this package: import the
module you need, e.g. ``from ltcx.ops.naive.ltc import ltc_attention_reference``.

- ``attention.py``: ``naive_attention`` (causal GQA), ``rope_matrix`` and ``reference_rope`` (RoPE),
  ``reference_attention`` (persistent slots, RoPE, any mask) for ``ltcx/ops/attention.py``
- ``conv.py``: ``causal_conv_reference`` for ``ltcx/ops/conv.py``
- ``fused_loss.py``: ``linear_cross_entropy_reference`` for ``ltcx/ops/fused_loss.py``
- ``gated_delta.py``: ``gated_delta_reference`` for ``ltcx/ops/gated_delta.py``
- ``ltc.py``: ``ltc_attention_reference`` for ``ltcx/ops/ltc.py``
- ``mlstm.py``: ``mlstm_parallel_naive`` for ``ltcx/ops/mlstm.py``
- ``slstm.py``: ``slstm_reference`` for ``ltcx/ops/slstm.py``
- ``ssd.py``: ``ssd_reference`` for ``ltcx/ops/ssd.py``
- ``titans.py``: ``reference_memory``, ``paper_recurrence``, ``gradients_at_init`` (and their pieces
  ``_gelu``, ``_read``, ``_autograd_step``) for ``ltcx/ops/titans.py``
"""
