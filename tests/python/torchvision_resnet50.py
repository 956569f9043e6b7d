"""torchvision ResNet-50 oracle for tests/test_safetensors.cpp.

  torchvision_resnet50.py check WEIGHTS.safetensors IO.safetensors
      Loads weights written by `train export` into torchvision.models.resnet50() with
      strict=True, runs IO's "input" in eval mode and compares with IO's "logits" (|diff| <= 1e-4 x the largest |logit|).
  torchvision_resnet50.py make DIR
      A seeded, randomly initialised torchvision resnet50() with non-trivial BatchNorm statistics
      (calibrated on a random batch): saves its state dict with torch.save as DIR/resnet50.pth
      (what torchvision's pretrained downloads are) and "input"/"logits" as DIR/resnet50_io.safetensors.

Exits 1 on a mismatch, 2 on bad usage or a missing package.
"""
import os
import sys

try:
    import torch
    import torchvision
    from safetensors.torch import load_file, save_file
except ImportError as e:
    print(f"torchvision_resnet50: missing package: {e}; run scripts/setup", file=sys.stderr)
    sys.exit(2)

# Relative to the largest logit: the two sides may run different BLAS and oneDNN builds (Debian's
# LibTorch 1.13 calls OpenBLAS, the wheel MKL), and 53 fp32 layers drift ~2.5e-5 of the logit
# scale between them. A wrong or transposed weight moves logits by O(1).
TOLERANCE = 1e-4


def check(weights_path, io_path):
    model = torchvision.models.resnet50()
    state = load_file(weights_path)
    model.load_state_dict(state, strict=True)  # raises on a missing or unexpected key
    model.eval()
    io = load_file(io_path)
    with torch.no_grad():
        logits = model(io["input"])
    diff = (logits - io["logits"]).abs().max().item()
    scale = io["logits"].abs().max().item()
    tolerance = TOLERANCE * max(1.0, scale)
    print(f"torchvision_resnet50: {len(state)} tensors loaded strictly; max |logit diff| {diff:.3g} "
          f"(logits up to {scale:.3g}, tolerance {tolerance:.3g})")
    return 0 if diff <= tolerance else 1


def make(out_dir):
    torch.manual_seed(1234)
    model = torchvision.models.resnet50()
    bns = [m for m in model.modules() if isinstance(m, torch.nn.BatchNorm2d)]
    with torch.no_grad():
        for bn in bns:
            bn.weight.uniform_(0.5, 1.5)
            bn.bias.normal_(0, 0.1)
            bn.momentum = 1.0  # running statistics = the calibration batch's
        model.train()
        model(torch.randn(4, 3, 64, 64))
        for bn in bns:
            bn.momentum = 0.1
    model.eval()
    x = torch.randn(2, 3, 64, 64)
    with torch.no_grad():
        logits = model(x)
    os.makedirs(out_dir, exist_ok=True)
    torch.save(model.state_dict(), os.path.join(out_dir, "resnet50.pth"))
    save_file({"input": x.contiguous(), "logits": logits.contiguous()}, os.path.join(out_dir, "resnet50_io.safetensors"),
              metadata={"producer": f"tests/python/torchvision_resnet50.py, torchvision {torchvision.__version__}"})
    return 0


def main(argv):
    if len(argv) == 4 and argv[1] == "check":
        return check(argv[2], argv[3])
    if len(argv) == 3 and argv[1] == "make":
        return make(argv[2])
    print(__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv))
