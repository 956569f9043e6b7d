"""How the Python step benchmarks time a step (resnet_step.py, bert_step.py), exactly as
step_timing.h does for their C++ sides: `warmup` steps, then windows of `window` steps until
exactly `steps` have run (the last window shorter when `window` does not divide `steps`), the
device synchronised at each window's end; each window's rate is items per second. Returns the
rates, ascending. The median of an even number of windows is the mean of the two middle ones, on
both sides."""
import json
import sys
import time

import torch


def median(sorted_values):
    """The median of an ascending, non-empty list, as step_timing.h's median_of_sorted()."""
    n = len(sorted_values)
    return sorted_values[n // 2] if n % 2 else (sorted_values[n // 2 - 1] + sorted_values[n // 2]) / 2


def time_windows(step, device, warmup, steps, window, items_per_step):
    if steps < 1 or window < 1 or warmup < 0:
        raise ValueError(f"steps and window must be >= 1 and warmup >= 0, got {steps}, {window}, {warmup}")

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize()

    for _ in range(warmup):
        step()
    sync()
    rates = []
    done = 0
    while done < steps:
        n = min(window, steps - done)
        t0 = time.perf_counter()
        for _ in range(n):
            step()
        sync()
        rates.append(items_per_step * n / (time.perf_counter() - t0))
        done += n
    return sorted(rates)


def run_or_serve(serve, run):
    """Runs `run` (warmup, timed windows, one JSON line) once; or, with `serve`, prints "ready" and
    runs once per line "run" on standard input until "quit" or the end of input, as step_timing.h's
    run_or_serve() does for the C++ sides (compare_resnet.py and compare_bert.py alternate two kept
    processes this way)."""
    if not serve:
        run()
        return
    print("ready", flush=True)
    for line in sys.stdin:
        command = line.strip()
        if command == "quit":
            break
        if command != "run":
            sys.exit(f"unknown command {command!r} (run or quit)")
        run()


def profile_steps(step, device, warmup, steps, path, items_per_step, label):
    """Runs `warmup` steps, then `steps` steps under torch.profiler, and writes to `path` where the
    time goes. On a GPU: the wall time per step against the time the GPU spent in kernels (their
    ratio says whether the host or the device sets the pace: CUDA graphs or a faster host loop only
    help when the GPU idles); the kernels' time by kind, told apart by kernel name (matrix
    multiplies and convolutions, attention, and the rest: element-wise, normalisation, reductions,
    copies); the 40 kernels and the 40 operators that took the most. On a CPU: the operators by
    self CPU time. The profiler itself slows the host a little, so the wall time here runs above
    time_windows'. Returns the summary (a dict), which also heads the file."""
    from torch.profiler import ProfilerActivity, profile

    cuda = device.type == "cuda"

    def sync():
        if cuda:
            torch.cuda.synchronize()

    for _ in range(warmup):
        step()
    sync()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as prof:
        t0 = time.perf_counter()
        for _ in range(steps):
            step()
        sync()
        wall_us = (time.perf_counter() - t0) * 1e6
    summary = {"label": label, "device": str(device), "steps": steps, "torch": torch.__version__,
               "wall_ms_per_step": wall_us / steps / 1e3, "items_per_s": items_per_step * steps / (wall_us / 1e6)}
    lines = []
    if cuda:
        kernels = [e for e in prof.events() if str(getattr(e, "device_type", "")).endswith("CUDA")]
        by_kind = {"matmul_conv": 0.0, "attention": 0.0, "other": 0.0}
        by_name = {}
        for e in kernels:
            us = e.time_range.elapsed_us()  # a kernel's own span on the GPU
            name = e.name.lower()
            if any(k in name for k in ("flash", "fmha", "attention", "sdpa")):
                kind = "attention"
            elif any(k in name for k in ("gemm", "nvjet", "cutlass", "xmma", "cublas", "matmul", "conv", "fprop",
                                         "dgrad", "wgrad")):
                kind = "matmul_conv"
            else:
                kind = "other"
            by_kind[kind] += us
            count, total = by_name.get(e.name, (0, 0.0))
            by_name[e.name] = (count + 1, total + us)
        busy_us = sum(by_kind.values())
        summary.update({"gpu_busy_ms_per_step": busy_us / steps / 1e3,
                        "gpu_busy_fraction": busy_us / wall_us if wall_us else 0.0,
                        "kernels_per_step": len(kernels) / steps,
                        "ms_per_step_by_kind": {k: v / steps / 1e3 for k, v in by_kind.items()}})
        lines.append(f"{'kernel':<100} {'calls/step':>10} {'ms/step':>9} {'share':>6}")
        for name, (count, total) in sorted(by_name.items(), key=lambda kv: -kv[1][1])[:40]:
            lines.append(f"{name[:100]:<100} {count / steps:>10.1f} {total / steps / 1e3:>9.3f} "
                         f"{100 * total / busy_us if busy_us else 0:>5.1f}%")
        lines.append("")
    averages = prof.key_averages()
    sort_key = "self_cpu_time_total"
    if cuda:  # PyTorch 2.x names it device time, 1.13 CUDA time
        sort_key = "self_device_time_total" if len(averages) and hasattr(averages[0], "self_device_time_total") \
            else "self_cuda_time_total"
    lines.append(averages.table(sort_by=sort_key, row_limit=40, max_name_column_width=60))
    with open(path, "w") as f:
        f.write(json.dumps(summary) + "\n\n" + "\n".join(lines) + "\n")
    return summary
