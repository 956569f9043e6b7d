"""PyTorch's DistributedDataParallel on the workload of ddp_step.cpp, timed the same way.

torchvision's resnet18 with the small-input stem (3x3 stride-1 conv1, no max-pool), 10 classes,
SGD(lr 0.1, momentum 0.9, weight decay 5e-4 without decay on biases and norm weights, as train
groups them) in the implementation --optim-impl names (fused=True, foreach=True, or the
per-parameter loop; compare_ddp.py passes what the C++ side ran), a fixed synthetic batch per rank,
Gloo. Windows of full DDP steps, no_sync steps and the gradient allreduce alone are interleaved,
each kind exactly --steps times (the last window shorter when --window does not divide it); rank 0
prints one JSON line with the medians (the mean of the two middle windows for an even count, as
ddp_step.cpp), the optimizer and the parameter count.

    torchrun --nproc-per-node 2 benchmarks/ddp_step.py --batch 32 --steps 20
"""
import argparse
import json
import os
import sys
import time

import torch
import torch.distributed as dist
import torchvision

from step_timing import median


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--window", type=int, default=2)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--bucket-mb", type=float, default=25)
    p.add_argument("--optim-impl", default="fused", choices=["fused", "foreach", "loop"],
                   help="torch.optim.SGD(fused=True), (foreach=True) or the per-parameter loop (foreach=False); "
                        "compare_ddp.py passes the C++ side's")
    a = p.parse_args()
    for name in ("batch", "steps", "window", "threads"):
        if getattr(a, name) < 1:
            p.error(f"--{name} must be >= 1")
    if a.warmup < 0 or not a.bucket_mb > 0:
        p.error("--warmup must be >= 0 and --bucket-mb > 0")
    torch.set_num_threads(a.threads)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()

    torch.manual_seed(0)
    model = torchvision.models.resnet18(num_classes=10)
    model.conv1 = torch.nn.Conv2d(3, 64, 3, 1, 1, bias=False)
    model.maxpool = torch.nn.Identity()
    ddp = torch.nn.parallel.DistributedDataParallel(model, bucket_cap_mb=a.bucket_mb)
    decay = [q for q in model.parameters() if q.dim() > 1]
    no_decay = [q for q in model.parameters() if q.dim() <= 1]
    impl = {"fused": {"fused": True}, "foreach": {"foreach": True}, "loop": {"foreach": False}}[a.optim_impl]
    optimizer = torch.optim.SGD([{"params": decay, "weight_decay": 5e-4}, {"params": no_decay, "weight_decay": 0.0}],
                                lr=0.1, momentum=0.9, **impl)
    torch.manual_seed(1 + rank)
    x = torch.randn(a.batch, 3, 32, 32)
    y = torch.randint(0, 10, (a.batch,))

    def step(communicate):
        optimizer.zero_grad()
        if communicate:
            loss = torch.nn.functional.cross_entropy(ddp(x), y)
            loss.backward()
        else:
            with ddp.no_sync():
                loss = torch.nn.functional.cross_entropy(ddp(x), y)
                loss.backward()
        optimizer.step()

    flat = torch.cat([torch.zeros_like(q).reshape(-1) for q in model.parameters()])
    bucket = int(a.bucket_mb * (1 << 20)) // 4

    def comm_only():
        for off in range(0, flat.numel(), bucket):
            dist.all_reduce(flat[off:off + bucket])

    for _ in range(a.warmup):
        step(True)
    dist.barrier()
    runs = {"ddp": [], "local": [], "comm": []}
    done = 0
    while done < a.steps:
        n = min(a.window, a.steps - done)
        for name, fn in (("ddp", lambda: step(True)), ("local", lambda: step(False)), ("comm", comm_only)):
            t0 = time.perf_counter()
            for _ in range(n):
                fn()
            dist.barrier()
            runs[name].append((time.perf_counter() - t0) / n)
        done += n
    med = {k: median(sorted(v)) for k, v in runs.items()}
    hidden = min(1.0, max(0.0, 1.0 - (med["ddp"] - med["local"]) / med["comm"])) if med["comm"] > 0 else 0.0
    if rank == 0:
        print(json.dumps({"impl": "python", "world": world, "batch_per_rank": a.batch, "threads": a.threads,
                          "optimizer": f"sgd {a.optim_impl}", "params": sum(q.numel() for q in model.parameters()),
                          "steps": a.steps,
                          "grad_mb": flat.numel() * 4 / 1e6, "step_s": med["ddp"], "local_step_s": med["local"],
                          "comm_s": med["comm"], "hidden": hidden, "windows": len(runs["ddp"]),
                          "img_per_s": a.batch * world / med["ddp"]}), flush=True)
    # Both ranks are done; leave without destroy_process_group(), which was seen to hang at exit
    # with Gloo on 2.11 after the result was printed.
    dist.barrier()
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
