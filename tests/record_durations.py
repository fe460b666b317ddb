"""Write tests/durations.json: the tests of the CI tier that take 0.5 s or more, from a pytest log.

The `quick` selection (``pytest -m quick``, under a minute on 2 cores) is every test that is neither
slow, distributed nor listed there. Re-record after adding tests that build models:

    python -m pytest -q -n 2 --dist loadgroup -m 'not slow' --durations=0 > /tmp/durations.txt
    python tests/record_durations.py /tmp/durations.txt
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

THRESHOLD_SECONDS = 0.5
OUT = Path(__file__).resolve().parent / "durations.json"


def durations(log: str) -> dict[str, float]:
    """Seconds per test id (setup, call and teardown summed) from ``--durations=0`` lines.

    Example:
        >>> durations("0.70s call     tests/test_a.py::test_x\\n0.10s setup    tests/test_a.py::test_x\\n")
        {'tests/test_a.py::test_x': 0.8}
    """
    seconds: dict[str, float] = {}
    for line in log.splitlines():
        match = re.match(r"\s*([\d.]+)s (?:call|setup|teardown)\s+(\S+)", line)
        if match:
            seconds[match.group(2)] = round(seconds.get(match.group(2), 0.0) + float(match.group(1)), 3)
    return seconds


def main(path: str) -> None:
    slow = {k: v for k, v in sorted(durations(Path(path).read_text()).items()) if v >= THRESHOLD_SECONDS}
    OUT.write_text(json.dumps(slow, indent=0) + "\n")
    print(f"{len(slow)} tests of {THRESHOLD_SECONDS} s or more written to {OUT}")


if __name__ == "__main__":
    main(sys.argv[1])
