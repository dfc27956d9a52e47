"""``Backbone``: the one contract every ltcx architecture keeps, with its defaults.

    logits [B, T, V], state = backbone(idx [B, T], state=None)
    loss_sum, count = backbone(idx [B, T], targets=targets [B, T])

``state`` is whatever the architecture carries between calls (a KV cache, recurrent states, memory weights); feeding
a sequence in pieces with the state gives the logits of feeding it whole. An architecture writes:

* ``config_class``: its config dataclass (``ltcx/models/config.py`` derives the constructor from it);
* ``forward_hidden(idx, state=None, with_state=True, mask=None) -> (hidden [B, T, C], new state or None)``:
  everything before the output head (``with_state=False``: the state is not wanted, so it need not be kept);
  ``mask`` [B, T] (bool, True = a real token; None = every token real) lets prompts of different lengths share a
  batch: a masked position leaves every part of the state as it was and does not count as a position, so each real
  position's hidden state equals that of its row's real tokens run alone; a masked position's output is finite
  and meaningless;
* ``output_head() -> nn.Linear``: the head applied to the hidden states;

and may override ``max_seq_len`` (a context limit), ``no_weight_decay_param_names``, ``reorder_cache`` and the
counts (``parameter_count``, ``forward_flops_per_token``, ``state_bytes``). ``forward`` is this class's: with
``targets`` it runs the head fused with the cross-entropy (``ltcx/ops/fused_loss.py``), never holding the
``[B, T, V]`` logits, so that the loss goes through ``forward`` too: FSDP gathers the root's parameters (the tied
embedding) around it and ``backbone.compile()`` compiles it, with no method attached from outside.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
import torch.nn as nn

from ltcx.models.config import ConfiguredModule
from ltcx.models.registry import BackboneType
from ltcx.models.state import reorder_state
from ltcx.ops.fused_loss import chunked_linear_cross_entropy

__all__ = ["Backbone", "run_blocks"]


class Backbone(ConfiguredModule, metaclass=BackboneType):
    """A sequence model keeping the contract (see the module's docstring); subclasses write ``forward_hidden`` and
    ``output_head``."""

    max_seq_len: int | None = None  # the context limit in tokens; None: none (recurrent state, rotary positions)

    def forward_hidden(self, idx: torch.Tensor, state: Any = None, with_state: bool = True,
                       mask: torch.Tensor | None = None) -> tuple[torch.Tensor, Any]:
        """idx [B, T] following ``state``'s positions, mask [B, T] or None -> (final hidden states [B, T, C], new
        state; None with ``with_state`` False)."""
        raise NotImplementedError(f"{type(self).__name__} must define forward_hidden")

    @property
    def takes_mask(self) -> bool:
        """Whether ``forward_hidden`` takes a padding mask (every ltcx architecture does); generation batches prompts
        of different lengths through it, and by length for a backbone that takes none."""
        return "mask" in inspect.signature(self.forward_hidden).parameters

    def output_head(self) -> nn.Linear:
        """The linear head from hidden states [..., C] to logits [..., V]."""
        raise NotImplementedError(f"{type(self).__name__} must define output_head")

    def forward(self, idx: torch.Tensor, state: Any = None, *, mask: torch.Tensor | None = None,
                targets: torch.Tensor | None = None, with_state: bool = True) -> tuple[torch.Tensor, Any]:
        """idx [B, T], mask [B, T] or None (see ``forward_hidden``) -> (logits [B, T, V], new state; None with
        ``with_state`` False).

        With ``targets`` [B, T] (``IGNORE_INDEX`` where nothing is asked; no ``state``, no ``mask``): (the summed
        cross-entropy of the asked targets [], their count []), the head fused with the loss."""
        if targets is not None:
            if state is not None or mask is not None:
                raise ValueError("a loss (targets given) starts from the empty state with every token real: pass "
                                 "state=None and mask=None (IGNORE_INDEX targets leave positions out of the loss)")
            hidden, _ = self.forward_hidden(idx, with_state=False)
            head = self.output_head()
            return chunked_linear_cross_entropy(hidden.flatten(0, -2), head.weight, targets.flatten(), head.bias)
        if state is None and not with_state and mask is None:
            hidden, _ = self.forward_hidden(idx, with_state=False)
            return self.output_head()(hidden), None
        return self._forward_with_state(idx, state, mask, with_state)

    @torch.compiler.disable
    def _forward_with_state(self, idx: torch.Tensor, state: Any, mask: torch.Tensor | None,
                            with_state: bool) -> tuple[torch.Tensor, Any]:
        # Prefill and decoding stay eager under backbone.compile(): a state's tensors as outputs of a compiled graph
        # (views of the caches) and a new graph per decoding length would cost more than they save.
        if mask is None:
            hidden, new_state = self.forward_hidden(idx, state, with_state)
        else:
            hidden, new_state = self.forward_hidden(idx, state, with_state, mask=mask)
        return self.output_head()(hidden), new_state

    def reorder_cache(self, state: Any, index: torch.Tensor) -> Any:
        """Reorder, repeat or drop batch rows of a state (beam search): row b becomes old row index[b]."""
        return reorder_state(state, index)

    def no_weight_decay_param_names(self) -> set[str]:
        """Matrices AdamW should not decay, besides every parameter of fewer than 2 dimensions (``ltcx/optim.py``)."""
        return set()

    def parameter_count(self, exclude_position_embeddings: bool = True) -> int:
        """Distinct parameters (tied ones once); a subclass with learned position embeddings leaves them out, as
        nanoGPT counts."""
        return sum(p.numel() for p in self.parameters())

    def forward_flops_per_token(self, seq_len: int) -> float:
        """Forward FLOPs per token (matrix products) when training on sequences of ``seq_len`` tokens."""
        raise NotImplementedError(f"{type(self).__name__} counts no FLOPs (forward_flops_per_token)")

    def flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs per token: forward + backward = 3 x forward (the backward forms the gradients of both
        operands of each product)."""
        return 3 * self.forward_flops_per_token(seq_len)


def run_blocks(blocks: nn.ModuleList, x: torch.Tensor, state: list | None, with_state: bool,
               mask: torch.Tensor | None) -> tuple[torch.Tensor, list | None]:
    """x [B, T, C] through a stack of recurrent blocks, each called as ``block(x, its state, with_state, mask) -> (x,
    its new state)``: (the last block's output, the list of new states; None with ``with_state`` False)."""
    if state is not None and len(state) != len(blocks):
        raise ValueError(f"state has {len(state)} entries but the model has {len(blocks)} blocks")
    new_state = []
    for i, block in enumerate(blocks):
        x, block_state = block(x, None if state is None else state[i], with_state, mask)
        new_state.append(block_state)
    return x, new_state if with_state else None
