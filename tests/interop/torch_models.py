"""The networks ddpworker builds (worker/nn/model_build.c), written in PyTorch with torchvision's
module names: the reference for the gradient test and the anchor of the throughput benchmark.
Parameter order equals ddpworker's arena order; to_torch_layout / from_torch_layout convert
between its NHWC layouts and PyTorch's."""
import torch
import torch.nn as nn


class BasicBlock(nn.Module):
    """torchvision's BasicBlock, with its names."""
    expansion = 1

    def __init__(self, cin, planes, stride):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, planes, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(planes)
        self.conv2 = nn.Conv2d(planes, planes, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(planes)
        self.downsample = None
        if stride != 1 or cin != planes:
            self.downsample = nn.Sequential(nn.Conv2d(cin, planes, 1, stride, bias=False),
                                            nn.BatchNorm2d(planes))

    def forward(self, x):
        y = torch.relu(self.bn1(self.conv1(x)))
        y = self.bn2(self.conv2(y))
        return torch.relu(y + (self.downsample(x) if self.downsample is not None else x))


class Bottleneck(nn.Module):
    """torchvision's Bottleneck (v1.5: the stride in the 3x3 convolution), with its names."""
    expansion = 4

    def __init__(self, cin, planes, stride):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, planes, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(planes)
        self.conv2 = nn.Conv2d(planes, planes, 3, stride, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(planes)
        self.conv3 = nn.Conv2d(planes, 4 * planes, 1, bias=False)
        self.bn3 = nn.BatchNorm2d(4 * planes)
        self.downsample = None
        if stride != 1 or cin != 4 * planes:
            self.downsample = nn.Sequential(nn.Conv2d(cin, 4 * planes, 1, stride, bias=False),
                                            nn.BatchNorm2d(4 * planes))

    def forward(self, x):
        y = torch.relu(self.bn1(self.conv1(x)))
        y = torch.relu(self.bn2(self.conv2(y)))
        y = self.bn3(self.conv3(y))
        return torch.relu(y + (self.downsample(x) if self.downsample is not None else x))


class ResNet(nn.Module):
    """torchvision's ResNet with a base width and either stem: imagenet (7x7/2 conv, 3x3/2
    max-pool) or cifar (3x3/1 conv, no pool). Module names are torchvision's."""

    def __init__(self, block, blocks, width, channels, classes, imagenet_stem):
        super().__init__()
        if imagenet_stem:
            self.conv1 = nn.Conv2d(channels, width, 7, 2, 3, bias=False)
        else:
            self.conv1 = nn.Conv2d(channels, width, 3, 1, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.maxpool = nn.MaxPool2d(3, 2, 1) if imagenet_stem else nn.Identity()
        cin = width
        for stage, count in enumerate(blocks):
            layers = []
            for i in range(count):
                layers.append(block(cin, width << stage, 2 if stage > 0 and i == 0 else 1))
                cin = (width << stage) * block.expansion
            setattr(self, f"layer{stage + 1}", nn.Sequential(*layers))
        self.fc = nn.Linear(cin, classes)

    def forward(self, x):
        x = self.maxpool(torch.relu(self.bn1(self.conv1(x))))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        return self.fc(torch.flatten(nn.functional.adaptive_avg_pool2d(x, 1), 1))


class MaskDropout(nn.Module):
    """nn.Dropout with a given mask (ddpworker's, which torch's generator cannot draw): the
    survivors scaled by 1 / (1 - p) in training, the identity in evaluation."""

    def __init__(self, p):
        super().__init__()
        self.p, self.mask = p, None

    def forward(self, x):
        if not self.training:
            return x
        return x * self.mask.view_as(x) * (1.0 / (1.0 - self.p))


VGG_CFGS = {
    "vgg11": [64, "M", 128, "M", 256, 256, "M", 512, 512, "M", 512, 512, "M"],
    "vgg13": [64, 64, "M", 128, 128, "M", 256, 256, "M", 512, 512, "M", 512, 512, "M"],
    "vgg16": [64, 64, "M", 128, 128, "M", 256, 256, 256, "M", 512, 512, 512, "M", 512, 512, 512,
              "M"],
    "vgg19": [64, 64, "M", 128, 128, "M", 256, 256, 256, 256, "M", 512, 512, 512, 512, "M", 512,
              512, 512, 512, "M"],
}


class VGG(nn.Module):
    """torchvision's VGG (features, avgpool, classifier: the same indices) with channels scaled by
    width / 64 and a classifier of fc_width; dropout layers are MaskDropout."""

    def __init__(self, name, width, channels, classes, fc_width, dropout):
        super().__init__()
        layers, cin = [], channels
        for v in VGG_CFGS[name.replace("_bn", "")]:
            if v == "M":
                layers.append(nn.MaxPool2d(2, 2))
                continue
            cout = max(1, v * width // 64)
            layers.append(nn.Conv2d(cin, cout, 3, padding=1))
            if name.endswith("_bn"):
                layers.append(nn.BatchNorm2d(cout))
            layers.append(nn.ReLU(inplace=True))
            cin = cout
        self.features = nn.Sequential(*layers)
        self.avgpool = nn.AdaptiveAvgPool2d((7, 7))
        self.classifier = nn.Sequential(
            nn.Linear(cin * 49, fc_width), nn.ReLU(True), MaskDropout(dropout),
            nn.Linear(fc_width, fc_width), nn.ReLU(True), MaskDropout(dropout),
            nn.Linear(fc_width, classes))
        self.last_channels = cin

    def forward(self, x):
        return self.classifier(torch.flatten(self.avgpool(self.features(x)), 1))


RESNETS = {"resnet18": (BasicBlock, [2, 2, 2, 2]), "resnet34": (BasicBlock, [3, 4, 6, 3]),
           "resnet50": (Bottleneck, [3, 4, 6, 3]), "resnet101": (Bottleneck, [3, 4, 23, 3]),
           "resnet152": (Bottleneck, [3, 8, 36, 3])}


def build(name, width, h, w, c, classes, stem="auto", fc_width=4096, dropout=0.5):
    """The model and the (H, W, C) shape each linear layer's input has in ddpworker's NHWC.
    stem: as model.stem (auto: imagenet when both sides are >= 64)."""
    if name == "mlp":
        model = nn.Sequential(nn.Flatten(), nn.Linear(h * w * c, width), nn.ReLU(),
                              nn.Linear(width, width), nn.ReLU(), nn.Linear(width, classes))
        return model, [(h, w, c), (1, 1, width), (1, 1, width)]
    if name == "cnn":
        model = nn.Sequential(
            nn.Conv2d(c, width, 3, 1, 1, bias=False), nn.BatchNorm2d(width), nn.ReLU(),
            nn.MaxPool2d(2, 2),
            nn.Conv2d(width, 2 * width, 3, 1, 1, bias=False), nn.BatchNorm2d(2 * width), nn.ReLU(),
            nn.MaxPool2d(2, 2), nn.Flatten(), nn.Linear(2 * width * (h // 4) * (w // 4), classes))
        return model, [(h // 4, w // 4, 2 * width)]
    if name.startswith("vgg"):
        model = VGG(name, width, c, classes, fc_width, dropout)
        return model, [(7, 7, model.last_channels), (1, 1, fc_width), (1, 1, fc_width)]
    block, blocks = RESNETS[name]
    imagenet = stem == "imagenet" or (stem == "auto" and min(h, w) >= 64)
    return (ResNet(block, blocks, width, c, classes, imagenet),
            [(1, 1, width * 8 * block.expansion)])


def dropouts(model):
    """The model's MaskDropout layers, in forward order."""
    return [m for m in model.modules() if isinstance(m, MaskDropout)]


def _linear_inputs(model, shapes):
    linears = [m for m in model.modules() if isinstance(m, nn.Linear)]
    return {id(m.weight): s for m, s in zip(linears, shapes)}


def to_torch_layout(model, shapes, flat):
    """Copy ddpworker's flat parameter arena (a float32 tensor) into the model."""
    inputs, at = _linear_inputs(model, shapes), 0
    with torch.no_grad():
        for p in model.parameters():
            chunk = flat[at:at + p.numel()]
            at += p.numel()
            if p.dim() == 4:  # (K, R, S, C) -> (K, C, R, S)
                k, c, r, s = p.shape
                p.copy_(chunk.view(k, r, s, c).permute(0, 3, 1, 2))
            elif p.dim() == 2 and id(p) in inputs:  # columns in (H, W, C) order -> (C, H, W)
                h, w, c = inputs[id(p)]
                p.copy_(chunk.view(p.shape[0], h, w, c).permute(0, 3, 1, 2).reshape(p.shape))
            else:
                p.copy_(chunk.view(p.shape))
    assert at == flat.numel(), f"{flat.numel()} values for {at} parameters"


def from_torch_layout(model, shapes, tensors):
    """tensors (one per parameter, PyTorch layout) as ddpworker's flat arena."""
    inputs, parts = _linear_inputs(model, shapes), []
    for p, t in zip(model.parameters(), tensors):
        if t.dim() == 4:
            parts.append(t.permute(0, 2, 3, 1).reshape(-1))
        elif t.dim() == 2 and id(p) in inputs:
            h, w, c = inputs[id(p)]
            parts.append(t.view(t.shape[0], c, h, w).permute(0, 2, 3, 1).reshape(-1))
        else:
            parts.append(t.reshape(-1))
    return torch.cat(parts)
