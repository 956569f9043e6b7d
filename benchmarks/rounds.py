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
