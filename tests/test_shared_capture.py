"""The suite's shared captures (tests/helpers/shared_capture.py) must serve a capture only for what would capture
alike."""

from __future__ import annotations

import ast
import functools
import threading
from pathlib import Path

import torch
import torch.distributed as dist

import autotp
import autotp.parallel.split
import autotp.passes.prepared_graph
from autotp.passes.capture import capture
from tests.helpers import shared_capture
from tests.helpers.distributed import run_ranks
from tests.helpers.models import ParallelBranches
from tests.helpers.shared_capture import capture_first, copy_of, digest


def _model(**change) -> torch.nn.Module:
    torch.manual_seed(0)
    model = ParallelBranches(hidden=16)
    for name, value in change.items():
        setattr(model, name, value)
    return model


def test_only_identical_models_and_inputs_share_a_capture():
    x = (torch.randn(2, 3, 16),)
    same = digest(_model(), x, None)
    assert same is not None and digest(_model(), (torch.randn(2, 3, 16),), {}) == same  # input values do not count
    others = [
        digest(_model(), (torch.randn(2, 3, 16, dtype=torch.float64),), None),
        digest(_model(), (torch.randn(2, 3, 16), torch.randn(1)), None),
        digest(_model(), (), {"x": x[0]}),
        digest(_model(scale=2.0), x, None),  # a plain attribute the forward could read
        digest(_model().train(False), x, None),
    ]
    changed = _model()
    with torch.no_grad():
        changed.ln.weight[3] += 1
    others.append(digest(changed, x, None))
    assert None not in others and len({same, *others}) == len(others) + 1
    assert digest(_model(lock=threading.Lock()), x, None) is None  # cannot be read: captured as usual


class _Offsets(ParallelBranches):
    def forward(self, x):  # a tensor made in the forward: export lifts it to a constant, a plain attribute
        return super().forward(x) + torch.tensor([0.5] * 16)


def test_a_served_capture_is_a_copy_of_its_own_with_the_same_tensors():
    torch.manual_seed(0)
    model, x = _Offsets(hidden=16), (torch.randn(2, 3, 16),)
    gm = capture(model, x)
    first = copy_of(gm)
    assert first is not None and sorted(first.state_dict()) == sorted(gm.state_dict())
    first.graph.erase_node(next(n for n in first.graph.nodes if n.op == "output"))  # what prepare's passes may do
    second = copy_of(gm)
    assert any(n.op == "output" for n in second.graph.nodes)
    torch.testing.assert_close(second(*x), model(*x))


class _TiedLM(torch.nn.Module):
    """An embedding and a head of equal values: one parameter (tied) or two."""

    def __init__(self, tied: bool):
        super().__init__()
        torch.manual_seed(0)
        self.embed, self.head = torch.nn.Embedding(32, 16), torch.nn.Linear(16, 32, bias=False)
        if tied:
            self.head.weight = self.embed.weight
        else:
            with torch.no_grad():
                self.head.weight.copy_(self.embed.weight)

    def forward(self, ids):
        return self.head(self.embed(ids))


def test_tied_and_untied_weights_of_equal_values_do_not_share():
    """torch.export keeps a tied weight once (one parameter, two names): a capture of the tied model served to the
    untied one would train one tensor where the model has two."""
    ids = (torch.randint(0, 32, (2, 5)),)
    tied, untied = _TiedLM(tied=True), _TiedLM(tied=False)
    assert [p.shape for p in tied.parameters()] != [p.shape for p in untied.parameters()]
    assert None not in {digest(tied, ids, None), digest(untied, ids, None)}
    assert digest(tied, ids, None) != digest(untied, ids, None)
    assert len(list(capture(tied, ids).parameters())) == 1 and len(list(capture(untied, ids).parameters())) == 2
    shared = _TiedLM(tied=False)  # two parameters, one storage: a view of the other
    shared.head.weight = torch.nn.Parameter(shared.embed.weight.detach()[:])
    assert digest(shared, ids, None) not in {digest(untied, ids, None), None}


