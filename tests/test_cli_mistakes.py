"""A user's mistakes on the command line: each said in one line, at once (before torch loads where the arguments
alone are wrong, before any capture where a file is), with its exit status."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from autotp.tools.model_spec import load_model
from tests.helpers.cli import ROOT, autotp, tiny_llama_dir


def _errors(tmp_path: Path) -> list:
    """(arguments, exit status, the start of the one line on stderr): each documented error of each command."""
    model, plan = str(tiny_llama_dir(tmp_path)), tmp_path / "not-a-plan.json"
    plan.write_text("{}")
    broken, nowhere = tmp_path / "broken.json", tmp_path / "no-such-folder"
    broken.write_text('{\n  "model_type": "llama",\n  "hidden_size": 64,,\n}\n')
    usage = [
        (["plan", model, "--world-size", "0"], "argument --world-size: expected a whole number of at least 1"),
        (["plan", model, "--world-size", "2", "--topology", "dgx-h1000"], "unknown topology 'dgx-h1000'; give one of"),
        (["plan", model, "--world-size", "64"], "--world-size 64 is more than topology dgx-h100 has (8 devices)"),
        (["plan", model, "--world-size", "2", "--memory-limit", "0"], "--memory-limit must be a positive number"),
        (["plan", "no_such_module:build", "--world-size", "2"], "cannot load 'no_such_module:build'"),
        (["plan", str(tmp_path / "missing"), "--world-size", "2"], f"{tmp_path / 'missing'} does not exist"),
        (["plan", "no_such_spec", "--world-size", "2"], "MODEL must be package.module:factory"),
        (["plan", str(broken), "--world-size", "2"], f"{broken} is not valid JSON: Expecting property name"),
        (["plan", model, "--world-size", "2", "--svg", f"{nowhere}/p.svg"], f"--svg {nowhere}/p.svg: folder"),
        (["plan", model, "--world-size", "2", "--out", str(tmp_path)], f"--out {tmp_path} is a folder"),
        (["plan"], "the following arguments are required: model, --world-size"),
        (["mesh", model, "--nodes", "0"], "argument --nodes: expected a whole number of at least 1"),
        (["mesh", model, "--devices", "9"], "--devices 9 is more than topology dgx-h100 has"),
        (["compare", model, "--world-size", "2", "--topology", "nope.json"], "topology file nope.json does not exist"),
        (["show", str(tmp_path / "missing.json")], "cannot read"),
        (["show", str(plan)], f"{plan}: "),
        (["diff", str(plan), str(plan)], f"{plan}: "),
        (["frob"], "argument command: invalid choice: 'frob'"),
    ]
    return [(args, 2, start) for args, start in usage] + [
        (["plan", model, "--world-size", "1", "--seq", "64", "--memory-limit", "1e-6"], 1, "no plan fits"),
    ]


def test_every_documented_error_is_one_line_with_its_status(tmp_path):
    """Each error a user can make is said in one line, ``autotp: <what is wrong>; <what to do>``, with no trace:
    exit status 2 for a usage error (checked before any capture), 1 where nothing fits.  Run as processes, in
    parallel (each imports torch)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "COLUMNS": "160"}
    cases = _errors(tmp_path)
    running = [
        subprocess.Popen(
            [sys.executable, "-m", "autotp.tools.cli", *args],
            cwd=ROOT,
            env=env,
            text=True,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )
        for args, _, _ in cases
    ]
    for (args, status, start), process in zip(cases, running, strict=True):
        _, err = process.communicate(timeout=300)
        lines = [line for line in err.splitlines() if not line.startswith("[transformers]")]
        assert process.returncode == status and len(lines) == 1, (args, process.returncode, err[-2000:])
        assert lines[0].startswith(f"autotp: {start}") and "; " in lines[0], (args, lines)


def test_an_internal_error_says_so_and_debug_shows_its_trace(monkeypatch):
    """An error inside autotp is named as one (exit status 3, asking for a report); --debug prints its trace."""
    import autotp.tools.commands as commands

    def broken(args):
        raise KeyError("a bug")

    monkeypatch.setattr(commands, "show_command", broken)
    quiet = autotp("show", "plan.json")
    assert quiet.returncode == 3 and quiet.stderr.strip().splitlines() == [
        "autotp: internal error (KeyError: 'a bug'); rerun with --debug for the trace and report it"
    ]
    loud = autotp("--debug", "show", "plan.json")
    assert loud.returncode == 3 and "Traceback" in loud.stderr and "raise KeyError" in loud.stderr


def test_help_and_usage_errors_load_neither_torch_nor_transformers():
    """The parser and its one-line errors are torch-free (the package's names load on first use): --help and a
    usage error answer at once, not after seconds of imports."""
    probe = (
        "import sys\n"
        "from autotp.tools.cli import main\n"
        "for argv in (['--help'], ['plan', '--help'], ['serve', '--help'], ['compare', '--help'], ['plan', 'x'],"
        " ['frob']):\n"
        "    try:\n"
        "        main(argv)\n"
        "    except SystemExit:\n"
        "        pass\n"
        "print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))\n"
    )
    result = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip().splitlines()[-1] == "[]", result.stdout[-500:]
    assert "the following arguments are required: --world-size" in result.stderr


def test_a_misspelt_config_field_is_named_with_the_default_used(tmp_path, capsys):
    """A key that nearly names a field the config class knows, left out so its default was used, is said before
    planning; the legacy keys real configs carry (rope_theta, torch_dtype) stay quiet."""
    config = tiny_llama_dir(tmp_path) / "config.json"
    fields = json.loads(config.read_text())
    fields.update(rope_theta=500000.0, torch_dtype="bfloat16")
    config.write_text(json.dumps(fields))
    load_model(str(config), 1, 8)
    assert capsys.readouterr().err == ""
    fields["num_hidden_layer"] = fields.pop("num_hidden_layers")
    config.write_text(json.dumps(fields))
    model, _ = load_model(str(config), 1, 8)
    assert model.config.num_hidden_layers == 32  # transformers' default: the plan would be of a 32-layer model
    assert capsys.readouterr().err.splitlines() == [
        f"autotp: {config}: num_hidden_layer is not a field of LlamaConfig: did you mean num_hidden_layers? "
        "using the default 32"
    ]
