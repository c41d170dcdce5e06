"""Data parallelism for the trainer: the ranks of one ``torch.distributed`` group train each batch together.

``torchrun --nproc-per-node N -m services.trainer`` starts N ranks. Rank 0 is the trainer the loop
describes (it consumes manifests, fetches their groups, checkpoints, publishes, commits); it hands each
batch to every rank (:meth:`Ranks.broadcast`), each rank scores its shard of the samples (every
``world``-th, from its rank), and the shards' gradients are summed (:meth:`Ranks.all_sum`) before one
identical AdamW step on every rank: the loss is normalised by the whole batch's trained tokens, so the
sum is the full batch's gradient and every rank's weights stay equal to the one-rank result (within
float summation order). Collective ops run on ``gloo`` on CPU and ``nccl`` on GPUs.

:data:`ALONE` is the one-process case: every operation is the identity, so a trainer started
without torchrun is exactly the single-process trainer.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Protocol

import torch
import torch.distributed as dist

IDLE_TIMEOUT = timedelta(days=7)
"""Bound on a collective: the other ranks wait in ``broadcast`` while rank 0 waits for manifests, which
can take as long as rollouts do. A rank that dies ends the job through torchrun, not through this bound."""


class Ranks(Protocol):
    """The trainer's view of its process group."""

    @property
    def rank(self) -> int: ...

    @property
    def world(self) -> int: ...

    def all_sum(self, tensor: torch.Tensor) -> None:
        """Sum ``tensor`` over the ranks, in place."""
        ...

    def all_gather(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        """Every rank's ``tensor`` (1-D, any length), in rank order."""
        ...

    def broadcast(self, obj: Any) -> Any:
        """Rank 0's ``obj`` on every rank (picklable)."""
        ...

    def barrier(self) -> None: ...


@dataclass(frozen=True)
class Alone:
    """One process: rank 0 of 1."""

    rank: int = 0
    world: int = 1

    def all_sum(self, tensor: torch.Tensor) -> None:
        return None

    def all_gather(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        return [tensor]

    def broadcast(self, obj: Any) -> Any:
        return obj

    def barrier(self) -> None:
        return None


ALONE = Alone()


class TorchRanks:
    """The default ``torch.distributed`` process group (already initialised)."""

    def __init__(self) -> None:
        self.rank = dist.get_rank()
        self.world = dist.get_world_size()

    def all_sum(self, tensor: torch.Tensor) -> None:
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM)

    def all_gather(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        out: list[Any] = [None] * self.world
        dist.all_gather_object(out, tensor.cpu())
        return [t.to(tensor.device) for t in out]

    def broadcast(self, obj: Any) -> Any:
        box = [obj if self.rank == 0 else None]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def barrier(self) -> None:
        dist.barrier()


def join(device_type: str) -> Ranks:
    """The process group torchrun started this process in (``ALONE`` when it did not): ``nccl`` for a CUDA
    trainer, each rank on the GPU of its local rank, ``gloo`` otherwise."""
    if not dist.is_torchelastic_launched():
        return ALONE
    if device_type == "cuda":
        torch.cuda.set_device(dist.get_node_local_rank())  # one GPU per rank: "cuda" then means this rank's
    if not dist.is_initialized():
        dist.init_process_group("nccl" if device_type == "cuda" else "gloo", timeout=IDLE_TIMEOUT)
    return TorchRanks()


def leave(ranks: Ranks) -> None:
    if isinstance(ranks, TorchRanks) and dist.is_initialized():
        dist.destroy_process_group()