def _outcome(module, args) -> str:
    try:
        module(*args)
    except Exception as exc:  # what the capture's input check raises, compared below
        return f"{type(exc).__name__}: {exc}"
    return "ran"


def test_a_served_copy_checks_its_inputs_as_its_capture_does():
    """torch.export's module checks each call's inputs against the capture (a forward pre-hook: the input structure,
    the range constraints); the served copy keeps the hooks and what they read, so it refuses what an own capture
    refuses, with the same error."""
    torch.manual_seed(0)
    model, x = ParallelBranches(hidden=16), torch.randn(2, 3, 16)
    own = capture(model, (x,))
    served = copy_of(own)
    hooks = [hook.__name__ for hook in own._forward_pre_hooks.values()]
    assert "_check_input_constraints_pre_hook" in hooks
    assert [hook.__name__ for hook in served._forward_pre_hooks.values()] == hooks
    assert served.range_constraints == own.range_constraints and served.validate_inputs
    wrong = [(x, x), ([x],), ({"x": x},), (x.double(),), (x[0],), (torch.randn(2, 3, 8),)]
    outcomes = [_outcome(own, args) for args in wrong]
    assert all(o.startswith("ValueError: Trying to flatten user inputs") for o in outcomes[:3]), outcomes
    assert [_outcome(served, args) for args in wrong] == outcomes
    torch.testing.assert_close(served(x), own(x))


class _Scaled(torch.nn.Module):
    """An MLP; ``reads_the_world``: Megatron-style code that reads the process group while it is traced (the
    capture bakes the world size in)."""

    def __init__(self, reads_the_world: bool):
        super().__init__()
        torch.manual_seed(0)
        self.reads_the_world = reads_the_world
        self.up, self.down = torch.nn.Linear(8, 16), torch.nn.Linear(16, 8)

    def forward(self, x):
        world = dist.get_world_size() if self.reads_the_world and dist.is_initialized() else 1
        return self.down(torch.relu(self.up(x))) * world


def _group_models() -> list:
    torch.manual_seed(0)
    return [(_Scaled(reads_the_world=True), (torch.randn(2, 3, 8),)), (_Scaled(False), (torch.randn(2, 3, 8),))]


def _group_reads(rank: int, world: int) -> None:
    made = []
    real = shared_capture._capture
    shared_capture._capture = lambda model, *args: made.append(model.reads_the_world) or real(model, *args)
    assert autotp.passes.capture.capture is shared_capture.shared_capture  # the hook parallelize's capture calls
    for model, args in _group_models():
        gm = autotp.passes.capture.capture(model, args)
        torch.testing.assert_close(gm(*args), model(*args))  # world 2 in the rank, 1 in the leader
    assert made == [True], made  # the one that read the process group captured again in the rank; the other served


def test_a_capture_that_read_the_process_group_is_not_served_to_a_rank_that_reads_another():
    """The leader, which has no process group, captures both models; what the first one's capture read of the
    process group (is_initialized: False) differs in a rank, which captures it on its own."""
    run_ranks(2, _group_reads, captures=_group_models)


def test_own_captures_leave_autotp_unhooked(monkeypatch):
    """capture_first does nothing for a builder in OWN_CAPTURES: its ranks capture as users' do."""
    called = []
    monkeypatch.setitem(shared_capture.OWN_CAPTURES, f"{__name__}._listed", lambda kind, called: kind == "own")
    for module in (autotp.passes.capture, autotp.passes.prepared_graph, autotp.parallel.split):
        monkeypatch.setattr(module, "capture", module.capture)  # restored after, whatever capture_first did
    monkeypatch.setattr(shared_capture, "_made", {})
    capture_first(functools.partial(_listed, "own", called))
    assert not called and not shared_capture._made
    assert autotp.passes.prepared_graph.capture is shared_capture._capture


