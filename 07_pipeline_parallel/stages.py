"""Lesson 07's stages as modules: Stage, some of Net's layers run as Net runs them; stage_blocks, the cut
(mnist_ppmodel.py uses these two). The trainer's (trainer/pp.py) also: init_weights, the values Net() draws, each
rank keeping its stages' layers; replicas and check_resume, what a mid-epoch checkpoint needs of a resumed layout."""
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.tensor import DTensor, distribute_tensor

from common.errors import CourseError
from common.model import Net, model_flags


def stage_blocks(blocks: int, stages: int) -> list[range]:
    """The blocks of each stage, as even as can be; the extra ones go last (stage 0 also holds fc1: 9216 inputs)."""
    sizes = [blocks // stages + (s >= stages - blocks % stages) for s in range(stages)]
    return [range(sum(sizes[:s]), sum(sizes[:s + 1])) for s in range(stages)]


def replicas(model: nn.Module) -> int:
    """The data-parallel replicas of each stage: FSDP2's mesh ("dp") under --dp, else 1."""
    p = next(model.parameters())
    return p.device_mesh.size() if isinstance(p, DTensor) else 1


def check_resume(path, checkpoint: dict, model: nn.Module) -> None:
    """Another --pp-schedule, --dp or number of stages resumes (DCP reads each layer by name, resharded), but a
    checkpoint saved mid-epoch needs its own --dp: the rest of that epoch's batches were cut for that many pipelines."""
    (epoch, step), dp = (checkpoint["position"][k] for k in ("epoch", "step")), checkpoint["dp"]
    if step and dp != replicas(model):
        raise CourseError(f"{path} stopped at step {step} of epoch {epoch} with --dp {dp}: finish that epoch with "
                          f"--dp {dp} (another --pp-schedule or number of stages may change; --dp after an epoch)")


class Stage(nn.Module):
    """Some of Net's layers, under Net's own names: the head (features, fc1) if first, blocks, fc2 if last."""

    def __init__(self, net: Net, blocks, first: bool, last: bool, amp_dtype=None):
        super().__init__()
        self.first, self.last, self.amp_dtype = first, last, amp_dtype
        if first:
            self.features, self.fc1, self.dropout = net.features, net.fc1, net.dropout
        self.blocks = nn.ModuleDict({str(i): net.blocks[i] for i in blocks})  # keys: Net's block numbers
        if last:
            self.fc2 = net.fc2

    def units(self) -> list[nn.Module]:
        """Its layers, as FSDP2's units: features, fc1, each block, fc2 (those it holds)."""
        head, tail = [self.features, self.fc1] if self.first else [], [self.fc2] if self.last else []
        return [*head, *self.blocks.values(), *tail]

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # Net.forward, from this stage's first layer to its last
        with torch.autocast(x.device.type, dtype=self.amp_dtype, enabled=self.amp_dtype is not None):
            if self.first:
                x = self.dropout(F.relu(self.fc1(torch.flatten(self.features(x), 1))))
            for block in self.blocks.values():
                x = block(x)
            return F.log_softmax(self.fc2(x), dim=1) if self.last else x


@torch.no_grad()
def init_weights(model, args):
    """What Net's own initialisation draws after torch.manual_seed(seed), each rank keeping its layers (all of a
    layer, or its FSDP2 shard). Every rank draws every module's numbers: the random stream stays Net()'s."""
    torch.manual_seed(args.seed)
    with torch.device("meta"):
        twin = Net(**model_flags(args))  # an unsplit twin, shapes only
    mine = dict(model.named_modules())  # my stages' layers, under Net's names
    for name, full in twin.named_modules():  # conv1, conv2, fc1, each block, fc2: Net's order
        if not list(full.parameters(recurse=False)):
            continue
        full.to_empty(device="cpu", recurse=False)  # this module's full tensors for a moment, never the whole model
        full.reset_parameters()  # the module's own initialisation, as in Net()
        for p, value in zip(mine[name].parameters(recurse=False) if name in mine else (),
                            full.parameters(recurse=False)):
            p.copy_(distribute_tensor(value, p.device_mesh, p.placements, src_data_rank=None)
                    if isinstance(p, DTensor) else value)
        full.to_empty(device="meta", recurse=False)  # and free it
