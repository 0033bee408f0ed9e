"""Loaded by every Python process of a recorded run (scripts/plan_snapshot.py puts this folder on PYTHONPATH):
each Plan built in the process, solved or loaded, is written to $AUTOTP_PLAN_SNAPSHOT as <sha256 of its JSON>.json.
Forked and fork-server ranks run it too, which a pytest plugin would miss."""

import hashlib
import importlib.abc
import importlib.machinery
import os
import sys

_DIR = os.environ.get("AUTOTP_PLAN_SNAPSHOT")


def _record(plan) -> None:
    try:
        text = plan.to_json()
    except Exception:  # a test's deliberately malformed plan
        return
    name = hashlib.sha256(text.encode()).hexdigest()
    path = os.path.join(_DIR, f"{name}.json")
    if not os.path.exists(path):
        temporary = f"{path}.{os.getpid()}"
        with open(temporary, "w") as file:
            file.write(text)
        os.replace(temporary, path)


def _patch(module) -> None:
    built = module.Plan.__post_init__

    def post_init(self):
        built(self)
        _record(self)

    module.Plan.__post_init__ = post_init


class _PatchPlan(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name != "autotp.plan":
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        run = spec.loader.exec_module

        def exec_module(module):
            run(module)
            _patch(module)

        spec.loader.exec_module = exec_module
        return spec


if _DIR:
    os.makedirs(_DIR, exist_ok=True)
    sys.meta_path.insert(0, _PatchPlan())
