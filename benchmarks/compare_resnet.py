"""Side-by-side ResNet training throughput: train's C++ step against Python PyTorch eager.

Runs bench_resnet_step (C++) and resnet_step.py (Python) alternately, `--rounds` times each, in one
session on the same device, and reports every round, the median img/s of each side, the ratio of
the medians, the per-round ratios (C++ and Python of the same round, back to back) with their
median and range, and the model-FLOPs utilisation against the device's peak. Use an odd number of
rounds, 3 or more (the default): the median of an even count is the mean of the two middle runs,
which the report then says.

Both sides run the same SGD implementation: the C++ side runs --optim-impl (auto = the fused
kernel where LibTorch has one for the device, else foreach) and reports what ran; the Python side
is given that (torch.optim.SGD(fused=True), (foreach=True) or the per-parameter loop). The script
refuses a comparison whose optimizer, parameter count or settings differ between the sides. A run
whose windows spread by more than --spread-warn (max / min - 1) is flagged: its median is less
trustworthy.

    python3 benchmarks/compare_resnet.py --bin build/bin/bench_resnet_step --rounds 3 \
        --depth 50 --batch 256 --precision bf16 --peak-tflops 989 --out results.json
"""
import argparse
import json
import statistics
import sys
from pathlib import Path

from rounds import check_rounds, run_interleaved

# Forward multiply-accumulates at 224x224 (torchvision's reference figures); training is about
# 3x the forward FLOPs (forward + backward for activations and for weights).
FORWARD_GMACS_224 = {18: 1.814, 34: 3.664, 50: 4.089}


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--bin", required=True)
    p.add_argument("--python", default=sys.executable)
    p.add_argument("--rounds", type=int, default=3, help="interleaved rounds; odd and >= 3 for a true median")
    p.add_argument("--depth", type=int, default=50, choices=sorted(FORWARD_GMACS_224))
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--image", type=int, default=224)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--warmup", type=int, default=15)
    p.add_argument("--window", type=int, default=5)
    p.add_argument("--device", default="cuda")
    p.add_argument("--precision", default="bf16", choices=["bf16", "fp32"])
    p.add_argument("--channels-last", type=int, default=1)
    p.add_argument("--optim-impl", default="auto", choices=["auto", "fused", "foreach", "loop"],
                   help="the C++ side's optim.impl; the Python side runs what the C++ side reports")
    p.add_argument("--processes", default="serve", choices=["serve", "fresh"],
                   help="serve: one process per side, kept across rounds (a round costs its steps); fresh: a "
                        "new process per round (each round also pays and samples the start: CUDA context, cuDNN "
                        "autotuning)")
    p.add_argument("--spread-warn", type=float, default=0.20,
                   help="flag a run whose fastest window is more than this fraction above its slowest")
    p.add_argument("--peak-tflops", type=float, default=0.0, help="device peak for the precision used")
    p.add_argument("--out", default="")
    a = p.parse_args()
    warnings = check_rounds(p, a.rounds)

    common = ["--depth", str(a.depth), "--batch", str(a.batch), "--image", str(a.image),
              "--steps", str(a.steps), "--warmup", str(a.warmup), "--window", str(a.window), "--device", a.device,
              "--precision", a.precision, "--channels-last", str(a.channels_last)]
    py_script = str(Path(__file__).with_name("resnet_step.py"))
    runs = run_interleaved(
        [a.bin] + common + ["--optim-impl", a.optim_impl],
        lambda res: [a.python, py_script] + common + ["--optim-impl", res["optimizer"].split()[-1]],
        a.rounds, a.processes, "img_per_s", "img/s", a.spread_warn, warnings, note=lambda res: res["optimizer"])

    for key in ("depth", "batch", "image", "precision", "channels_last", "params", "optimizer", "steps", "windows"):
        values = {x[key] for side in runs.values() for x in side}
        if len(values) != 1:
            sys.exit(f"compare_resnet.py: the two sides differ in {key}: C++ {runs['cpp'][0][key]}, "
                     f"Python {runs['python'][0][key]}")
    c = runs["cpp"][0]
    train_flops = 3 * 2 * FORWARD_GMACS_224[a.depth] * 1e9 * (a.image / 224) ** 2
    summary = {"config": vars(a), "optimizer": c["optimizer"], "params": c["params"], "runs": runs}
    rows = []
    for name in ("cpp", "python"):
        med = statistics.median(x["img_per_s"] for x in runs[name])
        mfu = med * train_flops / (a.peak_tflops * 1e12) if a.peak_tflops else None
        summary[name] = {"median_img_per_s": med, "mfu": mfu}
        rows.append((name, med, mfu, ", ".join(f"{x['img_per_s']:.1f}" for x in runs[name])))
    summary["ratio_cpp_over_python"] = summary["cpp"]["median_img_per_s"] / summary["python"]["median_img_per_s"]
    # Per round (C++ and Python ran back to back): less sensitive to the machine drifting between rounds.
    pr = [x["img_per_s"] / y["img_per_s"] for x, y in zip(runs["cpp"], runs["python"])]
    summary.update({"round_ratios": pr, "median_round_ratio": statistics.median(pr),
                    "round_ratio_range": [min(pr), max(pr)], "warnings": warnings})
    print(f"\nResNet-{a.depth}, batch {a.batch}, {a.image}px, {a.precision}, channels_last={a.channels_last}, "
          f"{c['optimizer']} on both sides, {c['params'] / 1e6:.2f} M parameters, {a.device}, "
          f"{a.rounds} interleaved rounds ({'one process per side, kept' if a.processes == 'serve' else 'a new process per round'})")
    print("| impl | rounds (img/s) | median img/s | MFU |")
    print("|---|---|---|---|")
    for name, med, mfu, each in rows:
        print(f"| {name} | {each} | {med:.1f} | {'' if mfu is None else f'{100 * mfu:.1f}%'} |")
    print(f"| ratio cpp/python | {', '.join(f'{x:.3f}' for x in pr)} (median {statistics.median(pr):.3f}, "
          f"range {min(pr):.3f}-{max(pr):.3f}) | {summary['ratio_cpp_over_python']:.3f} | |")
    for w in warnings:
        print(f"warning: {w}")
    if a.out:
        Path(a.out).write_text(json.dumps(summary, indent=2) + "\n")


if __name__ == "__main__":
    main()
