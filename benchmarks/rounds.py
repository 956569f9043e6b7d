"""Interleaved rounds, as the compare_*.py scripts run them: how many make a median worth reading,
and the two ways of running a side's rounds (a fresh process each, or one process kept)."""
import json
import queue
import subprocess
import sys
import tempfile
import threading
import time


def check_rounds(parser, rounds):
    """Rejects fewer than one round; returns (and prints) a warning when the count is even or under
    3, where the median is not the middle run. The warnings go into each script's report."""
    if rounds < 1:
        parser.error("--rounds must be >= 1")
    warnings = []
    if rounds < 3 or rounds % 2 == 0:
        warnings.append(f"{rounds} rounds: each median is not a middle run (an even count's median is the mean "
                        f"of the two middle ones); use an odd number >= 3")
        print(f"warning: {warnings[-1]}", file=sys.stderr, flush=True)
    return warnings


def spread_flag(res, limit, unit, label, warnings):
    """The mark after a run's line when its fastest window is more than `limit` (a fraction) above its
    slowest, and the matching entry appended to `warnings`; "" for a steady run. `res` holds the
    run's "min", "max" and "spread"; `label` names the run ("round 2 cpp")."""
    if res["spread"] <= limit:
        return ""
    warnings.append(f"{label}: windows {res['min']:.1f}-{res['max']:.1f} {unit}, spread {100 * res['spread']:.0f} %")
    return f"  <- windows spread {100 * res['spread']:.0f} % (> {100 * limit:.0f} %)"


class Side:
    """One side of a comparison, whose run() prints one JSON line.

    processes="fresh": every run() starts `cmd` anew and reads its JSON line, so that each round
    pays the process start again (LibTorch or Python + torch loading, the CUDA context, cuDNN
    autotuning) and samples it (the algorithms cuDNN picks may differ between processes).
    processes="serve": the first run() starts `cmd --serve 1` and waits for its "ready"; every run()
    then writes "run" and reads the JSON line, and close() ends it. The two sides' processes stay
    alive side by side, so both hold their GPU memory for the whole comparison, but only one runs
    at a time: the idle one waits on its standard input. A round then costs its steps alone.
    """

    def __init__(self, cmd, processes, timeout_s=600):
        if processes not in ("fresh", "serve"):
            raise ValueError(f"processes is fresh or serve, not {processes!r}")
        self.cmd, self.processes, self.timeout_s = cmd, processes, timeout_s
        self.proc, self.lines, self.stderr = None, None, None

    def _fail(self, what):
        err = ""
        if self.stderr is not None:
            self.stderr.seek(0)
            err = self.stderr.read()
        raise RuntimeError(f"{what} from {' '.join(self.cmd)}:\n{err}")

    def _next_line(self):
        try:
            line = self.lines.get(timeout=self.timeout_s)
        except queue.Empty:
            self.proc.kill()
            self._fail(f"no line within {self.timeout_s} s")
        if line is None:
            self._fail(f"exit {self.proc.wait()} before its line")
        return line

    def run(self):
        if self.processes == "fresh":
            out = subprocess.run(self.cmd, capture_output=True, text=True, timeout=self.timeout_s)
            if out.returncode == 0:
                for line in out.stdout.splitlines():
                    if line.startswith("{"):
                        return json.loads(line)
            raise RuntimeError(f"no JSON (exit {out.returncode}) from {' '.join(self.cmd)}:\n{out.stdout}\n{out.stderr}")
        if self.proc is None:
            self.stderr = tempfile.TemporaryFile(mode="w+")
            self.proc = subprocess.Popen(self.cmd + ["--serve", "1"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                         stderr=self.stderr, text=True, bufsize=1)
            self.lines = queue.Queue()

            def read(out, lines):
                for line in out:
                    lines.put(line.rstrip("\n"))
                lines.put(None)

            threading.Thread(target=read, args=(self.proc.stdout, self.lines), daemon=True).start()
            while self._next_line() != "ready":
                pass
        self.proc.stdin.write("run\n")
        self.proc.stdin.flush()
        while True:
            line = self._next_line()
            if line.startswith("{"):
                return json.loads(line)

    def close(self):
        if self.proc is None:
            return
        try:
            self.proc.stdin.write("quit\n")
            self.proc.stdin.close()
            self.proc.wait(timeout=60)
        except (OSError, subprocess.TimeoutExpired):
            self.proc.kill()
            self.proc.wait()
        self.proc = None


def run_interleaved(cpp_cmd, python_cmd_from, rounds, processes, rate_key, unit, spread_warn, warnings, note=None):
    """Runs the C++ side and the Python side alternately, `rounds` times each (C++ first in even
    rounds, Python first in odd ones), and returns {"cpp": [...], "python": [...]}, each run's JSON
    with its wall time and window spread added. The Python side's command is made from the first
    C++ run (`python_cmd_from(res)`: its optimizer, attention), which always comes first. Prints a
    line per run: `rate_key` in `unit`, the window range, `note(res)` and the wall time."""
    sides = {"cpp": Side(cpp_cmd, processes), "python": None}
    runs = {"cpp": [], "python": []}
    try:
        for r in range(rounds):
            for name in (("cpp", "python") if r % 2 == 0 else ("python", "cpp")):
                t0 = time.time()
                res = sides[name].run()
                res["wall_s"] = round(time.time() - t0, 1)
                res["spread"] = res["max"] / res["min"] - 1
                runs[name].append(res)
                if sides["python"] is None:
                    sides["python"] = Side(python_cmd_from(res), processes)
                flag = spread_flag(res, spread_warn, unit, f"round {r} {name}", warnings)
                extra = f"{note(res)}, " if note else ""
                print(f"round {r} {name}: {res[rate_key]:.1f} {unit} (windows {res['min']:.1f}-{res['max']:.1f}, "
                      f"{extra}{res['wall_s']} s){flag}", flush=True)
    finally:
        for side in sides.values():
            if side is not None:
                side.close()
    return runs
