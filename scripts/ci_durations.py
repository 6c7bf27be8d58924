"""Write tests/ci_durations.json from a CI run: what each test cost, for dealing the tests
between the JAX lines by cost (tests/conftest.py).

    python scripts/ci_durations.py [.ci-logs]     # after `bash scripts/test_all.sh`

Reads, for the lines in test_all.sh's order (py311, py313), `<logs>/<line>.durations.json`
(seconds per test, setup + call + teardown, written by tests/conftest.py when
ARENA_DURATIONS_OUT is set, as test_all.sh does) and `<logs>/<line>.setup.log` ("setup rc=0 in
N s"). Writes the seconds of each dealt test on the line that ran it, and per line its head
start: its venv setup plus what the tests it runs in any case (those that ran on both lines)
took on it. Figures from a loaded 2-core CI box: only their ratios matter.
"""
from __future__ import annotations

import json
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LINES = ("py311", "py313")
SETUP = re.compile(r"setup rc=0 in (\d+) s")


def main(logs: Path) -> dict:
    runs = {line: json.loads((logs / f"{line}.durations.json").read_text()) for line in LINES}
    on_every_line = set.intersection(*(set(seconds) for seconds in runs.values()))  # not dealt
    per_test: dict[str, float] = {}
    head_start = {}
    for i, (line, seconds) in enumerate(runs.items()):
        setup = SETUP.search((logs / f"{line}.setup.log").read_text())
        every_line = sum(seconds[test] for test in on_every_line)
        head_start[f"{i}/{len(LINES)}"] = round((int(setup.group(1)) if setup else 0) + every_line, 1)
        per_test.update((test, round(s, 2)) for test, s in seconds.items() if test not in on_every_line)
    return {"what": "seconds per test in one CI run (scripts/ci_durations.py); tests/conftest.py deals by them",
            "head_start": head_start, "seconds": dict(sorted(per_test.items()))}


if __name__ == "__main__":
    logs = Path(sys.argv[1] if len(sys.argv) > 1 else ROOT / ".ci-logs")
    out = ROOT / "tests" / "ci_durations.json"
    data = main(logs)
    out.write_text(json.dumps(data, indent=0) + "\n")
    print(f"{out}: {len(data['seconds'])} tests, head start {data['head_start']}")
