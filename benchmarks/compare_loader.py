"""Input pipeline side by side: train's C++ loader against torchvision's ImageFolder + DataLoader.

Generates an ImageFolder of JPEGs once (default 2,000 images, 500x375, quality 90, 10 classes:
smooth colour fields with noise, so that they compress like photos), then runs both loaders
alternately for each worker count and reports median images/s and the ratio.

    .venv/bin/python benchmarks/compare_loader.py --bin build/bin/bench_loader_epoch --rounds 3 --workers 1 2
"""
import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

import numpy as np
from PIL import Image


def make_dataset(root: Path, images: int, classes: int, width: int, height: int):
    train = root / "train"
    if train.is_dir() and sum(1 for _ in train.rglob("*.jpg")) == images:
        return
    rng = np.random.default_rng(0)
    yy, xx = np.mgrid[0:height, 0:width]
    for i in range(images):
        c = train / f"class{i % classes:02d}"
        c.mkdir(parents=True, exist_ok=True)
        base = np.stack([np.sin(xx / rng.uniform(20, 80) + rng.uniform(0, 6)) * 80 + 128,
                         np.cos(yy / rng.uniform(20, 80) + rng.uniform(0, 6)) * 80 + 128,
                         (xx + yy) / (width + height) * 255], axis=-1)
        img = np.clip(base + rng.normal(0, 12, base.shape), 0, 255).astype(np.uint8)
        Image.fromarray(img).save(c / f"{i:05d}.jpg", quality=90)


def run(cmd):
    out = subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=1200)
    return json.loads([l for l in out.stdout.splitlines() if l.startswith("{")][-1])


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--bin", required=True)
    p.add_argument("--python", default=sys.executable)
    p.add_argument("--root", default="/tmp/train-loader-bench")
    p.add_argument("--images", type=int, default=2000)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--out", default="")
    a = p.parse_args()
    root = Path(a.root)
    make_dataset(root, a.images, 10, 500, 375)
    here = Path(__file__).parent
    results = {}
    for w in a.workers:
        common = ["--root", str(root), "--workers", str(w), "--batch", str(a.batch)]
        cpp = [a.bin] + common
        py = [a.python, str(here / "loader_epoch.py")] + common
        runs = {"cpp": [], "python": []}
        for r in range(a.rounds):
            for name, cmd in ([("cpp", cpp), ("python", py)] if r % 2 == 0 else [("python", py), ("cpp", cpp)]):
                res = run(cmd)
                runs[name].append(res["img_per_s"])
                print(f"workers {w} round {r} {name}: {res['img_per_s']:.1f} img/s", flush=True)
        med = {k: statistics.median(v) for k, v in runs.items()}
        results[w] = {"runs": runs, "median": med, "ratio": med["cpp"] / med["python"]}
    print(f"\nImageFolder {a.images} JPEGs 500x375 q90, RandomResizedCrop 224 + flip + normalise, batch {a.batch}, "
          f"{a.rounds} interleaved rounds")
    print("| workers | train C++ img/s | torchvision img/s | ratio |")
    print("|---|---|---|---|")
    for w, r in results.items():
        print(f"| {w} | {r['median']['cpp']:.1f} | {r['median']['python']:.1f} | {r['ratio']:.2f} |")
    if a.out:
        Path(a.out).write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
