"""One rank of `test_sharding.py`'s 2-process check of every catalogue architecture under FSDP2 (gloo, CPU, float64).

Run as ``python sharded_catalogue.py OUT_JSON`` with torch.distributed's environment (RANK, WORLD_SIZE, MASTER_ADDR,
MASTER_PORT). For each architecture, a copy (rank 1's initialised differently) sharded by
``ltcx.sharding.shard_backbone`` (with and without activation checkpointing) and the unsharded model run the same steps:
an evaluation forward, a training step on each rank's own batch (the unsharded model on both ranks' batches together, as
data parallelism averages them), AdamW, and the evaluation forward again. Rank 0 writes, per architecture and variant,
the largest relative differences, each rank's share of the parameters and the size of the activations the training
forward kept for the backward."""

from __future__ import annotations

import copy
import json
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

from ltcx.models.catalog import CATALOG
from ltcx.sharding import shard_backbone, shard_units

VOCAB, B, T = 48, 2, 12
VARIANTS = {  # shard_backbone's options
    "sharded": {},
    "checkpointed": {"activation_checkpointing": True},
}


def full(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def local_numel(model: torch.nn.Module) -> int:
    return sum((p.to_local() if isinstance(p, DTensor) else p).numel() for p in model.parameters())


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-300)).item()


def steps(model: torch.nn.Module, batches: torch.Tensor, rank: int | None) -> dict[str, torch.Tensor]:
    """eval logits, loss, gradients (full), AdamW step, eval logits; ``rank`` None: every batch (unsharded model)."""
    probe = batches[0, :, :-1]
    mine = batches.reshape(-1, T + 1) if rank is None else batches[rank]
    out = {}
    model.eval()
    with torch.no_grad():
        out["eval_before"] = model(probe)[0]
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.numel()) or t, lambda t: t):
        logits, _ = model(mine[:, :-1])
    out["saved_numel"] = sum(saved)
    loss = F.cross_entropy(logits.reshape(-1, VOCAB), mine[:, 1:].reshape(-1))
    loss.backward()
    out["grads"] = torch.cat([full(p.grad).reshape(-1) for p in model.parameters()])
    optimizer.step()
    model.eval()
    with torch.inference_mode():  # Lightning validates in inference mode
        out["eval_after"] = model(probe)[0].clone()
    out["weights"] = torch.cat([full(p.detach()).reshape(-1) for p in model.parameters()])
    return out


def main(path: str) -> None:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,))
    torch.set_default_dtype(torch.float64)
    results = {}
    for name, entry in CATALOG.items():
        torch.manual_seed(0)  # the same model and batches on every rank
        reference = entry.build_tiny(VOCAB)
        batches = torch.randint(0, VOCAB, (world, B, T + 1))
        sharded = {variant: copy.deepcopy(reference) for variant in VARIANTS}
        expected = steps(reference, batches, None)
        total = sum(p.numel() for p in reference.parameters())
        result = {"units": len(shard_units(reference))}
        for key, model in sharded.items():
            if rank == 1:  # a rank that initialised differently: shard_backbone starts from rank 0's weights
                with torch.no_grad():
                    for param in model.parameters():
                        param.add_(1.0)
            shard_backbone(model, mesh, **VARIANTS[key])
            shares = [torch.zeros(1, dtype=torch.int64) for _ in range(world)]
            dist.all_gather(shares, torch.tensor([local_numel(model)]))
            got = steps(model, batches, rank)
            result[key] = {k: rel(got[k], expected[k]) for k in expected if k != "saved_numel"}
            result[key]["saved_numel"] = got["saved_numel"]
            result[key]["shares"] = [int(s) / total for s in shares]
            result[key]["names"] = [n for n, _ in model.named_parameters()] == [
                n for n, _ in reference.named_parameters()]
        results[name] = result
    if rank == 0:
        with open(path, "w") as f:
            json.dump(results, f)
    dist.barrier()  # both ranks done before either tears gloo down: a rank torn down mid-exchange aborts (SIGABRT)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
