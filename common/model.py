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
