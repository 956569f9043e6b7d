"""Side-by-side BERT masked-LM training throughput: train's C++ step against Python PyTorch eager.

Runs bench_bert_step (C++) and bert_step.py (Python, the same model in plain torch.nn) alternately,
`--rounds` times each, in one session on the same device, and reports the median sequences/s of
each, their ratio, the per-round ratios with their median and range, and the model-FLOPs
utilisation against the device's peak. Use an odd number of rounds, 3 or more (the default): the
median of an even count is the mean of the two middle runs, which the report then says. A run whose
windows spread by more than --spread-warn (max / min - 1) is flagged. The Python side uses
the attention and the AdamW implementation (fused / foreach) that the C++ side reports from its
first run, so both sides run the same algorithms.

With --check (run once, before the timing) the C++ side writes its initial weights, eval logits
and two training steps (without dropout) for --check-preset to a file, and bert_step.py --check
loads the weights by name and compares logits, losses and updated weights: the two programs train
the same model with the same loss and optimizer.

The C++ layer projects query, key and value in one GEMM through their concatenated weights (the
same function and parameters as three Linear layers). The Python side by default runs the three
layers Hugging Face's BertSelfAttention runs (what a Python user trains); --python-qkv fused gives
it the C++ computation, which separates the implementation's share of a ratio from the language's. A failed check is reported at once and again
under the table, the timing still runs (a GPU lease is short), and the script exits 1.

    python3 benchmarks/compare_bert.py --bin build/bin/bench_bert_step --check --rounds 3 \
        --preset bert-base --batch 64 --seq 128 --precision bf16 --peak-tflops 989 --out results.json

Model FLOPs per training sequence (the MFU numerator; dropout, softmax, LayerNorm, GELU, the
embedding lookups and the optimizer are not counted):

    6 * E * T + 6 * D * M + 12 * L * H * T^2
    E = L * (4 H^2 + 2 H I),   D = H^2 + V H

E counts the encoder weights that take part in matrix multiplies, per token: per layer the Q, K,
V and attention-output projections (4 H^2) and the two feed-forward matrices (2 H I). D is the
MLM head: its transform (H^2) and the decoder tied to the word embeddings (V H), which both sides
run only at the M positions per sequence that have a target (15 % of T), as train's trainer does.
A matmul weight costs 2 FLOPs per token forward and 4 backward (gradients of the input and of the
weight). The attention scores Q K^T and the weighted sum A V cost 2 T^2 H FLOPs each per layer
forward, times 3 with the backward: 12 L H T^2. L layers, H hidden, I intermediate, V vocab, T
sequence length. BERT-base at T = 128 and M = 19.2: 69.8 GFLOP per sequence (85.5 if the head ran
at every position).
"""
import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from rounds import check_rounds, run_interleaved


def train_flops_per_sequence(layers, hidden, intermediate, vocab, seq, targets_per_sequence):
    encoder = layers * (4 * hidden * hidden + 2 * hidden * intermediate)
    head = hidden * hidden + vocab * hidden
    return 6 * encoder * seq + 6 * head * targets_per_sequence + 12 * layers * hidden * seq * seq


def run(cmd, allow_failure=False):
    """The JSON line a side prints, and its exit status (a failure is an error unless allowed)."""
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    if out.returncode == 0 or allow_failure:
        for line in out.stdout.splitlines():
            if line.startswith("{"):
                return json.loads(line), out.returncode
    raise RuntimeError(f"no JSON (exit {out.returncode}) from {' '.join(cmd)}:\n{out.stdout}\n{out.stderr}")


def same_model_check(a, py_script):
    with tempfile.TemporaryDirectory(prefix="compare_bert") as tmp:
        path = str(Path(tmp) / "bert_check.safetensors")
        cpp, _ = run([a.bin, "--preset", a.check_preset, "--batch", "4", "--seq", "32", "--device", a.device,
                      "--attention", a.attention, "--save-check", path] + threads(a))
        report, rc = run([a.python, py_script, "--check", path, "--device", a.device] + threads(a),
                         allow_failure=True)
    print(f"same-model check ({a.check_preset}, {a.device}, fp32, attention {cpp['attention']}, "
          f"{cpp['optimizer']}): {report['check']}; max |logits diff| {report['max_abs_logits_diff']:.3g} "
          f"(logits up to {report['logits_max_abs']:.3g}), max |loss diff| {report['max_abs_loss_diff']:.3g}, "
          f"max |weight diff| after {len(report['losses_cpp'])} AdamW steps "
          f"{report['max_abs_weights_diff_after_steps']:.3g}", flush=True)
    if rc != 0:
        print(json.dumps(report, indent=2), file=sys.stderr, flush=True)
    return report


