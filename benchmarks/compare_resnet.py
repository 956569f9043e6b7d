"""Side-by-side ResNet training throughput: train's C++ step against Python PyTorch eager.

Runs bench_resnet_step (C++) and resnet_step.py (Python) alternately, `--rounds` times each,
in one session on the same device, and reports the median img/s of each, their ratio, and the
model-FLOPs utilisation against the device's peak.

    python3 benchmarks/compare_resnet.py --bin build/bin/bench_resnet_step --rounds 2 \
        --depth 50 --batch 256 --precision bf16 --peak-tflops 989 --out results.json
"""
import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

# Forward multiply-accumulates at 224x224 (torchvision's reference figures); training is about
# 3x the forward FLOPs (forward + backward for activations and for weights).
FORWARD_GMACS_224 = {18: 1.814, 34: 3.664, 50: 4.089}


def run(cmd):
    out = subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=600)
    for line in out.stdout.splitlines():
        if line.startswith("{"):
            return json.loads(line)
    raise RuntimeError(f"no JSON from {cmd}: {out.stdout}\n{out.stderr}")


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--bin", required=True)
    p.add_argument("--python", default=sys.executable)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--depth", type=int, default=50)
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--image", type=int, default=224)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--warmup", type=int, default=15)
    p.add_argument("--device", default="cuda")
    p.add_argument("--precision", default="bf16")
    p.add_argument("--channels-last", type=int, default=1)
    p.add_argument("--peak-tflops", type=float, default=0.0, help="device peak for the precision used")
    p.add_argument("--out", default="")
    a = p.parse_args()

    common = ["--depth", str(a.depth), "--batch", str(a.batch), "--image", str(a.image),
              "--steps", str(a.steps), "--warmup", str(a.warmup), "--device", a.device,
              "--precision", a.precision, "--channels-last", str(a.channels_last)]
    cpp_cmd = [a.bin] + common
    py_cmd = [a.python, str(Path(__file__).with_name("resnet_step.py"))] + common
    runs = {"cpp": [], "python": []}
    for r in range(a.rounds):
        order = [("cpp", cpp_cmd), ("python", py_cmd)] if r % 2 == 0 else [("python", py_cmd), ("cpp", cpp_cmd)]
        for name, cmd in order:
            t0 = time.time()
            res = run(cmd)
            res["wall_s"] = round(time.time() - t0, 1)
            runs[name].append(res)
            print(f"round {r} {name}: {res['img_per_s']:.1f} img/s", flush=True)

    train_flops = 3 * 2 * FORWARD_GMACS_224[a.depth] * 1e9 * (a.image / 224) ** 2
    summary = {"config": vars(a), "runs": runs}
    rows = []
    for name in ("cpp", "python"):
        med = statistics.median(x["img_per_s"] for x in runs[name])
        mfu = med * train_flops / (a.peak_tflops * 1e12) if a.peak_tflops else None
        summary[name] = {"median_img_per_s": med, "mfu": mfu}
        rows.append((name, med, mfu))
    summary["ratio_cpp_over_python"] = summary["cpp"]["median_img_per_s"] / summary["python"]["median_img_per_s"]
    print(f"\nResNet-{a.depth}, batch {a.batch}, {a.image}px, {a.precision}, channels_last={a.channels_last}, "
          f"{a.rounds} interleaved rounds")
    print("| impl | median img/s | MFU |")
    print("|---|---|---|")
    for name, med, mfu in rows:
        print(f"| {name} | {med:.1f} | {'' if mfu is None else f'{100 * mfu:.1f}%'} |")
    print(f"| ratio cpp/python | {summary['ratio_cpp_over_python']:.3f} | |")
    if a.out:
        Path(a.out).write_text(json.dumps(summary, indent=2) + "\n")


if __name__ == "__main__":
    main()
