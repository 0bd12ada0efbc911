"""The classic MNIST CNN of pytorch/examples, with a width knob for the FSDP memory lesson."""
import torch
import torch.nn as nn
import torch.nn.functional as F


class Net(nn.Module):
    """conv 1->32 -> conv 32->64 -> max-pool -> dropout -> fc 9216->128 -> fc 128->10 -> log-softmax.

    ``width`` multiplies every hidden size, so parameters grow about as width**2
    (width 1: 1.2 M, width 10: about 120 M), while the input and the 10 classes stay.
    ``batch_norm`` adds BatchNorm after each conv (for lesson 04's --sync-bn); off in the classic net.
    """

    def __init__(self, width: int = 1, batch_norm: bool = False):
        super().__init__()
        if width < 1:
            raise ValueError(f"width must be >= 1, got {width}")
        c1, c2, hidden = 32 * width, 64 * width, 128 * width
        self.conv1 = nn.Conv2d(1, c1, 3, 1)
        self.conv2 = nn.Conv2d(c1, c2, 3, 1)
        self.bn1 = nn.BatchNorm2d(c1) if batch_norm else nn.Identity()
        self.bn2 = nn.BatchNorm2d(c2) if batch_norm else nn.Identity()
        self.dropout1 = nn.Dropout(0.25)
        self.dropout2 = nn.Dropout(0.5)
        self.fc1 = nn.Linear(c2 * 12 * 12, hidden)
        self.fc2 = nn.Linear(hidden, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.bn1(self.conv1(x)))
        x = F.relu(self.bn2(self.conv2(x)))
        x = F.max_pool2d(x, 2)
        x = torch.flatten(self.dropout1(x), 1)
        x = self.dropout2(F.relu(self.fc1(x)))
        return F.log_softmax(self.fc2(x), dim=1)


def count_parameters(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


@torch.no_grad()
def init_sharded(model: nn.Module, seed: int) -> None:
    """Give a model built on the meta device, sharded (FSDP2) and moved with ``to_empty()`` exactly the values
    that ``torch.manual_seed(seed); Net(...)`` draws eagerly, while no rank ever holds the whole model.

    fully_shard broadcasts nothing, so every rank must draw the same numbers. Eagerly, each layer's
    constructor calls its ``reset_parameters()`` in the order ``Net.__init__`` creates the layers, which
    is the order ``model.modules()`` lists them. So: seed, then for each module in that order, give it
    plain full-size CPU tensors for a moment, let its own ``reset_parameters()`` fill them, keep this
    rank's shard (``distribute_tensor(..., src_data_rank=None)``: every rank cuts its own piece, no
    communication) and drop the rest. Extra memory: one layer, never the model.
    (``reset_parameters()`` on the sharded DTensors themselves would NOT reproduce eager init: DTensor
    random ops follow their own RNG scheme.)
    """
    from torch.distributed.tensor import DTensor, distribute_tensor

    torch.manual_seed(seed)
    for module in model.modules():
        tensors = {**module._parameters, **module._buffers}  # this module's own, not its children's
        tensors = {name: t for name, t in tensors.items() if t is not None}
        if not tensors:
            continue
        if not hasattr(module, "reset_parameters"):
            raise TypeError(f"{type(module).__name__} has parameters or buffers but no reset_parameters()")
        kept = dict(module._parameters), dict(module._buffers)
        for name, t in tensors.items():  # full-size plain CPU stand-ins, just for this module
            table = module._parameters if name in module._parameters else module._buffers
            table[name] = torch.empty(t.shape, dtype=t.dtype)  # DTensor .shape is the global shape
        try:
            module.reset_parameters()  # exactly what the module's constructor did eagerly
            full = {name: (module._parameters.get(name) if name in module._parameters else module._buffers[name])
                    for name in tensors}
        finally:
            module._parameters.update(kept[0])
            module._buffers.update(kept[1])
        for name, t in tensors.items():
            if isinstance(t, DTensor):  # this rank's piece only, cut the way FSDP cut the parameter
                piece = distribute_tensor(full[name], t.device_mesh, t.placements, src_data_rank=None).to_local()
                t.to_local().copy_(piece)
            else:
                t.copy_(full[name])
        del full


def read_full_weights(path, model: nn.Module) -> dict:
    """The plain Net state dict in `path`: a lesson 02-04 checkpoint (its "model") or a model_full.pt (05)."""
    from common.errors import CourseError, one_line

    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except (OSError, RuntimeError, ValueError) as exc:
        raise CourseError(f"--init-from {path}: not a readable weights file ({one_line(exc, 200)})") from None
    if isinstance(state, dict) and isinstance(state.get("model"), dict):
        state = state["model"]  # a training checkpoint of lessons 02-04
    expected = {name: tuple(t.shape) for name, t in model.state_dict().items()}
    found = {name: tuple(t.shape) for name, t in state.items() if isinstance(t, torch.Tensor)} \
        if isinstance(state, dict) else {}
    if found != expected:
        differ = sorted(k for k in expected.keys() | found.keys() if expected.get(k) != found.get(k))
        raise CourseError(f"--init-from {path}: not the weights of this Net (differ: {', '.join(differ[:4])}): "
                          f"a lesson 04 checkpoint .pt or a model_full.pt, trained with the same --width")
    return state
