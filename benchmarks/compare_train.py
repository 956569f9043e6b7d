"""Training speed side by side: `train fit` against the same run in Python PyTorch (benchmarks/fit.py)
and against a minimal hand-written LibTorch loop (bench_raw_loop), on the same LibTorch.

For each round and each config, every implementation runs once, in an order that rotates from round
to round, so that a drift of the shared machine's speed hits all of them alike. Each run logs a
record every logging.every_steps steps; the steady-state speed of a run is the steps after its
first `--warmup-windows` windows divided by their time (start-up, data loading, the first
iterations' allocations and oneDNN primitive creation and the final evaluation are excluded). The
report gives the median steps/s of each implementation, the ratio of the medians, and the per-round
ratios (each taken between runs of the same round) with their median and range. Use an odd number
of rounds, 3 or more: the median of an even count is the mean of the two middle values.

    .venv/bin/python benchmarks/compare_train.py --train build/bin/train --raw build/bin/bench_raw_loop \\
        --rounds 5 --threads 2 configs/bench/mlp_fashion_mnist.yaml configs/bench/lenet_fashion_mnist.yaml \\
        --out /tmp/compare_train.json

Implementations (--impls, each optionally followed by `:key=value` overrides of its own; the first is
the base of the ratios):
  train           `train fit`; its SGD is what the config's optim.impl picks (auto = LibTorch's fused
                  SGD kernel on CPU from LibTorch 2.4), reported in the table
  python-fused    fit.py with torch.optim.SGD(fused=True): the same fused kernel as train's
                  (the headline comparison: same model, data, optimizer kernel; only the language
                  and the framework around the step differ)
  python          fit.py with torch.optim.SGD as PyTorch picks it: a per-parameter loop on CPU
  python-foreach  fit.py with torch.optim.SGD(foreach=True)
  raw             bench_raw_loop with torch::optim::SGD (a per-parameter loop)
  raw-fused       bench_raw_loop with LibTorch's fused SGD kernel (train's overhead baseline)
fit.py groups the parameters as train does (two groups; weight decay only on tensors of 2+
dimensions); bench_raw_loop does so when there is weight decay, else has one group.
"""
import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent


def parse_records(lines):
    records, summary = [], {}
    for line in lines:
        line = line.strip()
        if not line.startswith("{"):
            continue
        r = json.loads(line)
        if r.get("split") == "train":
            records.append(r)
        elif r.get("split") == "val":
            summary["accuracy"] = r.get("accuracy")
        elif r.get("done"):
            summary.update(r)
    return records, summary


def steady_state(records, warmup_windows):
    """Steps/s over the windows after the first `warmup_windows` (window time = step_time_ms x steps)."""
    records = sorted(records, key=lambda r: r["step"])
    prev, steps, ms = 0, 0, 0.0
    for i, r in enumerate(records):
        n = r["step"] - prev
        prev = r["step"]
        if i < warmup_windows:
            continue
        steps += n
        ms += r["step_time_ms"] * n
    if steps == 0:
        raise RuntimeError(f"no steady-state windows: {len(records)} windows, {warmup_windows} warm-up")
    return {"steps_per_s": 1000.0 * steps / ms, "timed_steps": steps, "mean_step_ms": ms / steps,
            "final_loss": records[-1]["loss"]}


def train_optim_impl(config, sets):
    """The SGD implementation `train fit CONFIG --set ...` runs on CPU, as make_optimizer picks it."""
    import torch  # noqa: E402 (the Python wheel holds the LibTorch that train links)
    import yaml  # noqa: E402
    with open(config) as f:
        impl = ((yaml.safe_load(f) or {}).get("optim") or {}).get("impl", "auto")
    for item in sets:  # later --set wins, as in train
        key, _, value = item.partition("=")
        if key == "optim.impl":
            impl = str(yaml.safe_load(value))
    if impl == "auto":
        major, minor = (int(x) for x in torch.__version__.split(".")[:2])
        impl = "fused" if (major, minor) >= (2, 4) else "foreach"
    return impl


