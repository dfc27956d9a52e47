"""Fully sharded data parallel training (PyTorch's FSDP2, ``fully_shard``) through Lightning's
``ModelParallelStrategy``: each rank keeps 1/N of every parameter, its gradient and its optimizer state, and gathers a
block's full weights only while that block runs.

``FSDP2Strategy`` (what ``configs/trainer/fsdp.yaml`` names) is Lightning's strategy with one data-parallel dimension
over every process and full-state-dict checkpoints; ``LanguageModel.configure_model`` calls ``shard_backbone`` under
it. ``unsharded_class`` and ``unsharded_copy`` give back what sharding hides: the backbone's own class, and a plain
copy of the model for code that runs on one rank (sample generation).
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.pytorch.strategies import ModelParallelStrategy
from torch.distributed.fsdp import FSDPModule, fully_shard

from ltcx.errors import LtcxError

__all__ = ["FSDP2Strategy", "shard_backbone", "shard_units", "is_sharded", "unsharded_class", "unsharded_copy"]


def shard_units(backbone: nn.Module) -> list[nn.Module]:
    """The modules sharded one by one, each gathered only while it runs: the entries of the backbone's ``blocks``
    (an ``nn.ModuleList``, which every ltcx backbone has). The rest (embeddings, final norm, head: tied weights stay
    in one unit) is the backbone's own unit, gathered for the whole forward. A backbone without ``blocks`` is one
    unit: still sharded at rest, but gathered whole."""
    blocks = getattr(backbone, "blocks", None)
    return list(blocks) if isinstance(blocks, nn.ModuleList) else []


def is_sharded(module: nn.Module) -> bool:
    return isinstance(module, FSDPModule)


def unsharded_class(module: nn.Module) -> type:
    """The class of ``module`` as defined: ``fully_shard`` swaps in a subclass (``FSDPGPT`` of ``GPT``), which is no
    class a checkpoint may name."""
    return next(cls for cls in type(module).__mro__ if not issubclass(cls, FSDPModule))


def shard_backbone(
    backbone: nn.Module,
    mesh: Any,
    *,
    activation_checkpointing: bool = False,
) -> None:
    """Shard ``backbone`` in place over the 1-D device ``mesh``: each module of ``shard_units`` with ``fully_shard``,
    then the backbone itself (the rest). Parameter names, and so checkpoint keys, do not change. Does nothing to an
    already sharded backbone (Lightning calls ``configure_model`` again for a ``validate`` after ``fit``).

    The ranks' shards are then made rank 0's (FSDP2, unlike DDP, keeps each rank's slice of its own copy, so ranks
    that initialised differently would train a mixture). With ``activation_checkpointing`` each block's activations
    are recomputed in the backward pass instead of kept (torch's composable ``checkpoint``: names unchanged).
    """
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    if is_sharded(backbone):
        return
    several = dist.get_world_size(mesh.get_group()) > 1
    rank0_weights = backbone.state_dict() if several and dist.get_rank() == 0 else {}  # tensors, not copies
    units = shard_units(backbone)
    if activation_checkpointing:
        from torch.distributed._composable import checkpoint

        for unit in units:
            checkpoint(unit)
    for unit in units:
        fully_shard(unit, mesh=mesh, reshard_after_forward=True)
    # The root too (FSDP2 keeps the root's weights gathered after its forward by default): after a forward without a
    # backward (validation) they would stay gathered and be what parameters() returns and an optimizer step misses.
    fully_shard(backbone, mesh=mesh, reshard_after_forward=True)
    if several:  # each rank's shards from rank 0's weights, moved to the mesh's device as each rank's are
        options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
        set_model_state_dict(backbone, rank0_weights, options=options)


def unsharded_copy(backbone: nn.Module, device: torch.device | str = "cpu") -> nn.Module | None:
    """A plain copy of a sharded ``backbone`` (its own class, full weights, eval mode) on global rank 0, None on the
    other ranks. Every rank must call it: the weights are gathered from all of them."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    state = get_model_state_dict(backbone, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if dist.get_rank() != 0:
        return None
    copy = unsharded_class(backbone)(**backbone.config_dict())
    copy.load_state_dict(state)
    return copy.to(device).eval()


class FSDP2Strategy(ModelParallelStrategy):
    """Lightning's ``ModelParallelStrategy`` as ltcx uses it: FSDP2 over every process (one data-parallel dimension,
    no tensor parallelism), on GPUs (NCCL) or CPUs (gloo), checkpoints as one full state dict. Each block's weights
    are gathered for its forward, freed, and gathered again for its backward (ZeRO-3). Keeping them from the forward
    to the backward (FSDP2's ``reshard_after_forward=False``, its default for the root module) is not offered: after a
    forward without a backward (validation) the kept weights stay the module's parameters, so an optimizer step can
    miss the shards and the next forward reads stale weights (tried on every architecture: the weights and the
    evaluation after a step differed from the unsharded model's).

    Lightning's defaults are set for 2-D parallelism (data parallel across nodes, tensor parallel within one), which
    ltcx's backbones do not declare; here the data-parallel size is the world size and the tensor-parallel size 1.

    Checkpoints are full state dicts gathered on rank 0 (``save_distributed_checkpoint=False``) and written by the
    trainer's ``CheckpointIO`` (ltcx's ``SafeCheckpointIO``: atomic, digest, no non-finite weights), so a file loads
    in one process for ``generate`` / ``export`` and resumes under any strategy. A distributed checkpoint (a folder
    of per-rank shards written by ``torch.distributed.checkpoint``) bypasses the ``CheckpointIO``: it would carry no
    digest and need a conversion before one process could load it. The cost of the full state dict is rank 0's
    host memory: the whole model and its optimizer state, on the CPU, at each save.

    The file is the one a DDP or single-device run writes: the same weight names, the optimizer's parameters
    numbered in the order of its groups (Lightning's strategy numbers them in the model's parameter order and reads
    a number as that index: a DDP checkpoint resumed under it handed AdamW's moments to other parameters, a shape
    error in tests/test_sharding.py's check, silently wrong where the shapes match),
    and it is read back through the trainer's ``CheckpointIO`` (Lightning's strategy reads the file itself).

    Args:
        activation_checkpointing: recompute each block's activations in the backward pass instead of keeping them
            (less memory, about one more forward pass of compute).
        process_group_backend: ``nccl``, ``gloo``...; None: NCCL on GPUs, gloo on CPUs.
        timeout: of the collectives.
    """

    def __init__(
        self,
        activation_checkpointing: bool = False,
        process_group_backend: str | None = None,
        timeout: timedelta | None = default_pg_timeout,
    ) -> None:
        super().__init__(
            data_parallel_size="auto", tensor_parallel_size=1, save_distributed_checkpoint=False,
            process_group_backend=process_group_backend, timeout=timeout,
        )
        self.activation_checkpointing = activation_checkpointing

    def setup_environment(self) -> None:
        self._data_parallel_size = self.num_nodes * self.num_processes  # every process: the world size
        super().setup_environment()

    def optimizer_state(self, optimizer) -> dict[str, Any]:
        """The optimizer's full state on rank 0 (empty elsewhere; every rank gathers), its parameters numbered as
        ``torch.optim.Optimizer.state_dict`` numbers them: in the order of the parameter groups, as under DDP."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

        optimizer = getattr(optimizer, "_optimizer", optimizer)  # a LightningOptimizer's
        state = get_optimizer_state_dict(self.model, optimizer,
                                         options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        return _numbered_in_group_order(state) if state.get("param_groups") else state

    def load_checkpoint(self, checkpoint_path, weights_only: bool | None = None) -> dict[str, Any]:
        """Read the file through the trainer's ``CheckpointIO`` (ltcx's: the copy the CLI has read and checked, its
        digest included) and give each rank its shards of the weights and the optimizer state. Returns the rest,
        from which Lightning restores the loops, callbacks and schedulers."""
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            set_model_state_dict,
            set_optimizer_state_dict,
        )

        checkpoint = self.checkpoint_io.load_checkpoint(self.broadcast(checkpoint_path))
        options = StateDictOptions(full_state_dict=True, strict=self.lightning_module.strict_loading)
        set_model_state_dict(self.model, checkpoint.pop("state_dict"), options=options)
        for optimizer, state in zip(self.optimizers, checkpoint.get("optimizer_states", [])):
            optimizer = getattr(optimizer, "_optimizer", optimizer)
            set_optimizer_state_dict(self.model, optimizer, _named(state, optimizer, self.model), options=options)
        return checkpoint


def _numbered_in_group_order(state: dict[str, Any]) -> dict[str, Any]:
    """An optimizer state keyed by parameter name -> keyed by number, in the order of the parameter groups."""
    numbers: dict[str, int] = {}
    groups = [{**group, "params": [numbers.setdefault(name, len(numbers)) for name in group["params"]]}
              for group in state["param_groups"]]
    return {"state": {numbers[name]: value for name, value in state["state"].items()}, "param_groups": groups}


def _named(state: dict[str, Any], optimizer: torch.optim.Optimizer, model: nn.Module) -> dict[str, Any]:
    """An optimizer state keyed by number (``_numbered_in_group_order``, or a DDP or single-device checkpoint's)
    -> keyed by the names of ``optimizer``'s parameters in ``model``, matched by position in the groups."""
    names = {param: name for name, param in model.named_parameters()}
    current = [names[param] for group in optimizer.param_groups for param in group["params"]]
    saved = [number for group in state["param_groups"] for number in group["params"]]
    if len(saved) != len(current):
        raise LtcxError(f"the checkpoint's optimizer state holds {len(saved)} parameters, this model's optimizer "
                        f"{len(current)}: resume from a checkpoint of this model's optimizer, or start a new run")
    name_of = dict(zip(saved, current))
    return {"state": {name_of[number]: value for number, value in state["state"].items()},
            "param_groups": [{**group, "params": [name_of[n] for n in group["params"]]}
                             for group in state["param_groups"]]}
