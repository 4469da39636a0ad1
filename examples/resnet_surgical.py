"""Surgical fine-tuning of a torchvision ResNet: where does autograd's memory go, and what would the
convolution, batch-norm and max-pool findings free?

Surgical fine-tuning (Lee et al., ICLR 2023) trains one block of a pretrained network and freezes the
rest; for input-level distribution shifts the *first* block is the one to train. Here the stem and
``layer1`` train with the classifier, batch norm uses its running statistics (eval mode), and everything
between them is frozen. The gradient still has to flow back through the frozen ``layer2``-``layer4`` to
reach ``layer1``, so PyTorch saves what their backward needs - and, as the scan shows, a lot it cannot
need: every frozen convolution keeps its input for a weight gradient nobody asked for (GA101), frozen
eval-mode batch norms keep theirs (GA201), max-pooling keeps its whole input (GA301), and ReLUs keep
float tensors where one bit per element would do (GA401).

    gradaudit scan examples/resnet_surgical.py:build
    gradaudit scan examples/resnet_surgical.py:build --trainable 'layer4.*' --trainable 'fc.*'   # what-if

No weights are downloaded: the network is built with random weights, which changes no saved tensor.
"""

import torch
import torchvision

BATCH, SIZE = 8, 128  # small enough to scan in a few seconds on two CPU cores


def build():
    torch.manual_seed(0)
    model = torchvision.models.resnet18(weights=None, num_classes=10)
    model.requires_grad_(False)
    for part in (model.conv1, model.bn1, model.layer1, model.fc):
        part.requires_grad_(True)
    model.eval()  # batch norm keeps its pretrained running statistics during fine-tuning
    images = torch.randn(BATCH, 3, SIZE, SIZE)
    return model, images
