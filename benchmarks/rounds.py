"""Interleaved rounds, as the compare_*.py scripts run them: how many make a median worth reading."""
import sys


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
