#!/usr/bin/env python3
"""Reference crop boxes from torchvision's RandomResizedCrop.get_params.

    random_resized_crop_oracle.py DIR

Reads from DIR (written by tests/test_image_folder.cpp):
  cases.txt         one case a line: seed height width min_scale max_scale min_ratio max_ratio
  distribution.txt  one case a line: seed height width min_scale max_scale min_ratio max_ratio count
Writes into DIR:
  stream.txt        for the first 3 seeds of cases.txt: the seed, then the first 6 outputs of the
                    Python copy of train's SplitMix64 below, so the C++ test can check the copy
  boxes.txt         per line of cases.txt: "top left height width", from torchvision's get_params
                    fed the draws train's random_resized_crop_box makes from SplitMix64(seed)
  distribution_boxes.txt
                    per line of distribution.txt, `count` lines "top left height width": boxes
                    from the unmodified get_params with torch's own generator
                    (torch.manual_seed(seed)), for a comparison of distributions

Same draws: get_params runs as torchvision wrote it, with the module's `torch` replaced by a shim
whose uniform_(a, b) is a + (b - a) * u and randint(0, n) is below(n) of the SplitMix64 stream,
in the order get_params draws them. The shim also computes in float64 where torchvision's tensors
are float32 (torch.tensor(ratio), torch.empty(1)), since train's box is computed in double: with
float32 a side that rounds at .5 could come out one pixel apart. Nothing else of get_params (the
10 attempts, the log-uniform ratio, the rounding, the fit test, the fallback) is touched.
"""
import math
import os
import sys

try:
    import torch
    import torchvision.transforms.transforms as tvt
except ImportError as e:  # the C++ test fails on the non-zero exit
    sys.exit("random_resized_crop_oracle.py: %s; run scripts/setup (pip install -r scripts/requirements-test.txt)" % e)

M64 = (1 << 64) - 1


class SplitMix64:
    """train::data::SplitMix64 (libtrain/include/train/data/transforms.h), draw for draw."""

    def __init__(self, seed):
        self.state = seed & M64

    def next(self):
        x = (self.state + 0x9E3779B97F4A7C15) & M64
        x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & M64
        x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & M64
        out = x ^ (x >> 31)
        self.state = (self.state + 0x9E3779B97F4A7C15) & M64
        return out

    def below(self, bound):
        threshold = ((1 << 64) - bound) % bound
        while True:
            x = self.next()
            if x >= threshold:
                return x % bound

    def uniform(self):  # 24 random bits, exactly representable
        return (self.next() >> 40) * 2.0 ** -24


class _Uniform:
    def __init__(self, rng):
        self.rng = rng

    def uniform_(self, low, high):
        low, high = float(low), float(high)
        return torch.tensor([low + (high - low) * self.rng.uniform()], dtype=torch.float64)


class TorchShim:
    """What get_params uses of `torch`, drawing from a SplitMix64 stream."""

    def __init__(self, rng):
        self.rng = rng

    def tensor(self, data, **kwargs):
        return torch.tensor(data, dtype=torch.float64)

    def empty(self, *size, **kwargs):
        return _Uniform(self.rng)

    def randint(self, low, high, size=None, **kwargs):
        return torch.tensor([low + self.rng.below(high - low)])

    def __getattr__(self, name):  # log, exp, Tensor, jit, ...
        return getattr(torch, name)


def read_cases(path):
    cases = []
    with open(path) as f:
        for line in f:
            if line.strip():
                v = line.split()
                cases.append((int(v[0]), int(v[1]), int(v[2]), float(v[3]), float(v[4]), float(v[5]), float(v[6]),
                              int(v[7]) if len(v) > 7 else 1))
    return cases


def main():
    if len(sys.argv) != 2:
        sys.exit("usage: random_resized_crop_oracle.py DIR")
    out = sys.argv[1]
    cases = read_cases(os.path.join(out, "cases.txt"))
    with open(os.path.join(out, "stream.txt"), "w") as f:
        for seed, *_ in cases[:3]:
            rng = SplitMix64(seed)
            f.write("%d %s\n" % (seed, " ".join(str(rng.next()) for _ in range(6))))

    real_torch = tvt.torch
    try:
        with open(os.path.join(out, "boxes.txt"), "w") as f:
            for seed, h, w, smin, smax, rmin, rmax, _ in cases:
                tvt.torch = TorchShim(SplitMix64(seed))
                img = real_torch.empty(1, h, w)
                i, j, bh, bw = tvt.RandomResizedCrop.get_params(img, [smin, smax], [rmin, rmax])
                f.write("%d %d %d %d\n" % (i, j, bh, bw))
    finally:
        tvt.torch = real_torch

    with open(os.path.join(out, "distribution_boxes.txt"), "w") as f:
        for seed, h, w, smin, smax, rmin, rmax, count in read_cases(os.path.join(out, "distribution.txt")):
            torch.manual_seed(seed)
            img = torch.empty(1, h, w)
            for _ in range(count):
                f.write("%d %d %d %d\n" % tvt.RandomResizedCrop.get_params(img, [smin, smax], [rmin, rmax]))


if __name__ == "__main__":
    main()
