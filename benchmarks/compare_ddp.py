"""Side-by-side data-parallel step time: train's C++ GradSync against PyTorch's Python DDP.

Both run under the same torchrun (from the project venv) with 2 Gloo ranks on this host, the
same model (ResNet-18, small-input stem), per-rank batch and threads, alternating C++ and Python
`--rounds` times in one session. Reports the median step time of each, their ratio (goal: C++ at
most 0.9x Python's), and the share of allreduce time hidden behind backward.

    .venv/bin/python benchmarks/compare_ddp.py --bin build/bin/bench_ddp_step --rounds 3
"""
import argparse
import json
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path


def run(cmd):
    out = subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=900)
    for line in out.stdout.splitlines():
        if line.startswith("{"):
            return json.loads(line)
    raise RuntimeError(f"no JSON from {cmd}: {out.stdout}\n{out.stderr}")


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--bin", required=True)
    p.add_argument("--python", default=sys.executable)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", default="")
    a = p.parse_args()

    torchrun = str(Path(a.python).with_name("torchrun"))
    common = ["--batch", str(a.batch), "--steps", str(a.steps), "--threads", str(a.threads)]
    def launch():
        return [torchrun, "--nproc-per-node", str(a.nproc), "--master-port", str(free_port())]

    cpp_args = ["--no-python", a.bin] + common
    py_args = [str(Path(__file__).with_name("ddp_step.py"))] + common
    runs = {"cpp": [], "python": []}
    for r in range(a.rounds):
        order = [("cpp", cpp_args), ("python", py_args)] if r % 2 == 0 else [("python", py_args), ("cpp", cpp_args)]
        for name, args in order:
            t0 = time.time()
            res = run(launch() + args)
            res["wall_s"] = round(time.time() - t0, 1)
            runs[name].append(res)
            print(f"round {r} {name}: {res['step_s']*1000:.1f} ms/step, hidden {res['hidden']:.2f}", file=sys.stderr)

    def med(name, key):
        return statistics.median(x[key] for x in runs[name])

    summary = {
        "cpp_step_ms": 1000 * med("cpp", "step_s"),
        "python_step_ms": 1000 * med("python", "step_s"),
        "ratio_cpp_over_python": med("cpp", "step_s") / med("python", "step_s"),
        "cpp_local_step_ms": 1000 * med("cpp", "local_step_s"),
        "python_local_step_ms": 1000 * med("python", "local_step_s"),
        "cpp_comm_ms": 1000 * med("cpp", "comm_s"),
        "python_comm_ms": 1000 * med("python", "comm_s"),
        "cpp_hidden": med("cpp", "hidden"),
        "python_hidden": med("python", "hidden"),
        "rounds": a.rounds, "nproc": a.nproc, "batch_per_rank": a.batch, "threads": a.threads,
        "runs": runs,
    }
    print(json.dumps({k: v for k, v in summary.items() if k != "runs"}, indent=1))
    if a.out:
        Path(a.out).write_text(json.dumps(summary, indent=1) + "\n")


if __name__ == "__main__":
    main()