def optimizer_label(spec, config, a, overrides):
    """Which SGD implementation an implementation spec steps with, in words for the report."""
    impl, *extra = spec.split(":")
    if impl == "train":
        return f"sgd {train_optim_impl(config, overrides + extra)} (train's make_optimizer)"
    if impl.startswith("python"):
        variant = impl.partition("-")[2] or "default"
        return {"default": "sgd loop (torch.optim.SGD, PyTorch's default on CPU)",
                "foreach": "sgd foreach (torch.optim.SGD(foreach=True))",
                "fused": "sgd fused (torch.optim.SGD(fused=True))"}[variant]
    return {"raw": "sgd loop (torch::optim::SGD)", "raw-fused": "sgd fused (at::_fused_sgd_)"}[impl]


def paired(base_runs, other_runs):
    return [x["steps_per_s"] / y["steps_per_s"] for x, y in zip(base_runs, other_runs)]


def run_one(spec, config, a, overrides):
    """Runs one implementation (`impl[:key=value]...`) on one config; returns its measurement."""
    impl, *extra = spec.split(":")
    sets = [f"trainer.threads={a.threads}"] + overrides + extra
    set_args = [x for s in sets for x in ("--set", s)]
    run_dir = None
    if impl == "train":
        run_dir = tempfile.mkdtemp(prefix="compare_train_")
        cmd = [a.train, "fit", config, "--run-dir", run_dir] + set_args
    elif impl.startswith("python"):
        variant = impl.partition("-")[2] or "default"
        cmd = [a.python, str(HERE / "fit.py"), config, "--optim-impl", variant] + set_args
        if not a.eval:
            cmd.append("--no-eval")
    elif impl.startswith("raw"):
        cmd = [a.raw, config, "--optim", "fused" if impl == "raw-fused" else "torch"] + set_args
        if not a.eval:
            cmd.append("--no-eval")
    else:
        raise ValueError(f"unknown implementation {impl}")
    load_before = os.getloadavg()[0]
    t0 = time.time()
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=a.timeout)
    wall = time.time() - t0
    if out.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} exited {out.returncode}:\n{out.stdout[-2000:]}\n{out.stderr[-4000:]}")
    try:
        if impl == "train":
            lines = Path(run_dir, "metrics.jsonl").read_text().splitlines()
        else:
            lines = out.stdout.splitlines()
        records, summary = parse_records(lines)
        # The memory format each side ran: train's from its plan, the others' from their summary.
        channels_last = (json.loads(Path(run_dir, "plan.json").read_text())["channels_last"] if impl == "train"
                         else summary.get("channels_last"))
    finally:
        if run_dir:
            shutil.rmtree(run_dir, ignore_errors=True)
    result = steady_state(records, a.warmup_windows)
    result.update({"wall_s": round(wall, 2), "load_before": load_before, "accuracy": summary.get("accuracy"),
                   "channels_last": channels_last})
    return result


