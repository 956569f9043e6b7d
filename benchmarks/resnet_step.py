"""One ResNet training step in Python PyTorch eager, timed exactly like resnet_step.cpp.

torchvision's resnet{18,34,50}, SGD(lr 0.1, momentum 0.9, weight decay 5e-5 without decay on
biases and norm weights, as train's optimizer groups them), cross-entropy, optional bf16 autocast
and channels_last, a fixed synthetic batch already on the device. Prints one JSON line with the
optimizer that ran ("sgd fused") and the parameter count, which compare_resnet.py checks against
the C++ side's.

--optim-impl picks torch.optim.SGD's implementation: fused (fused=True, the kernel train's
optim.impl auto runs where LibTorch has one), foreach (foreach=True), loop (foreach=False, one
parameter at a time, as torch::optim::SGD), or default (PyTorch's own choice: foreach on CUDA, the
loop on CPU). compare_resnet.py passes what the C++ side reports.
"""
import argparse
import json
import os

import torch
import torchvision

from step_timing import median, profile_steps, run_or_serve, time_windows


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--depth", type=int, default=50)
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--warmup", type=int, default=15)
    p.add_argument("--window", type=int, default=5)
    p.add_argument("--image", type=int, default=224)
    p.add_argument("--device", default="cuda")
    p.add_argument("--precision", default="bf16", choices=["bf16", "fp32"])
    p.add_argument("--channels-last", type=int, default=1)
    p.add_argument("--optim-impl", default="fused", choices=["fused", "foreach", "loop", "default"],
                   help="torch.optim.SGD: fused=True, foreach=True, the per-parameter loop (foreach=False, as "
                        "torch::optim::SGD), or PyTorch's default (foreach on CUDA, the loop on CPU); "
                        "compare_resnet.py passes the C++ side's")
    p.add_argument("--profile", default="",
                   help="FILE: instead of timing, profile --profile-steps steps after --warmup and write where the "
                        "time goes (kernels by kind and by name, operators) to FILE; prints the summary line")
    p.add_argument("--profile-steps", type=int, default=5)
    p.add_argument("--serve", type=int, default=0, choices=[0, 1],
                   help="1: set up once, then time and print a line for each 'run' on standard input")
    a = p.parse_args()
    for name in ("batch", "image", "steps", "window"):
        if getattr(a, name) < 1:
            p.error(f"--{name} must be >= 1")
    if a.warmup < 0:
        p.error("--warmup must be >= 0")
    if a.depth not in (18, 34, 50):
        p.error("--depth is 18, 34 or 50")

    device = torch.device(a.device)
    torch.backends.cudnn.benchmark = device.type == "cuda"
    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cudnn.allow_tf32 = True
    torch.manual_seed(0)
    model = getattr(torchvision.models, f"resnet{a.depth}")(num_classes=1000).to(device)
    memory_format = torch.channels_last if a.channels_last else torch.contiguous_format
    model = model.to(memory_format=memory_format)
    decay = [q for q in model.parameters() if q.dim() > 1]
    no_decay = [q for q in model.parameters() if q.dim() <= 1]
    impl = {"fused": {"fused": True}, "foreach": {"foreach": True}, "loop": {"foreach": False},
            "default": {}}[a.optim_impl]
    optimizer = torch.optim.SGD(
        [{"params": decay, "weight_decay": 5e-5}, {"params": no_decay, "weight_decay": 0.0}],
        lr=0.1, momentum=0.9, **impl)
    if a.optim_impl == "default":  # what PyTorch picks: foreach where all parameters are on CUDA
        ran = "foreach" if device.type == "cuda" else "loop"
    else:
        ran = a.optim_impl
    x = torch.randn(a.batch, 3, a.image, a.image, device=device).contiguous(memory_format=memory_format)
    y = torch.randint(0, 1000, (a.batch,), device=device)
    bf16 = a.precision == "bf16"

    def step():
        optimizer.zero_grad()
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16):
            loss = torch.nn.functional.cross_entropy(model(x).float(), y)
        loss.backward()
        optimizer.step()

    def run():
        rates = time_windows(step, device, a.warmup, a.steps, a.window, a.batch)
        print(json.dumps({"impl": "python", "pid": os.getpid(), "depth": a.depth, "batch": a.batch, "image": a.image,
                          "precision": a.precision, "channels_last": bool(a.channels_last),
                          "optimizer": f"sgd {ran}", "params": sum(q.numel() for q in model.parameters()),
                          "steps": a.steps, "windows": len(rates), "img_per_s": median(rates),
                          "min": rates[0], "max": rates[-1]}), flush=True)

    if a.profile:
        print(json.dumps(profile_steps(step, device, a.warmup, a.profile_steps, a.profile, a.batch, f"resnet_step.py resnet{a.depth} batch {a.batch} {a.image}px {a.precision}")),
              flush=True)
        return
    run_or_serve(a.serve, run)


if __name__ == "__main__":
    main()
