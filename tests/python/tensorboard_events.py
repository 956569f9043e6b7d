"""TensorBoard oracle for tests/test_tensorboard.cpp: reads a directory's event files with
TensorBoard's own readers and compares them with the metrics.jsonl rows that the same records
produced. Two readers, which must both agree with the rows:

  - EventAccumulator (Python; checks both masked CRC-32Cs of every record), which honours a
    SessionLog START by dropping the earlier events at its step and later;
  - every event file read record by record in name order, the events as written
    (LegacyEventFileLoader), with nothing dropped: what the TensorBoard data server (the default
    reader, --load_fast) shows, since it ignores SessionLog events. A resumed run's files
    themselves must hold no step an abandoned attempt logged after the checkpoint.

  tensorboard_events.py check DIR METRICS.jsonl [REQUIRED_TAG...]

Every numeric field of every row except `step` must appear as the scalar "<split>/<field>" at the
row's step with the row's value (as float32), and nothing else; a null (metrics.jsonl's non-finite
number) must appear as a non-finite scalar. The first event must carry file_version
"brain.Event:2"; each REQUIRED_TAG must be present.
Exits 1 on any difference, 2 on bad usage or a missing package.
"""
import json
import math
import os
import sys

try:
    import numpy as np
    from tensorboard.backend.event_processing import event_accumulator, event_file_loader
except ImportError as e:
    print(f"tensorboard_events: missing package: {e}; run scripts/setup", file=sys.stderr)
    sys.exit(2)


def expected_scalars(jsonl_path):
    want = {}
    with open(jsonl_path) as f:
        for line in f:
            row = json.loads(line)
            split = row.get("split", "")
            for key, value in row.items():
                if key == "step" or isinstance(value, (bool, str)):
                    continue
                tag = f"{split}/{key}" if split else key
                # JSON has no NaN or infinity: the writer puts null where the event has the number.
                want.setdefault(tag, []).append((row.get("step", 0), NONFINITE if value is None
                                                 else float(np.float32(value))))
    return want


NONFINITE = object()  # a null in metrics.jsonl: any non-finite value matches


def same_value(got, want):
    if want is NONFINITE:
        return not math.isfinite(got)
    return got == want or abs(got - want) <= 1e-6 * abs(want)


def raw_scalars(directory, events):
    """Every scalar of every event file, in file-name order, as a reader that drops nothing sees."""
    got = {}
    for name in sorted(events):
        for event in event_file_loader.LegacyEventFileLoader(os.path.join(directory, name)).Load():
            for value in event.summary.value:
                if value.HasField("simple_value"):
                    got.setdefault(value.tag, []).append((event.step, value.simple_value))
    return got


def compare(reader, got, want, problems):
    if set(got) != set(want):
        problems.append(f"{reader}: tags {sorted(got)} != {sorted(want)}")
    for tag in sorted(set(got) & set(want)):
        g, w = got[tag], want[tag]
        same = len(g) == len(w) and all(gs == ws and same_value(gv, wv) for (gs, gv), (ws, wv) in zip(g, w))
        if not same:
            show = [(s, "non-finite" if v is NONFINITE else v) for s, v in w]
            problems.append(f"{reader}: {tag}: events {g} != jsonl {show}")


def check(directory, jsonl_path, required):
    events = [n for n in os.listdir(directory) if "tfevents" in n]
    if not events:
        print(f"tensorboard_events: no event file in {directory}", file=sys.stderr)
        return 1
    acc = event_accumulator.EventAccumulator(directory, size_guidance={event_accumulator.SCALARS: 0})
    acc.Reload()
    got = {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}
    want = expected_scalars(jsonl_path)
    problems = []
    if acc.file_version != 2.0:
        problems.append(f"file_version {acc.file_version}, want 2 (brain.Event:2)")
    compare("EventAccumulator", got, want, problems)
    compare("event files as written", raw_scalars(directory, events), want, problems)
    for tag in required:
        if tag not in got:
            problems.append(f"required tag {tag} missing")
    for p in problems:
        print(f"tensorboard_events: {directory}: {p}", file=sys.stderr)
    if not problems:
        print(f"tensorboard_events: {len(events)} event file(s), {len(got)} tags, "
              f"{sum(len(v) for v in got.values())} scalars match {jsonl_path}")
    return 1 if problems else 0


def main(argv):
    if len(argv) < 4 or argv[1] != "check":
        print(__doc__, file=sys.stderr)
        return 2
    return check(argv[2], argv[3], argv[4:])


if __name__ == "__main__":
    sys.exit(main(sys.argv))
