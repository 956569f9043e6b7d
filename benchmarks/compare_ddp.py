"""Side-by-side data-parallel step time: train's C++ GradSync against PyTorch's Python DDP.

Both run under the same torchrun (from the project venv) with 2 Gloo ranks on this host, the
same model (ResNet-18, small-input stem), per-rank batch and threads, alternating C++ and Python
`--rounds` times in one session (odd and >= 3, the default, for a true median). Reports every
round, the median step time of each, the ratio of the medians and the per-round ratios with their
median and range (goal: C++ at most 0.9x Python's), and the share of allreduce time hidden behind
backward.

Both sides step with the same SGD implementation: the C++ side runs --optim-impl (auto = the fused
kernel where LibTorch has one) and reports what ran; ddp_step.py is given that. The script refuses a
comparison whose optimizer, parameter count or gradient bytes differ between the sides.

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

from rounds import check_rounds


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
    p.add_argument("--optim-impl", default="auto", choices=["auto", "fused", "foreach", "loop"],
                   help="the C++ side's optim.impl; the Python side runs what the C++ side reports")
    p.add_argument("--out", default="")
    a = p.parse_args()
    warnings = check_rounds(p, a.rounds)

    torchrun = str(Path(a.python).with_name("torchrun"))
    common = ["--batch", str(a.batch), "--steps", str(a.steps), "--threads", str(a.threads)]
    def launch():
        return [torchrun, "--nproc-per-node", str(a.nproc), "--master-port", str(free_port())]

    cpp_args = ["--no-python", a.bin] + common + ["--optim-impl", a.optim_impl]
    py_args = None  # set from the first C++ run, which always comes first
    runs = {"cpp": [], "python": []}
    for r in range(a.rounds):
        for name in (("cpp", "python") if r % 2 == 0 else ("python", "cpp")):
            t0 = time.time()
            res = run(launch() + (cpp_args if name == "cpp" else py_args))
            res["wall_s"] = round(time.time() - t0, 1)
            runs[name].append(res)
            if py_args is None:
                py_args = [str(Path(__file__).with_name("ddp_step.py"))] + common + [
                    "--optim-impl", res["optimizer"].split()[-1]]
            print(f"round {r} {name}: {res['step_s']*1000:.1f} ms/step, hidden {res['hidden']:.2f}, "
                  f"{res['optimizer']}", file=sys.stderr)

    for key in ("optimizer", "params", "world", "batch_per_rank", "threads", "steps", "windows"):
        values = {x[key] for side in runs.values() for x in side}
        if len(values) != 1:
            sys.exit(f"compare_ddp.py: the two sides differ in {key}: C++ {runs['cpp'][0][key]}, "
                     f"Python {runs['python'][0][key]}")
    if abs(runs["cpp"][0]["grad_mb"] - runs["python"][0]["grad_mb"]) > 1e-3:
        sys.exit(f"compare_ddp.py: the two sides differ in gradient bytes: C++ {runs['cpp'][0]['grad_mb']} MB, "
                 f"Python {runs['python'][0]['grad_mb']} MB")

    def med(name, key):
        return statistics.median(x[key] for x in runs[name])

    round_ratios = [x["step_s"] / y["step_s"] for x, y in zip(runs["cpp"], runs["python"])]
    summary = {
        "optimizer": runs["cpp"][0]["optimizer"], "params": runs["cpp"][0]["params"],
        "round_ratios_cpp_over_python": round_ratios,
        "median_round_ratio": statistics.median(round_ratios),
        "round_ratio_range": [min(round_ratios), max(round_ratios)],
        "warnings": warnings,
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
    for w in warnings:
        print(f"warning: {w}", file=sys.stderr)
    if a.out:
        Path(a.out).write_text(json.dumps(summary, indent=1) + "\n")


if __name__ == "__main__":
    main()
