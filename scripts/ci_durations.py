"""Write tests/ci_durations.json from a CI run: what each test cost, for dealing the tests
between the JAX lines by cost (tests/conftest.py); or check that the run lost no test.

    python scripts/ci_durations.py [.ci-logs]           # after `bash scripts/test_all.sh`
    python scripts/ci_durations.py --check [.ci-logs]   # exit 1 if a test one line left to
                                                        # the other ran on neither (test_all.sh
                                                        # runs this after both lines)

Reads, for the lines in test_all.sh's order (py311, py313), `<logs>/<line>.durations.json`
(seconds per test, setup + call + teardown, written by tests/conftest.py when
ARENA_DURATIONS_OUT is set, as test_all.sh does) and `<logs>/<line>.setup.log` ("setup rc=0 in
N s"). Writes the seconds of each dealt test on the line that ran it, and per line its head
start: its venv setup plus what the tests it runs in any case (those that ran on both lines)
took on it; those get the costlier line's seconds (which tests are cheap enough for both lines
is read from them). Figures from a loaded 2-core CI box: only their ratios matter.
"""
from __future__ import annotations

import json
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LINES = ("py311", "py313")
SETUP = re.compile(r"setup rc=0 in (\d+) s")


def _read(logs: Path) -> dict[str, dict]:
    return {line: json.loads((logs / f"{line}.durations.json").read_text()) for line in LINES}


def lost(records: dict[str, dict]) -> list[str]:
    """Tests some line left to the others that no line ran (or reported as skipped)."""
    ran = set().union(*(record["seconds"] for record in records.values()))
    left = set().union(*(record["left_to_other_lines"] for record in records.values()))
    return sorted(left - ran)


def main(logs: Path) -> dict:
    runs = {line: record["seconds"] for line, record in _read(logs).items()}
    on_every_line = set.intersection(*(set(seconds) for seconds in runs.values()))  # not dealt
    per_test: dict[str, float] = {}
    head_start = {}
    for i, (line, seconds) in enumerate(runs.items()):
        setup = SETUP.search((logs / f"{line}.setup.log").read_text())
        every_line = sum(seconds[test] for test in on_every_line)
        head_start[f"{i}/{len(LINES)}"] = round((int(setup.group(1)) if setup else 0) + every_line, 1)
        per_test.update((test, round(s, 2)) for test, s in seconds.items() if test not in on_every_line)
    # The tests that ran on every line keep their cost too (the costlier line's): cheap ones run on
    # every line again only while their record says so (tests/conftest.py, `cheap`).
    for test in on_every_line:
        per_test[test] = round(max(seconds[test] for seconds in runs.values()), 2)
    return {"what": "seconds per test in one CI run (scripts/ci_durations.py); tests/conftest.py deals by them",
            "head_start": head_start, "seconds": dict(sorted(per_test.items()))}


if __name__ == "__main__":
    args = sys.argv[1:]
    check = "--check" in args
    args = [a for a in args if a != "--check"]
    logs = Path(args[0] if args else ROOT / ".ci-logs")
    if check:
        missing = lost(_read(logs))
        for test in missing:
            print(f"dealt to another line but run on none: {test}")
        print(f"dealt tests: {'none lost' if not missing else f'{len(missing)} LOST'}")
        sys.exit(1 if missing else 0)
    out = ROOT / "tests" / "ci_durations.json"
    data = main(logs)
    out.write_text(json.dumps(data, indent=0) + "\n")
    print(f"{out}: {len(data['seconds'])} tests, head start {data['head_start']}")
