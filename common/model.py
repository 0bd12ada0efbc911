"""The classic MNIST CNN of pytorch/examples, with knobs that make it activation-heavy or parameter-heavy."""
import torch
import torch.nn as nn
import torch.nn.functional as F


class Block(nn.Module):
    """hidden -> hidden with a skip connection, x + relu(fc(x)): a unit of the parameter-heavy stack."""

    def __init__(self, hidden: int):
        super().__init__()
        self.fc = nn.Linear(hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + F.relu(self.fc(x))


class Net(nn.Module):
    """features (conv 1->32 -> conv 32->64 -> max-pool -> dropout) -> fc1 9216->128 -> dropout -> fc2 128->10.

    ``width`` multiplies the channels and the hidden size: parameters grow ~width**2, ACTIVATIONS ~width.
    ``blocks`` adds Block(hidden) after fc1: PARAMETERS grow by hidden**2 per block, activations barely.
    ``batch_norm`` adds BatchNorm after each conv (lesson 04's --sync-bn).
    """

    def __init__(self, width: int = 1, blocks: int = 0, hidden: int | None = None, batch_norm: bool = False):
        super().__init__()
        c1, c2, hidden = 32 * width, 64 * width, hidden or 128 * width
        norm = nn.BatchNorm2d if batch_norm else (lambda channels: nn.Identity())
        self.features = nn.Sequential(
            nn.Conv2d(1, c1, 3, 1), norm(c1), nn.ReLU(),
            nn.Conv2d(c1, c2, 3, 1), norm(c2), nn.ReLU(),
            nn.MaxPool2d(2), nn.Dropout(0.25))
        self.fc1 = nn.Linear(c2 * 12 * 12, hidden)
        self.dropout = nn.Dropout(0.5)
        self.blocks = nn.ModuleList(Block(hidden) for _ in range(blocks))
        self.fc2 = nn.Linear(hidden, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.dropout(F.relu(self.fc1(torch.flatten(self.features(x), 1))))
        for block in self.blocks:
            x = block(x)
        return F.log_softmax(self.fc2(x), dim=1)


def count_parameters(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def model_flags(args) -> dict:
    """Net's constructor arguments from the command line."""
    return {"width": args.width, "blocks": args.blocks, "hidden": args.hidden}