def host_info():
    cpu = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {"cpu": cpu, "cores": len(os.sched_getaffinity(0)), "platform": platform.platform(),
            "python": platform.python_version(), "date": time.strftime("%Y-%m-%d %H:%M:%S %Z")}


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    p.add_argument("configs", nargs="+")
    p.add_argument("--train", default="build/bin/train")
    p.add_argument("--raw", default="build/bin/bench_raw_loop")
    p.add_argument("--python", default=sys.executable)
    p.add_argument("--impls", nargs="+", default=["train", "python-fused", "python", "raw-fused"],
                   help="implementations, each optionally with config overrides of its own: "
                        "train:data.workers=0 (see below); the first is the base of the ratios")
    p.add_argument("--rounds", type=int, default=3, help="interleaved rounds; odd and >= 3 for a true median")
    p.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    p.add_argument("--warmup-windows", type=int, default=1, help="logging windows excluded at the start of each run")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="config override passed to every implementation")
    p.add_argument("--eval", action="store_true", help="let fit.py and bench_raw_loop evaluate too (train always does)")
    p.add_argument("--timeout", type=int, default=1800)
    p.add_argument("--out", default="")
    a = p.parse_args()
    impls = a.impls
    if a.rounds < 1:
        p.error("--rounds must be >= 1")
    if a.rounds < 3 or a.rounds % 2 == 0:
        print(f"warning: {a.rounds} rounds: the medians below are not a middle run; use an odd number >= 3",
              file=sys.stderr, flush=True)

    import torch  # noqa: E402 (only for the version in the report)
    report = {"host": host_info(), "torch": torch.__version__, "args": vars(a), "results": {}}
    print(f"{report['host']['cpu']}, {report['host']['cores']} cores, torch {torch.__version__}, "
          f"{a.threads} threads, load {os.getloadavg()[0]:.2f}", flush=True)
    runs = {c: {i: [] for i in impls} for c in a.configs}
    for r in range(a.rounds):
        for config in a.configs:
            order = impls[r % len(impls):] + impls[:r % len(impls)]
            for impl in order:
                res = run_one(impl, config, a, a.overrides)
                res["round"] = r
                # The same memory format on every side (the plan's: fit.py and bench_raw_loop
                # apply train's rule), or the comparison measures a setting, not an implementation.
                formats = {x["channels_last"] for rs in runs[config].values() for x in rs} | {res["channels_last"]}
                if len(formats) > 1:
                    sys.exit(f"{config}: {impl} ran with channels_last={res['channels_last']}, an earlier run "
                             f"with {formats - {res['channels_last']}}: not comparable")
                runs[config][impl].append(res)
                print(f"round {r} {Path(config).stem} {impl}: {res['steps_per_s']:.4g} steps/s "
                      f"({res['mean_step_ms']:.3f} ms/step over {res['timed_steps']} steps, loss {res['final_loss']:.4f}, "
                      f"load {res['load_before']:.2f}, {res['wall_s']} s)", flush=True)

    print()
    for config in a.configs:
        by_impl = runs[config]
        summary = {"runs": by_impl, "optimizer": {i: optimizer_label(i, config, a, a.overrides) for i in impls},
                   "median_steps_per_s": {}, "ratio_of_medians": {}, "paired_ratios": {}, "median_paired_ratio": {}}
        for impl, results in by_impl.items():
            summary["median_steps_per_s"][impl] = statistics.median(x["steps_per_s"] for x in results)
        base = impls[0]
        for impl in impls[1:]:
            key = f"{base}/{impl}"
            summary["ratio_of_medians"][key] = summary["median_steps_per_s"][base] / summary["median_steps_per_s"][impl]
            summary["paired_ratios"][key] = paired(by_impl[base], by_impl[impl])
            summary["median_paired_ratio"][key] = statistics.median(summary["paired_ratios"][key])
        report["results"][config] = summary
        print(f"{config}: {a.rounds} interleaved rounds, {a.threads} threads, "
              f"channels_last {by_impl[impls[0]][0]['channels_last']} on every side")
        print("| impl | optimizer | rounds (steps/s) | median steps/s | median ms/step |")
        print("|---|---|---|---|---|")
        for impl, results in by_impl.items():
            med = summary["median_steps_per_s"][impl]
            rounds = ', '.join('%.4g' % x['steps_per_s'] for x in results)
            print(f"| {impl} | {summary['optimizer'][impl]} | {rounds} | {med:.4g} | {1000 / med:.4g} |")
        print("| ratio | per round | paired median (range) | ratio of medians |")
        print("|---|---|---|---|")
        for key, ratio in summary["ratio_of_medians"].items():
            pr = summary["paired_ratios"][key]
            print(f"| {key} | {', '.join(f'{x:.3f}' for x in pr)} | {statistics.median(pr):.3f} "
                  f"({min(pr):.3f}-{max(pr):.3f}) | {ratio:.3f} |")
        if "train" in by_impl and "python-fused" in by_impl:
            t, f = summary["optimizer"]["train"].split()[1], summary["optimizer"]["python-fused"].split()[1]
            if t != f:
                print(f"warning: train steps with sgd {t}, python-fused with sgd {f}: not the same optimizer kernel")
        print()
    loads = [x["load_before"] for c in runs.values() for rs in c.values() for x in rs]
    report["load_before_runs"] = {"min": min(loads), "median": statistics.median(loads), "max": max(loads)}
    print(f"load average before runs: min {min(loads):.2f}, median {statistics.median(loads):.2f}, max {max(loads):.2f}")
    if a.out:
        Path(a.out).write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
