"""How the Python step benchmarks time a step (resnet_step.py, bert_step.py), exactly as
step_timing.h does for their C++ sides: `warmup` steps, then windows of `window` steps until
exactly `steps` have run (the last window shorter when `window` does not divide `steps`), the
device synchronised at each window's end; each window's rate is items per second. Returns the
rates, ascending. The median of an even number of windows is the mean of the two middle ones, on
both sides."""
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
