"""Input pipeline side by side: train's loader, PyTorch's Python DataLoader (torchvision
ImageFolder and transforms) and LibTorch's torch::data::DataLoader, on the same cores.

Generates an ImageFolder of JPEGs once (default 2,000 images, 500x375, quality 90, 10 classes:
smooth colour fields with noise, so that they compress like photos), then runs every
implementation at every worker count, rotating the order each round, for --seconds each. Each
side is its own program and can be rerun alone:

    build/bin/bench_loader --folder DIR --batch 64 --workers N --seconds S --json [--impl torch-data]
    .venv/bin/python benchmarks/bench_loader.py --folder DIR --batch 64 --workers N --seconds S --json

Reports the median images/s per implementation and worker count, each implementation at its best
worker count, the ratios, and the ceiling: single-core TurboJPEG decode rate x cores.

    .venv/bin/python benchmarks/compare_loader.py --bin build/bin/bench_loader --rounds 3 --workers 1 2 3
"""
import argparse
import json
import multiprocessing
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
from PIL import Image


def _write_image(job):
    path, index, width, height = job
    # One generator per image, seeded by its index: the folder is the same however many
    # processes write it.
    rng = np.random.default_rng([0, index])
    yy, xx = np.mgrid[0:height, 0:width]
    base = np.stack([np.sin(xx / rng.uniform(20, 80) + rng.uniform(0, 6)) * 80 + 128,
                     np.cos(yy / rng.uniform(20, 80) + rng.uniform(0, 6)) * 80 + 128,
                     (xx + yy) / (width + height) * 255], axis=-1)
    img = np.clip(base + rng.normal(0, 12, base.shape), 0, 255).astype(np.uint8)
    Image.fromarray(img).save(path, quality=90)


def make_dataset(root: Path, images: int, classes: int, width: int, height: int) -> Path:
    """Writes the folder once, on every core (about 20 ms per image and core)."""
    train = root / "train"
    if train.is_dir() and sum(1 for _ in train.rglob("*.jpg")) == images:
        return train
    jobs = []
    for i in range(images):
        c = train / f"class{i % classes:02d}"
        c.mkdir(parents=True, exist_ok=True)
        jobs.append((c / f"{i:05d}.jpg", i, width, height))
    with multiprocessing.Pool(len(os.sched_getaffinity(0))) as pool:
        pool.map(_write_image, jobs, chunksize=16)
    return train


def run(cmd):
    out = subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=600)
    return json.loads([line for line in out.stdout.splitlines() if line.startswith("{")][-1])


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--bin", required=True, help="build/bin/bench_loader")
    p.add_argument("--python", default=sys.executable)
    p.add_argument("--root", default="/tmp/train-loader-bench")
    p.add_argument("--images", type=int, default=2000)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    p.add_argument("--impls", nargs="+", default=["train", "python", "torch-data"],
                   choices=["train", "python", "torch-data"])
    p.add_argument("--seconds", type=float, default=8.0)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--out", default="", help="write every run and the summary as JSON here")
    a = p.parse_args()
    folder = make_dataset(Path(a.root), a.images, 10, 500, 375)
    here = Path(__file__).parent
    cores = len(os.sched_getaffinity(0))

    def command(impl, workers):
        common = ["--folder", str(folder), "--batch", str(a.batch), "--workers", str(workers),
                  "--seconds", str(a.seconds), "--json"]
        if impl == "python":
            return [a.python, str(here / "bench_loader.py")] + common
        return [a.bin, "--impl", impl] + common

    runs = {impl: {w: [] for w in a.workers} for impl in a.impls}
    decode = []
    jobs = [(impl, w) for w in a.workers for impl in a.impls]
    for r in range(a.rounds):
        res = run(command("decode", 1))
        decode.append(res["images_per_s"])
        print(f"round {r} decode (1 thread): {res['images_per_s']:.1f} img/s", flush=True)
        shift = r % len(jobs)
        for impl, w in jobs[shift:] + jobs[:shift]:
            res = run(command(impl, w))
            runs[impl][w].append(res["images_per_s"])
            print(f"round {r} {impl} workers {w}: {res['images_per_s']:.1f} img/s", flush=True)

    med = {impl: {w: statistics.median(v) for w, v in by_w.items()} for impl, by_w in runs.items()}
    best = {impl: max(by_w.items(), key=lambda kv: kv[1]) for impl, by_w in med.items()}
    decode_rate = statistics.median(decode)
    print(f"\nImageFolder {a.images} JPEGs 500x375 q90: decode + RandomResizedCrop 224 + flip + normalise, "
          f"batch {a.batch}; {cores} cores; {a.rounds} rounds of {a.seconds:g} s, rotating order; medians")
    print("| workers | " + " | ".join(f"{i} img/s" for i in a.impls) +
          (" | train / python" if "python" in a.impls and "train" in a.impls else "") +
          (" | train / torch-data" if "torch-data" in a.impls and "train" in a.impls else "") + " |")
    print("|---" * (1 + len(a.impls) + ("python" in a.impls) + ("torch-data" in a.impls)) + "|")
    for w in a.workers:
        cells = [f"{med[i][w]:.1f}" for i in a.impls]
        if "train" in a.impls:
            for other in ("python", "torch-data"):
                if other in a.impls:
                    cells.append(f"**{med['train'][w] / med[other][w]:.2f}**")
        print(f"| {w} | " + " | ".join(cells) + " |")
    print("| best | " + " | ".join(f"{best[i][1]:.1f} ({best[i][0]} w)" for i in a.impls) +
          "".join(f" | **{best['train'][1] / best[o][1]:.2f}**" for o in ("python", "torch-data")
                  if o in a.impls and "train" in a.impls) + " |")
    print(f"\nceiling: single-core TurboJPEG decode {decode_rate:.1f} img/s x {cores} cores = "
          f"{decode_rate * cores:.1f} img/s" +
          (f"; train's best is {best['train'][1] / (decode_rate * cores):.0%} of it" if "train" in a.impls else ""))
    if a.out:
        Path(a.out).write_text(json.dumps({
            "date": time.strftime("%Y-%m-%d %H:%M"), "host": platform.node(), "cores": cores,
            "cpu": next((l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo") if l.startswith("model name")), ""),
            "args": vars(a), "runs": runs, "median": med, "best": best,
            "decode_1_thread": decode, "ceiling": decode_rate * cores}, indent=2) + "\n")


if __name__ == "__main__":
    main()