def _listed(kind: str, called: list) -> list:
    called.append(kind)
    return []


TESTS = Path(__file__).resolve().parent
_RUNS = {"run_ranks", "run_local", "run_unsupervised"}
# files whose default tier already runs ranks that capture on their own (no captures=): the test that does
OWN_ELSEWHERE = {
    "test_stored_layouts.py": "test_mesh_and_pipeline_saves_are_transformers_own_files",
    "test_errors.py": "test_parallelize_twice_on_the_same_model",  # the model stays untouched
    "test_mesh.py": "test_default_microbatches_train_like_one_process",
}


def _default_tier(test: ast.FunctionDef) -> bool:
    return not any("mark.slow" in ast.unparse(d) and "parametrize" not in ast.unparse(d) for d in test.decorator_list)


def _called(call: ast.Call) -> str:
    return getattr(call.func, "id", getattr(call.func, "attr", ""))


def _shared(test: ast.FunctionDef, module: str, imported: dict) -> list[tuple[str, tuple | None]]:
    """("module.builder", its partial's arguments when they are literals, else None) of each ``captures=`` in
    ``test`` of ``module`` (``imported``: name -> the module it is imported from)."""
    found = []
    for call in [n for n in ast.walk(test) if isinstance(n, ast.Call)]:
        for keyword in call.keywords:
            if keyword.arg != "captures":
                continue
            value, args = keyword.value, ()
            if isinstance(value, ast.Call) and _called(value) == "partial":
                value, rest = value.args[0], value.args[1:]
                try:
                    args = tuple(ast.literal_eval(a) for a in rest)
                except ValueError:
                    args = None
            name = getattr(value, "id", ast.unparse(value))
            found.append((f"{imported.get(name, module)}.{name}", args))
    return found


def _runs_own(test: ast.FunctionDef) -> bool:
    return any(
        isinstance(n, ast.Call) and _called(n) in _RUNS and all(k.arg != "captures" for k in n.keywords)
        for n in ast.walk(test)
    )


def _listed_case(name: str, shared: list) -> bool:
    """Whether OWN_CAPTURES[name] picks a case: one of the literal arguments passed (any, where none is literal)."""
    which = shared_capture.OWN_CAPTURES[name]
    literal = [args for n, args in shared if n == name and args is not None]
    return which is None or not literal or any(which(*args) for args in literal)


def test_every_file_that_shares_captures_runs_a_case_with_every_rank_capturing_on_its_own():
    """A shared capture could hide what a rank's own capture does (to the user's model, to the program): each file
    that shares them runs one default-tier case without, through OWN_CAPTURES or a test of its own; and no entry of
    OWN_CAPTURES is stale (its builder is passed as captures= by a default-tier test of its file)."""
    missing, used = [], set()
    for path in sorted(TESTS.glob("test_*.py")):
        tree = ast.parse(path.read_text())
        tests = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name.startswith("test_")]
        imported = {a.name: n.module for n in tree.body if isinstance(n, ast.ImportFrom) for a in n.names}
        shared = [found for t in tests if _default_tier(t) for found in _shared(t, f"tests.{path.stem}", imported)]
        own = {name for name, _ in shared if name in shared_capture.OWN_CAPTURES and _listed_case(name, shared)}
        used |= own
        if not shared or own or path.name == "test_shared_capture.py":  # its ranks capture one model on their own
            continue
        elsewhere = [t for t in tests if t.name == OWN_ELSEWHERE.get(path.name) and _default_tier(t) and _runs_own(t)]
        if not elsewhere:
            missing.append(path.name)
    assert not missing, f"no default-tier case captures in every rank (add one to OWN_CAPTURES): {missing}"
    assert used == set(shared_capture.OWN_CAPTURES), sorted(set(shared_capture.OWN_CAPTURES) - used)
