"""How the Python step benchmarks time a step (resnet_step.py, bert_step.py), exactly as
step_timing.h does for their C++ sides: `warmup` steps, then windows of `window` steps until
`steps` have run, the device synchronised at each window's end; each window's rate is items per
second. Returns the rates, ascending."""
import time

import torch


def time_windows(step, device, warmup, steps, window, items_per_step):
    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize()

    for _ in range(warmup):
        step()
    sync()
    rates = []
    for _ in range(0, steps, window):
        t0 = time.perf_counter()
        for _ in range(window):
            step()
        sync()
        rates.append(items_per_step * window / (time.perf_counter() - t0))
    return sorted(rates)
