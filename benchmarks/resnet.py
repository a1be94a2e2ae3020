"""ResNet-18 (He et al. 2016) in torchvision's layout (``BasicBlock``: conv3x3-bn-relu-conv3x3-bn, a 1x1 conv-bn
shortcut where the shape changes; stem 7x7/2 conv and 3x3/2 max pool; global average pool and a linear head),
written here so that sparse-convolution tests and measurements need no torchvision. Parameter names match
torchvision's (``layer1.0.conv1.weight``...), so a state_dict saved from its ``resnet18`` loads."""
from __future__ import annotations

import torch
from torch import nn


class BasicBlock(nn.Module):
    expansion = 1

    def __init__(self, inplanes: int, planes: int, stride: int = 1):
        super().__init__()
        self.conv1 = nn.Conv2d(inplanes, planes, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(planes)
        self.relu = nn.ReLU(inplace=True)
        self.conv2 = nn.Conv2d(planes, planes, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(planes)
        self.downsample = None
        if stride != 1 or inplanes != planes:
            self.downsample = nn.Sequential(nn.Conv2d(inplanes, planes, 1, stride, bias=False), nn.BatchNorm2d(planes))

    def forward(self, x):
        identity = x if self.downsample is None else self.downsample(x)
        out = self.relu(self.bn1(self.conv1(x)))
        return self.relu(self.bn2(self.conv2(out)) + identity)


class ResNet(nn.Module):
    def __init__(self, layers=(2, 2, 2, 2), num_classes: int = 1000, width: int = 64):
        super().__init__()
        self.conv1 = nn.Conv2d(3, width, 7, 2, 3, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.relu = nn.ReLU(inplace=True)
        self.maxpool = nn.MaxPool2d(3, 2, 1)
        planes, inplanes = width, width
        for k, blocks in enumerate(layers):
            stride = 1 if k == 0 else 2
            mods = [BasicBlock(inplanes, planes, stride)] + [BasicBlock(planes, planes) for _ in range(blocks - 1)]
            setattr(self, f"layer{k + 1}", nn.Sequential(*mods))
            inplanes, planes = planes, planes * 2
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(inplanes, num_classes)

    def forward(self, x):
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        return self.fc(torch.flatten(self.avgpool(x), 1))


def resnet18(num_classes: int = 1000, width: int = 64) -> ResNet:
    """ResNet-18; ``width`` scales every stage (64 is the standard model; tests use smaller widths)."""
    return ResNet((2, 2, 2, 2), num_classes, width)


def _main():
    """ResNet-18 inference, dense against every conv at 90% CSR (magnitude), interleaved medians:
    ``python -m benchmarks.resnet [--size 224] [--batch 1] [--threads 2] [--repeats 7] [--channels-last]
    [--format csr|nm]`` (``--channels-last``: the dense model and both inputs channels_last; ``--format nm``:
    2:4 on every conv but the 7 x 7 stem, whose 147 columns take no 2:4, as ``benchmarks.model_zoo`` prunes)."""
    import argparse
    import copy
    import statistics
    import time

    import scorch
    from scorch.nn import NM, ScalarFraction
    ap = argparse.ArgumentParser()
    ap.add_argument("--size", type=int, default=224)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--sparsity", type=float, default=0.9)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--channels-last", action="store_true")
    ap.add_argument("--format", choices=("csr", "nm"), default="csr")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    dense = resnet18().eval()
    sparse = copy.deepcopy(dense)
    s = scorch.schedule(sparse)
    for n, m in sparse.named_modules():
        if isinstance(m, nn.Conv2d) and args.format == "csr":
            s[f"{n}.weight"].sparsify(ScalarFraction(args.sparsity)).set_format("csr")
        elif isinstance(m, nn.Conv2d) and n != "conv1":
            s[f"{n}.weight"].sparsify(NM(2, 4))
    s.apply()
    pruning = f"{args.sparsity:.0%} csr" if args.format == "csr" else "2:4 (stem dense)"
    x = torch.randn(args.batch, 3, args.size, args.size)
    if args.channels_last:
        dense = dense.to(memory_format=torch.channels_last)
        x = x.contiguous(memory_format=torch.channels_last)
    times = {"dense": [], "csr": []}
    with torch.no_grad():
        for model in (dense, sparse):  # warm: kernels compiled, views built
            model(x)
        for _ in range(args.repeats):
            for name, model in (("dense", dense), ("csr", sparse)):
                t = time.perf_counter()
                model(x)
                times[name].append(time.perf_counter() - t)
    d, c = statistics.median(times["dense"]), statistics.median(times["csr"])
    layout = ", channels_last" if args.channels_last else ""
    print(f"ResNet-18 batch {args.batch} {args.size}x{args.size}{layout}, {args.threads} threads, {args.repeats}"
          " interleaved runs:"
          f" dense {d * 1e3:.1f} ms, every conv {pruning} {c * 1e3:.1f} ms: {d / c:.2f}x dense")


if __name__ == "__main__":
    _main()
