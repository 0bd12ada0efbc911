"""The checkpoint: everything needed to continue (weights, optimizer, schedule and loss scale, how far training got),
saved at every epoch's end and on a stop. Two formats:
- torch.save (single, dp, ddp): every rank holds the whole model, rank 0 writes one file;
- DCP, torch.distributed.checkpoint (fsdp2, tp, 2d, pp): no rank holds the whole model, every rank writes its own
  shards into one folder, and reads back what ITS shards need, whatever the number of ranks that wrote them.
"""
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict, get_state_dict,
                                                     set_state_dict)
from torch.nn.parallel import DistributedDataParallel as DDP

from common.files import atomic_save, replace_folder


def rest(run) -> dict:
    """What both formats save besides the model and the optimizer."""
    return {"scheduler": run.scheduler.state_dict(),
            **({"scaler": run.scaler.state_dict()} if run.scaler is not None else {}),  # float16: the loss scale
            "position": run.position.state_dict(),  # a collective (all_gather_object): every rank's random state
            "history": run.history.state_dict(), "run": run.checkpoints.run}


def load_rest(checkpoint: dict, run) -> None:
    run.scheduler.load_state_dict(checkpoint["scheduler"])
    if checkpoint.get("scaler"):  # float16 runs: the loss scale reached (other runs save an empty one)
        run.scaler.load_state_dict(checkpoint["scaler"])
    run.position.load_state_dict(checkpoint["position"])
    run.history.load_state_dict(checkpoint["history"], run.position.epoch)


class TorchSave:
    """single, dp, ddp: one file, written by rank 0 (the replicas are identical), read by every rank."""

    @staticmethod
    def net(model: nn.Module) -> nn.Module:
        return model.module if isinstance(model, (nn.DataParallel, DDP)) else model  # the plain Net inside the wrap

    def state(self, run) -> dict:
        return {"model": self.net(run.model).state_dict(), "optimizer": run.optimizer.state_dict(), **rest(run)}

    def save(self, path, run) -> None:
        # Every rank builds the state: position.state_dict() gathers every rank's random state (a collective).
        state = self.state(run)
        if not dist.is_initialized() or dist.get_rank() == 0:
            atomic_save(state, path)  # a temporary file renamed into place: a crash never leaves half a checkpoint
        if dist.is_initialized():
            dist.barrier()  # no rank goes on (or reads it) before the file is complete

    def load(self, path, run) -> None:
        # map_location puts rank 0's saved tensors on THIS rank's device.
        checkpoint = torch.load(path, map_location=run.device, weights_only=True)  # tensors and plain data, never code
        self.net(run.model).load_state_dict(checkpoint["model"])
        run.optimizer.load_state_dict(checkpoint["optimizer"])
        load_rest(checkpoint, run)


class DCP:
    """fsdp2, tp, 2d, pp: get_state_dict gives this rank's shards as DTensors (no copies); dcp.save writes them."""

    def __init__(self, options: StateDictOptions | None = None):
        self.options = options

    def state(self, run) -> dict:
        model_state, optimizer_state = get_state_dict(run.model, run.optimizer, options=self.options)
        return {"model": model_state, "optimizer": optimizer_state, **rest(run)}

    def save(self, path, run) -> None:
        scratch = path.with_name(path.name + ".tmp")
        dcp.save(self.state(run), checkpoint_id=scratch)  # every rank its own shards, in parallel
        dist.barrier()  # every rank's shards are on disk
        if dist.get_rank() == 0:
            replace_folder(scratch, path)  # only a complete checkpoint gets the name (an older one of it goes)
        dist.barrier()

    def check(self, path, checkpoint: dict, run) -> None:
        """A strategy's own check of what was read, before it is loaded."""

    def load(self, path, run) -> None:
        checkpoint = self.state(run)
        saved = dcp.FileSystemReader(path).read_metadata().state_dict_metadata
        if run.scaler is not None and "scaler.scale" not in saved:
            checkpoint["scaler"] = {}  # a run without float16 saved no loss scale: a float16 one starts a fresh scale
        dcp.load(checkpoint, checkpoint_id=path)  # in place, into the tensors of `checkpoint`
        self.check(path, checkpoint, run)
        set_state_dict(run.model, run.optimizer, model_state_dict=checkpoint["model"],
                       optim_state_dict=checkpoint["optimizer"], options=self.options)
        load_rest(checkpoint, run)


def export_full(model: nn.Module, path) -> None:
    """model_full.pt, one plain file for inference: the full weights, gathered onto rank 0's CPU (all-gathers)."""
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if dist.get_rank() == 0:
        atomic_save(full, path)  # loads into a plain Net (or TPNet)