def threads(a):
    return ["--threads", str(a.threads)] if a.threads > 0 else []


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--bin", required=True)
    p.add_argument("--python", default=sys.executable)
    p.add_argument("--rounds", type=int, default=3, help="interleaved rounds; odd and >= 3 for a true median")
    p.add_argument("--preset", default="bert-base")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--window", type=int, default=5)
    p.add_argument("--device", default="cuda")
    p.add_argument("--precision", default="bf16", choices=["bf16", "fp32"])
    p.add_argument("--attention", default="auto", choices=["auto", "fused", "plain"])
    p.add_argument("--python-qkv", default="separate", choices=["separate", "fused"],
                   help="the Python side's query/key/value projection: separate (three Linear layers, as Hugging "
                        "Face writes BERT; the default) or fused (one, as the C++ layer computes it), to tell "
                        "the implementation's share of a difference from the language's")
    p.add_argument("--threads", type=int, default=0, help="intra-op CPU threads for both sides; 0 = default")
    p.add_argument("--check", action="store_true", help="run the same-model check first")
    p.add_argument("--check-preset", default="bert-tiny")
    p.add_argument("--processes", default="serve", choices=["serve", "fresh"],
                   help="serve: one process per side, kept across rounds (a round costs its steps); fresh: a "
                        "new process per round (each round also pays and samples the start: CUDA context, cuDNN "
                        "autotuning)")
    p.add_argument("--spread-warn", type=float, default=0.20,
                   help="flag a run whose fastest window is more than this fraction above its slowest")
    p.add_argument("--peak-tflops", type=float, default=0.0, help="device peak for the precision used")
    p.add_argument("--out", default="")
    a = p.parse_args()
    warnings = check_rounds(p, a.rounds)

    py_script = str(Path(__file__).with_name("bert_step.py"))
    summary = {"config": vars(a)}
    if a.check:
        summary["check"] = same_model_check(a, py_script)

    common = ["--preset", a.preset, "--batch", str(a.batch), "--seq", str(a.seq), "--steps", str(a.steps),
              "--warmup", str(a.warmup), "--window", str(a.window), "--device", a.device,
              "--precision", a.precision] + threads(a)
    runs = run_interleaved(
        [a.bin] + common + ["--attention", a.attention],
        lambda res: [a.python, py_script] + common + ["--attention", res["attention"],
                                                      "--optim-impl", res["optimizer"].split()[-1],
                                                      "--qkv", a.python_qkv],
        a.rounds, a.processes, "seq_per_s", "seq/s", a.spread_warn, warnings)

    first = {name: runs[name][0] for name in runs}
    for key in ("layers", "hidden", "heads", "intermediate", "vocab", "params", "targets", "input_sum",
                "attention", "optimizer"):
        if first["cpp"][key] != first["python"][key]:
            sys.exit(f"compare_bert.py: the two sides differ in {key}: C++ {first['cpp'][key]}, "
                     f"Python {first['python'][key]}")
    c = first["cpp"]
    flops = train_flops_per_sequence(c["layers"], c["hidden"], c["intermediate"], c["vocab"], a.seq,
                                     c["targets"] / c["batch"])
    summary.update({"runs": runs, "train_flops_per_sequence": flops})
    rows = []
    for name in ("cpp", "python"):
        med = statistics.median(x["seq_per_s"] for x in runs[name])
        mfu = med * flops / (a.peak_tflops * 1e12) if a.peak_tflops else None
        summary[name] = {"median_seq_per_s": med, "mfu": mfu}
        rows.append((name, med, mfu, ", ".join(f"{x['seq_per_s']:.1f}" for x in runs[name])))
    summary["ratio_cpp_over_python"] = summary["cpp"]["median_seq_per_s"] / summary["python"]["median_seq_per_s"]
    # Per round (C++ and Python ran back to back): less sensitive to the machine drifting between rounds.
    summary["round_ratios"] = [x["seq_per_s"] / y["seq_per_s"] for x, y in zip(runs["cpp"], runs["python"])]
    summary["round_ratio_range"] = [min(summary["round_ratios"]), max(summary["round_ratios"])]
    summary["warnings"] = warnings
    print(f"\nBERT-{a.preset.removeprefix('bert-')} MLM, batch {a.batch}, seq {a.seq}, {a.precision}, "
          f"attention {c['attention']}, {c['optimizer']}, {c['params'] / 1e6:.1f} M parameters, "
          f"{flops / 1e9:.2f} GFLOP per sequence, "
          f"{a.device}{f', {a.threads} threads' if a.threads else ''}, Python's Q/K/V projection {a.python_qkv} "
          f"(C++: fused), {a.rounds} interleaved rounds "
          f"({'one process per side, kept' if a.processes == 'serve' else 'a new process per round'})")
    print("| impl | rounds (seq/s) | median seq/s | MFU |")
    print("|---|---|---|---|")
    for name, med, mfu, each in rows:
        print(f"| {name} | {each} | {med:.1f} | {'' if mfu is None else f'{100 * mfu:.1f}%'} |")
    print(f"| ratio cpp/python | {', '.join(f'{x:.3f}' for x in summary['round_ratios'])} "
          f"(median {statistics.median(summary['round_ratios']):.3f}, range {summary['round_ratio_range'][0]:.3f}-"
          f"{summary['round_ratio_range'][1]:.3f}) | {summary['ratio_cpp_over_python']:.3f} | |")
    for w in warnings:
        print(f"warning: {w}")
    if a.check:
        ck = summary["check"]
        print(f"same-model check ({a.check_preset}, fp32): {ck['check']}, max |logits diff| "
              f"{ck['max_abs_logits_diff']:.3g}, max |loss diff| {ck['max_abs_loss_diff']:.3g}, "
              f"max |weight diff| after the steps {ck['max_abs_weights_diff_after_steps']:.3g}")
    if a.out:
        Path(a.out).write_text(json.dumps(summary, indent=2) + "\n")
    if a.check and summary["check"]["check"] != "pass":
        sys.exit("compare_bert.py: the same-model check failed: the Python model does not compute what the C++ "
                 "model computes within the tolerances (its report is above)")


if __name__ == "__main__":
    main()
