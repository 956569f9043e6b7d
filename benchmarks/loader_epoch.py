"""One pass of torchvision's ImageFolder + DataLoader with the same work as loader_epoch.cpp:
decode (PIL), RandomResizedCrop, flip, ToTensor, Normalize, collate. Prints one JSON line."""
import argparse
import json
import time

import torch
import torchvision
from torchvision import transforms as T


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--root", required=True)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--size", type=int, default=224)
    p.add_argument("--limit", type=int, default=0)
    a = p.parse_args()
    tf = T.Compose([T.RandomResizedCrop(a.size), T.RandomHorizontalFlip(), T.ToTensor(),
                    T.Normalize([0.485, 0.456, 0.406], [0.229, 0.224, 0.225])])
    ds = torchvision.datasets.ImageFolder(f"{a.root}/train", transform=tf)
    loader = torch.utils.data.DataLoader(ds, batch_size=a.batch, shuffle=True, num_workers=a.workers,
                                         drop_last=True, persistent_workers=False)
    t0 = time.perf_counter()
    images = batches = 0
    for x, _ in loader:
        images += x.shape[0]
        batches += 1
        if batches == a.limit:
            break
    s = time.perf_counter() - t0
    print(json.dumps({"impl": "python", "workers": a.workers, "images": images, "seconds": s,
                      "img_per_s": images / s}), flush=True)


if __name__ == "__main__":
    main()
