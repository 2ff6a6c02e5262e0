"""Models: LeNet-5 and a small tanh CNN for MNIST (1x28x28), ResNet-18 with GroupNorm for CIFAR-10 (3x32x32).

The run-config key ``model`` picks one (``fl_dp_flower.vocabulary.MODEL_NAMES``); "auto" is LeNet-5 for MNIST and ResNet-18
for CIFAR-10. "cnn-tanh" is the tempered-sigmoid CNN of Papernot et al. (AAAI 2021, "Tempered
sigmoid activations for deep learning with differential privacy", their MNIST architecture): a
bounded activation keeps the clipped gradients' scale steady under DP noise, and with 26,010
values it uploads (and is noised in) 2.4x fewer coordinates than LeNet-5.

No model here has buffers (no BatchNorm running statistics): everything the client uploads is a
trained parameter, and all of it receives Gaussian noise (``training.noise``). GroupNorm also keeps
per-sample gradients well defined (a sample's output does not depend on the rest of its batch),
which per-sample clipping with ``torch.func.vmap`` needs.
"""

from __future__ import annotations

import functools

from torch import nn

from fl_dp_flower.vocabulary import DATASETS, MODEL_NAMES, model_problem

__all__ = ["DATASETS", "MODEL_NAMES", "LeNet5", "ResNet18GN", "TanhCNN", "build_model", "parameter_count"]


class LeNet5(nn.Module):
    """LeNet-5 (ReLU, max-pooling) for 1x28x28 inputs, 10 logits. 61,706 parameters."""

    def __init__(self, num_classes: int = 10) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(1, 6, kernel_size=5, padding=2),  # 6x28x28
            nn.ReLU(),
            nn.MaxPool2d(2),  # 6x14x14
            nn.Conv2d(6, 16, kernel_size=5),  # 16x10x10
            nn.ReLU(),
            nn.MaxPool2d(2),  # 16x5x5
        )
        self.classifier = nn.Sequential(
            nn.Flatten(),
            nn.Linear(16 * 5 * 5, 120),
            nn.ReLU(),
            nn.Linear(120, 84),
            nn.ReLU(),
            nn.Linear(84, num_classes),
        )

    def forward(self, x):
        return self.classifier(self.features(x))


class TanhCNN(nn.Module):
    """Papernot et al.'s tempered-sigmoid CNN (tanh) for 1x28x28 inputs, 10 logits. 26,010 parameters."""

    def __init__(self, num_classes: int = 10) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(1, 16, kernel_size=8, stride=2, padding=3),  # 16x14x14
            nn.Tanh(),
            nn.MaxPool2d(2, stride=1),  # 16x13x13
            nn.Conv2d(16, 32, kernel_size=4, stride=2),  # 32x5x5
            nn.Tanh(),
            nn.MaxPool2d(2, stride=1),  # 32x4x4
        )
        self.classifier = nn.Sequential(nn.Flatten(), nn.Linear(32 * 4 * 4, 32), nn.Tanh(), nn.Linear(32, num_classes))

    def forward(self, x):
        return self.classifier(self.features(x))


def _group_norm(channels: int) -> nn.GroupNorm:
    return nn.GroupNorm(num_groups=min(32, channels), num_channels=channels)


class ResNet18GN(nn.Module):
    """ResNet-18 for 3x32x32 inputs: 3x3 stride-1 stem, no max-pool, GroupNorm(32) instead of BatchNorm."""

    def __init__(self, num_classes: int = 10) -> None:
        super().__init__()
        from torchvision.models import resnet18  # lazy: torchvision costs ~2 s per ClientApp start

        net = resnet18(weights=None, num_classes=num_classes, norm_layer=_group_norm)
        net.conv1 = nn.Conv2d(3, 64, kernel_size=3, stride=1, padding=1, bias=False)
        net.maxpool = nn.Identity()
        self.net = net

    def forward(self, x):
        return self.net(x)


def build_model(dataset: str, model: str = "auto") -> nn.Module:
    """Fresh (randomly initialised, CPU, float32) ``model`` (``fl_dp_flower.vocabulary.MODEL_NAMES``) for ``dataset``."""
    problem = model_problem(dataset, model)
    if problem:
        raise ValueError(problem)
    if model == "cnn-tanh":
        return TanhCNN()
    if model == "resnet18-gn" or (model == "auto" and dataset == "cifar10"):
        return ResNet18GN()
    return LeNet5()


@functools.lru_cache(maxsize=None)
def parameter_count(dataset: str, model: str = "auto") -> int:
    """The number of values the model uploads (every parameter; the models have no buffers)."""
    return sum(int(v.numel()) for v in build_model(dataset, model).state_dict().values())
