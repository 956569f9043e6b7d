"""The Python PyTorch side of the `train fit` benchmarks: the same run, written the way a PyTorch user
would write it, from the same config file.

    .venv/bin/python benchmarks/fit.py configs/bench/mlp_fashion_mnist.yaml [--set trainer.threads=2] ...

It reads the config that `train fit` reads and refuses any setting it does not reproduce, so the two
runs cannot drift apart silently. What it reproduces:
  - model: `mlp`, `lenet` (as in libtrain/src/models/small.cpp) or `resnet18` (torchvision's, with
    train's small-input stem when model.small_input: a 3x3 stride-1 conv, no max-pool);
  - data: the IDX files (plain or .gz) under data.root, scaled to [0, 1], normalised with
    data.mean / data.std; a new shuffle every epoch (data.shuffle), batches of
    trainer.global_batch, the last incomplete batch of an epoch dropped;
  - SGD with optim.lr / momentum / nesterov / weight_decay, a constant learning rate, fp32,
    cross-entropy, trainer.max_steps steps, torch.set_num_threads(trainer.threads or the cores);
    the parameters in train's two groups (make_optimizer): weight decay only on tensors of 2+
    dimensions, none on biases and normalisation weights unless optim.decay_norm_and_bias;
  - the plan's memory format: precision.channels_last on/off as given, auto = channels_last when
    PyTorch has oneDNN and every convolution has 16+ output channels (train's plan on a CPU);
  - torch.optim.SGD's implementation from --optim-impl, not from optim.impl (compare_train.py
    states which one each side used): `default` is PyTorch's own choice, a per-parameter loop on
    CPU; `fused` is the fused SGD kernel that train's `optim.impl: auto` runs on CPU (LibTorch >= 2.4).
The images are held in one normalised float tensor and each batch is gathered from it by index:
the fastest way to feed a small dataset in eager PyTorch (a DataLoader costs more per batch).

Output: one JSON line per logging window, in the shape of train's metrics.jsonl records
({"split": "train", "step", "loss", "step_time_ms", ...}), then one summary line with "done": true
and the test accuracy (evaluated after the timed part).
"""
import argparse
import copy
import gzip
import json
import os
import sys
import time

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
import yaml


# ---- config -------------------------------------------------------------------------------------

DEFAULTS = {
    "model": {"num_classes": 10, "in_channels": 3, "width": 1.0, "small_input": False, "init_from": ""},
    "data": {"kind": "idx", "train_images": "train-images-idx3-ubyte", "train_labels": "train-labels-idx1-ubyte",
             "val_images": "t10k-images-idx3-ubyte", "val_labels": "t10k-labels-idx1-ubyte",
             "mean": [], "std": [], "random_crop": False, "random_flip": False, "shuffle": True, "drop_last": True},
    "optim": {"name": "sgd", "lr": 0.1, "momentum": 0.9, "nesterov": False, "weight_decay": 0.0,
              "decay_norm_and_bias": False, "clip_grad_norm": 0.0, "impl": "auto"},
    "schedule": {"name": "cosine", "warmup_steps": 0, "warmup_epochs": 0.0},
    "loss": {"label_smoothing": 0.0},
    "trainer": {"epochs": 0, "max_steps": 0, "seed": 0, "threads": 0, "eval_batch": 0},
    "precision": {"mode": "auto", "channels_last": "auto"},
    "logging": {"every_steps": 50},
}


def load_config(path, overrides):
    with open(path) as f:
        config = yaml.safe_load(f) or {}
    merged = copy.deepcopy(DEFAULTS)
    for section, values in config.items():
        merged.setdefault(section, {}).update(values or {})
    for item in overrides:  # --set section.key=value, the value parsed as YAML like train does
        key, _, value = item.partition("=")
        section, _, name = key.partition(".")
        if not name:
            sys.exit(f"--set {item}: expected section.key=value")
        merged.setdefault(section, {})[name] = yaml.safe_load(value)
    return merged


def require(ok, message):
    if not ok:
        sys.exit(f"fit.py: {message}; this script reproduces only the benchmark configs' settings")


