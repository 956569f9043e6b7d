"""Reference for test_small_models.cpp: the parameter names and shapes of the Python models in
benchmarks/fit.py (the Python side of the training benchmarks), so that the C++ `mlp` and `lenet`
are checked to be the same networks.

    python tests/python/bench_models.py OUT_DIR    -> OUT_DIR/bench_models.txt

One line per parameter: `<model> <name> <dim0>,<dim1>,...`, for in_channels 1 and 10 classes.
Written by tests/python/bench_models.py.
"""
import importlib.util
import sys
from pathlib import Path

root = Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location("bench_fit", root / "benchmarks" / "fit.py")
fit = importlib.util.module_from_spec(spec)
spec.loader.exec_module(fit)

out = Path(sys.argv[1]) / "bench_models.txt"
lines = []
for name in ("mlp", "lenet"):
    model = fit.build_model({"name": name, "in_channels": 1, "num_classes": 10})
    for pname, p in model.named_parameters():
        lines.append(f"{name} {pname} {','.join(str(d) for d in p.shape)}")
out.write_text("\n".join(lines) + "\n")
