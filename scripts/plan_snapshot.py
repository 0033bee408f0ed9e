"""Plans before and after a refactor, byte for byte.

    python scripts/plan_snapshot.py record DIR [pytest args]   # every plan the suite builds, PYTHONHASHSEED=0
    python scripts/plan_snapshot.py compare BEFORE AFTER        # exit 1 and list them where the sets differ

``record`` runs pytest (default: the default tier on two workers) with a hook loaded into every process, ranks
included (snapshot_hook/sitecustomize.py), that writes each Plan's JSON -- fingerprint, placements, collectives,
prices -- as <sha256>.json.  Plans from measured timings (calibration tests) differ from run to run by nature;
``compare`` names each file that only one side has, with its topology and fingerprint, to be read case by case.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

HOOK = Path(__file__).resolve().parent / "snapshot_hook"
ADDRESS = re.compile(r" at 0x[0-9a-f]+")
DEFAULT = ["-q", "-n", "2", "--dist", "worksteal", "-m", "not slow"]


def record(directory: str, pytest_args: list[str]) -> int:
    env = {
        **os.environ,
        "AUTOTP_PLAN_SNAPSHOT": str(Path(directory).resolve()),
        "PYTHONHASHSEED": "0",
        "PYTHONPATH": os.pathsep.join([str(HOOK), *filter(None, [os.environ.get("PYTHONPATH")])]),
    }
    return subprocess.call([sys.executable, "-m", "pytest", *(pytest_args or DEFAULT)], env=env)


def describe(path: Path) -> str:
    plan = json.loads(path.read_text())
    return f"{path.name[:12]} world {plan['world_size']} {plan['topology']} {plan['fingerprint']}"


def without_addresses(path: Path) -> str:
    """The plan with object addresses blanked (a Python function's repr, ``<function f at 0x...>``, names the op
    of a node traced inside a vmap) and the fingerprint's graph part, which hashes those reprs, dropped."""
    plan = json.loads(path.read_text())
    plan["fingerprint"] = plan["fingerprint"].split(".", 1)[-1]
    return ADDRESS.sub(" at 0x?", json.dumps(plan, sort_keys=True))


def compare(before: str, after: str) -> int:
    old, new = ({p.name: p for p in Path(d).glob("*.json")} for d in (before, after))
    print(f"{len(old)} plans before, {len(new)} after, {len(old.keys() & new.keys())} byte-identical")
    gone, made = old.keys() - new.keys(), new.keys() - old.keys()
    twins = {without_addresses(new[name]) for name in made}
    for name in sorted(gone):
        same = " (the same but for object addresses)" if without_addresses(old[name]) in twins else ""
        print(f"only before: {describe(old[name])}{same}")
    for name in sorted(made):
        print(f"only after: {describe(new[name])}")
    return int(old.keys() != new.keys())


if __name__ == "__main__":
    command, *rest = sys.argv[1:] or ["help"]
    if command == "record" and rest:
        sys.exit(record(rest[0], rest[1:]))
    if command == "compare" and len(rest) == 2:
        sys.exit(compare(*rest))
    sys.exit(__doc__)
