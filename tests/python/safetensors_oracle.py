"""safetensors oracle for tests/test_safetensors.cpp, using the `safetensors` package itself.

  safetensors_oracle.py write OUT.safetensors   writes the reference tensors (below) and metadata
  safetensors_oracle.py check IN.safetensors    checks that a file written by train holds exactly them

The reference tensors, mirrored in test_safetensors.cpp (`reference_tensors`):
  "<DT>" for each dtype DT: shape [2, 3], values (arange(6) - 2) * step where step is 0.5 for
  floating types and 1 for integers; U8 is arange(6); BOOL is arange(6) % 2 == 1.
  "scalar": F32, shape [], 3.5.   "empty": F32, shape [0, 4].
Metadata: {"producer": "<who>", "note": "héllo \"quoted\""}.
Exits 1 with a message on any difference, 2 on bad usage or a missing package.
"""
import sys

try:
    import torch
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file
except ImportError as e:  # the C++ test fails on a non-zero exit: a missing oracle is a failure
    print(f"safetensors_oracle: missing package: {e}; run scripts/setup", file=sys.stderr)
    sys.exit(2)

DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
    "U8": torch.uint8, "BOOL": torch.bool,
}


def reference():
    out = {}
    base = torch.arange(6, dtype=torch.float64).reshape(2, 3)
    for name, dt in DTYPES.items():
        if dt == torch.bool:
            out[name] = (base.to(torch.int64) % 2 == 1)
        elif dt == torch.uint8:
            out[name] = base.to(dt)
        elif dt.is_floating_point:
            out[name] = ((base - 2) * 0.5).to(dt)
        else:
            out[name] = (base - 2).to(dt)
    out["scalar"] = torch.tensor(3.5, dtype=torch.float32)
    out["empty"] = torch.zeros(0, 4, dtype=torch.float32)
    return out


NOTE = 'héllo "quoted"'


def check(path):
    got = load_file(path)
    with safe_open(path, framework="pt") as f:
        meta = f.metadata() or {}
    want = reference()
    problems = []
    if set(got) != set(want):
        problems.append(f"keys {sorted(got)} != {sorted(want)}")
    for k, w in want.items():
        g = got.get(k)
        if g is None:
            continue
        if g.dtype != w.dtype or tuple(g.shape) != tuple(w.shape) or not torch.equal(g, w):
            problems.append(f"{k}: got {g.dtype} {tuple(g.shape)} {g.flatten().tolist()}, "
                            f"want {w.dtype} {tuple(w.shape)} {w.flatten().tolist()}")
    if meta.get("note") != NOTE or meta.get("producer") != "train":
        problems.append(f"metadata {meta}")
    for p in problems:
        print(f"safetensors_oracle: {path}: {p}", file=sys.stderr)
    return 1 if problems else 0


def main(argv):
    if len(argv) != 3 or argv[1] not in ("write", "check"):
        print(__doc__, file=sys.stderr)
        return 2
    if argv[1] == "write":
        save_file(reference(), argv[2], metadata={"producer": "python safetensors", "note": NOTE})
        return 0
    return check(argv[2])


if __name__ == "__main__":
    sys.exit(main(sys.argv))
