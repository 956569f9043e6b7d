"""The Python side of benchmarks/compare_loader.py: torchvision's ImageFolder + PyTorch's
DataLoader doing the work of bench_loader.cpp (PIL decode, RandomResizedCrop, flip, ToTensor,
Normalize, collate), with the same flags and the same JSON line:

    python benchmarks/bench_loader.py --folder DIR --batch 64 --workers N --seconds S --json

Worker processes persist across epochs (persistent_workers), as a tuned Python job would run;
the first --warmup batches (worker start-up) are not counted."""
import argparse
import json
import time

import torch
import torchvision
from torchvision import transforms as T


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--folder", required=True)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--seconds", type=float, default=10.0)
    p.add_argument("--size", type=int, default=224)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--json", action="store_true")
    a = p.parse_args()
    torch.set_num_threads(1)
    tf = T.Compose([T.RandomResizedCrop(a.size), T.RandomHorizontalFlip(), T.ToTensor(),
                    T.Normalize([0.485, 0.456, 0.406], [0.229, 0.224, 0.225])])
    ds = torchvision.datasets.ImageFolder(a.folder, transform=tf)
    loader = torch.utils.data.DataLoader(ds, batch_size=a.batch, shuffle=True, num_workers=a.workers,
                                         drop_last=True, persistent_workers=a.workers > 0)
    batches = images = 0
    start = time.perf_counter()
    done = False
    while not done:
        for x, _ in loader:
            batches += 1
            if batches <= a.warmup:
                start = time.perf_counter()
                continue
            images += x.shape[0]
            if time.perf_counter() - start >= a.seconds:
                done = True
                break
    s = time.perf_counter() - start
    print(json.dumps({"impl": "python", "workers": a.workers, "batch": a.batch, "images": images,
                      "seconds": s, "images_per_s": images / s}), flush=True)


if __name__ == "__main__":
    main()
