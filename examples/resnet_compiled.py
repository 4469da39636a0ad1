"""What does a torch.compile'd model keep for backward, and what of it could it give back?

The same kind of fine-tune as `resnet_surgical.py`: a torchvision ResNet-18 whose ``layer1`` and
classifier train while the rest stays frozen with batch norm in eval mode, here compiled with the
default backend (inductor) as a training script would. Compiling changes what autograd keeps:
AOTAutograd's partitioner decides, per region, which tensors the backward graph gets. It drops the eval
batch norms' inputs that eager keeps, but it keeps every frozen convolution's weight as a channels-last
copy made for backward (GA703), frozen layers' ReLU results in float32 where the proof finds only
their sign read, and the input of a frozen convolution whose weight gradient nobody asks for (GA003,
with ``--verify``). Each save is named by the module and source line of the op whose gradient reads it.

    gradaudit scan examples/resnet_compiled.py:build --verify
    gradaudit scan examples/resnet_compiled.py:build --eager     # the same model, audited op by op

Compiling needs a C++ compiler (inductor writes C++ for the CPU). No weights are downloaded.
"""

import torch
import torchvision

BATCH, SIZE = 2, 64  # inductor compiles the step in seconds on two CPU cores at this size


def build():
    torch.manual_seed(0)
    model = torchvision.models.resnet18(weights=None, num_classes=10)
    model.requires_grad_(False)
    model.layer1.requires_grad_(True)
    model.fc.requires_grad_(True)
    model.eval()  # batch norm keeps its pretrained running statistics during fine-tuning
    images = torch.randn(BATCH, 3, SIZE, SIZE)
    return torch.compile(model), images