def check_supported(c):
    require(c["model"]["name"] in ("mlp", "lenet", "resnet18"), f"model.name {c['model']['name']!r}")
    require(not c["model"]["init_from"], "model.init_from")
    require(c["data"]["kind"] == "idx", f"data.kind {c['data']['kind']!r} (idx only)")
    require(not c["data"]["random_crop"] and not c["data"]["random_flip"], "data augmentation")
    require(c["data"]["drop_last"], "data.drop_last false")
    require(c["optim"]["name"] == "sgd", f"optim.name {c['optim']['name']!r}")
    require(c["optim"]["clip_grad_norm"] == 0, "optim.clip_grad_norm")
    require(c["schedule"]["name"] == "constant", f"schedule.name {c['schedule']['name']!r} (constant only)")
    require(c["schedule"]["warmup_steps"] == 0 and c["schedule"]["warmup_epochs"] == 0, "a warmup")
    require(c["loss"]["label_smoothing"] == 0, "loss.label_smoothing")
    require(c["precision"]["mode"] in ("auto", "fp32"), f"precision.mode {c['precision']['mode']!r}")
    require(c["trainer"]["max_steps"] > 0, "trainer.max_steps must be set")
    require(c["trainer"]["epochs"] == 0, "trainer.epochs (use max_steps)")
    require(not c.get("tuning", {}).get("micro_batch"), "tuning.micro_batch")


# ---- data ---------------------------------------------------------------------------------------

def find_data_file(root, stem):
    for path in (os.path.join(root, stem), os.path.join(root, stem + ".gz")):
        if os.path.isfile(path):
            return path
    sys.exit(f"data file not found: neither {os.path.join(root, stem)} nor its .gz exists")


def read_idx(path):
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rb") as f:
        data = f.read()
    rank = data[3]
    dims = [int.from_bytes(data[4 + 4 * i: 8 + 4 * i], "big") for i in range(rank)]
    return np.frombuffer(data, dtype=np.uint8, offset=4 + 4 * rank).reshape(dims)


def load_split(c, train):
    d = c["data"]
    images = read_idx(find_data_file(d["root"], d["train_images" if train else "val_images"]))
    labels = read_idx(find_data_file(d["root"], d["train_labels" if train else "val_labels"]))
    x = torch.from_numpy(images.copy()).unsqueeze(1).float().div_(255.0)  # [N, 1, H, W]
    if d["mean"]:
        mean = torch.tensor(d["mean"]).view(1, -1, 1, 1)
        std = torch.tensor(d["std"]).view(1, -1, 1, 1)
        x = (x - mean) / std
    return x.contiguous(), torch.from_numpy(labels.astype(np.int64))


# ---- models -------------------------------------------------------------------------------------

class Mlp(nn.Module):
    def __init__(self, in_channels, num_classes):
        super().__init__()
        self.fc1 = nn.Linear(in_channels * 28 * 28, 512)
        self.fc2 = nn.Linear(512, 512)
        self.fc3 = nn.Linear(512, num_classes)

    def forward(self, x):
        x = F.relu(self.fc1(x.flatten(1)))
        x = F.relu(self.fc2(x))
        return self.fc3(x)


class LeNet(nn.Module):
    def __init__(self, in_channels, num_classes):
        super().__init__()
        self.conv1 = nn.Conv2d(in_channels, 6, 5, padding=2)
        self.conv2 = nn.Conv2d(6, 16, 5)
        self.fc1 = nn.Linear(16 * 5 * 5, 120)
        self.fc2 = nn.Linear(120, 84)
        self.fc3 = nn.Linear(84, num_classes)

    def forward(self, x):
        x = F.max_pool2d(F.relu(self.conv1(x)), 2)
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)
        x = F.relu(self.fc1(x.flatten(1)))
        x = F.relu(self.fc2(x))
        return self.fc3(x)


def build_model(m):
    if m["name"] == "mlp":
        return Mlp(m["in_channels"], m["num_classes"])
    if m["name"] == "lenet":
        return LeNet(m["in_channels"], m["num_classes"])
    import torchvision
    require(m["width"] == 1.0, "model.width other than 1.0 for resnet18")
    model = torchvision.models.resnet18(num_classes=m["num_classes"])
    if m["small_input"]:
        model.conv1 = nn.Conv2d(m["in_channels"], 64, 3, stride=1, padding=1, bias=False)
        nn.init.kaiming_normal_(model.conv1.weight, mode="fan_out", nonlinearity="relu")
        model.maxpool = nn.Identity()
    elif m["in_channels"] != 3:
        model.conv1 = nn.Conv2d(m["in_channels"], 64, 7, stride=2, padding=3, bias=False)
    return model


# ---- the run ------------------------------------------------------------------------------------

