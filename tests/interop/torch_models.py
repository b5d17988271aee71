"""The networks ddpworker builds (worker/nn/model.c), written in PyTorch: the reference for the
gradient test and the anchor of the throughput benchmark. Parameter order equals ddpworker's arena
order; to_torch_layout / from_torch_layout convert between its NHWC layouts and PyTorch's."""
import torch
import torch.nn as nn


class BasicBlock(nn.Module):
    def __init__(self, cin, cout, stride):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.shortcut = nn.Sequential()
        if stride != 1 or cin != cout:
            self.shortcut = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False),
                                          nn.BatchNorm2d(cout))

    def forward(self, x):
        y = torch.relu(self.bn1(self.conv1(x)))
        y = self.bn2(self.conv2(y))
        return torch.relu(y + self.shortcut(x))


class ResNet(nn.Module):
    """CIFAR-style: 3x3 stem, no max-pool."""

    def __init__(self, blocks, width, channels, classes):
        super().__init__()
        self.conv1 = nn.Conv2d(channels, width, 3, 1, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        layers, cin = [], width
        for stage, count in enumerate(blocks):
            cout = width << stage
            for i in range(count):
                layers.append(BasicBlock(cin, cout, 2 if stage > 0 and i == 0 else 1))
                cin = cout
        self.layers = nn.Sequential(*layers)
        self.fc = nn.Linear(cin, classes)

    def forward(self, x):
        x = torch.relu(self.bn1(self.conv1(x)))
        x = self.layers(x)
        return self.fc(torch.flatten(nn.functional.adaptive_avg_pool2d(x, 1), 1))


def build(name, width, h, w, c, classes):
    """The model and the (H, W, C) shape each linear layer's input has in ddpworker's NHWC."""
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
    blocks = {"resnet18": [2, 2, 2, 2], "resnet34": [3, 4, 6, 3]}[name]
    return ResNet(blocks, width, c, classes), [(1, 1, width * 8)]


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