def param_groups(model, o):
    """train's make_optimizer groups: weight decay on tensors of 2+ dimensions, none on biases and
    normalisation weights (unless optim.decay_norm_and_bias); empty groups left out, as train does."""
    params = [q for q in model.parameters() if q.requires_grad]
    if o["decay_norm_and_bias"]:
        decay, no_decay = params, []
    else:
        decay, no_decay = [q for q in params if q.dim() > 1], [q for q in params if q.dim() <= 1]
    groups = [{"params": decay, "weight_decay": float(o["weight_decay"])}, {"params": no_decay, "weight_decay": 0.0}]
    return [g for g in groups if g["params"]]


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("config")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--optim-impl", default="default", choices=["default", "foreach", "fused"],
                   help="torch.optim.SGD's implementation; default = PyTorch's choice (a per-parameter "
                        "loop on CPU)")
    p.add_argument("--no-eval", action="store_true", help="skip the test-set evaluation after the timed part")
    a = p.parse_args()
    c = load_config(a.config, a.overrides)
    check_supported(c)
    t, o = c["trainer"], c["optim"]
    threads = t["threads"] or len(os.sched_getaffinity(0))
    torch.set_num_threads(threads)
    torch.manual_seed(t["seed"])
    batch, max_steps = t["global_batch"], t["max_steps"]
    log_every = max(1, c["logging"]["every_steps"])

    images, labels = load_split(c, train=True)
    require(images.size(1) == c["model"]["in_channels"], "model.in_channels differs from the data's channels")
    model = build_model(c["model"])
    model.train()
    cl = c["precision"]["channels_last"]
    require(cl in ("auto", "on", "off"), f"precision.channels_last {cl!r}")
    widths = [m.out_channels for m in model.modules() if isinstance(m, nn.Conv2d)]
    channels_last = cl == "on" or (cl == "auto" and bool(widths) and min(widths) >= 16
                                   and torch.backends.mkldnn.is_available())
    memory_format = torch.channels_last if channels_last else torch.contiguous_format
    model = model.to(memory_format=memory_format)
    impl = {"default": {}, "foreach": {"foreach": True}, "fused": {"fused": True}}[a.optim_impl]
    # float(): YAML 1.1 reads "1e-4" (no dot) as a string; train reads it as a number.
    optimizer = torch.optim.SGD(param_groups(model, o), lr=float(o["lr"]), momentum=float(o["momentum"]),
                                nesterov=o["nesterov"], **impl)

    generator = torch.Generator().manual_seed(t["seed"])
    steps_per_epoch = images.size(0) // batch
    window_loss = torch.zeros((), dtype=torch.float64)
    step, epoch, window_steps = 0, 0, 0
    started = time.perf_counter()
    window_start = started
    last_loss = float("nan")
    while step < max_steps:
        order = torch.randperm(images.size(0), generator=generator) if c["data"]["shuffle"] \
            else torch.arange(images.size(0))
        for b in range(steps_per_epoch):
            index = order[b * batch:(b + 1) * batch]
            x, y = images[index].contiguous(memory_format=memory_format), labels[index]
            optimizer.zero_grad()
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            optimizer.step()
            window_loss += loss.detach()
            step += 1
            window_steps += 1
            if step % log_every == 0 or step == max_steps:
                now = time.perf_counter()
                last_loss = window_loss.item() / window_steps
                print(json.dumps({"impl": "python", "split": "train", "step": step, "epoch": epoch,
                                  "loss": last_loss, "step_time_ms": 1000.0 * (now - window_start) / window_steps}),
                      flush=True)
                window_loss.zero_()
                window_steps = 0
                window_start = time.perf_counter()
            if step == max_steps:
                break
        epoch += 1
    train_seconds = time.perf_counter() - started

    summary = {"impl": "python", "done": True, "steps": step, "threads": threads, "train_loss": last_loss,
               "train_seconds": train_seconds, "torch": torch.__version__, "optim_impl": a.optim_impl,
               "channels_last": channels_last}
    if not a.no_eval:
        val_x, val_y = load_split(c, train=False)
        model.eval()
        eval_batch = t["eval_batch"] or batch
        correct = 0
        with torch.no_grad():
            for i in range(0, val_x.size(0), eval_batch):
                x = val_x[i:i + eval_batch].contiguous(memory_format=memory_format)
                correct += (model(x).argmax(1) == val_y[i:i + eval_batch]).sum().item()
        summary["accuracy"] = correct / val_x.size(0)
    print(json.dumps(summary), flush=True)


if __name__ == "__main__":
    main()
