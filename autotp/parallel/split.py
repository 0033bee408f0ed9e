"""One pipeline stage of a model, built from its own blocks: no rank traces or runs the whole model.

The model is captured (passes/capture.py: non-strict export, dynamic sizes, on any device, meta included) while its
block list holds only this stage's blocks under their own names (passes/fold.folded), so parameters keep their
names; passes/fold.blocks places each op in a block, before the blocks ("pre": embedding, rotary tables, mask) or
after them ("post": norm, head).  The graph is then cut between blocks:
  a stage other than the first takes ``[hidden, *side]``: the stream between blocks, then the values of the pre
  part that blocks or the post part read (rotary cos/sin, a mask); the pre part is dead code, and sizes it read
  off the model's inputs are read off the received tensors;
  a stage other than the last returns ``[hidden', *side]`` (the post part is dead code); the last returns the
  model's outputs as leaves (``out_spec``: their structure, from the capture).
Every capture has the same pre and post parts (the blocks are identical), so the side values line up between
ranks.  A stage captures its neighbour blocks too: an op of the model's own loop between two blocks (a residual
add) then belongs to the block before it, and the side values (read by every block) are told from the stream.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.fx import Node

from autotp.ops.table import SIZE, op
from autotp.parallel.stages import StageError
from autotp.passes.capture import capture
from autotp.passes.fold import Fold, NotFoldable, blocks, folded
from autotp.runtime.hf_models import no_kv_cache

EARLY = ("pre", "input")


@dataclass
class Stage:
    graph: torch.fx.GraphModule  # the stage's program, parameters and buffers under the model's names
    args: tuple  # its example inputs: the model's (first stage) or meta tensors of what it receives
    kwargs: dict
    out_spec: object  # the model output's structure (the last stage returns its leaves)
    outside: dict  # parameter name -> the parts outside the blocks that read it ("pre", "post")


def stage_graph(
    model: torch.nn.Module, args: tuple, kwargs: dict, path: str, count: int, start: int, stop: int
) -> Stage:
    """Blocks ``start``..``stop - 1`` of the ``count`` blocks at ``path``, with the embedding on the first stage
    and the head on the last, from ``args`` / ``kwargs`` (one micro-batch of the model's inputs)."""
    first, last = start == 0, stop == count
    kept = list(range(max(0, start - 1), min(count, stop + 1)))  # the neighbours: where the cuts fall
    fold = Fold(path, count)
    with folded(model, fold, kept), no_kv_cache(model):
        gm = capture(model, tuple(args), kwargs)
    try:
        where = blocks(gm, fold, between=True).where
    except NotFoldable as exc:
        raise StageError(f"pipeline stages are cut between the blocks of {path}, but {exc}") from None
    g = gm.graph
    roles = _Roles(g, where, start, stop, kept)
    outside = {}
    for node in g.nodes:
        if node.op == "get_attr" and node.users:
            outside[node.target] = {where[u] for u in node.users if where.get(u) in ("pre", "post")}
    received = []
    if not first:
        received = _receive(g, roles)
    output = next(n for n in g.nodes if n.op == "output")
    if not last:
        output.args = ((roles.hidden_out(), *(received[1:] if received else roles.side)),)
    _drop_dead(g, output, received)
    gm._forward_pre_hooks.clear()  # export's check of the model's inputs: the stage has its own
    gm._forward_hooks.clear()
    g._codegen = torch.fx.graph.CodeGen()  # positional inputs, a tuple of outputs
    g.lint()
    stage = _plain(gm, g, model)
    example = (tuple(args), dict(kwargs or {})) if first else (tuple(_example(p) for p in received), {})
    return Stage(stage, *example, gm._out_spec, outside)


class _Roles:
    """What crosses the cut: the stream into block ``start``, the side values, the stream out of ``stop - 1``."""

    def __init__(self, g: torch.fx.Graph, where: dict, start: int, stop: int, kept: list):
        self.g, self.where, self.start, self.stop = g, where, start, stop
        every_block = [a for a in self.reads(lambda n: where.get(n) == kept[1]) if self.early(a) and _tensor(a)]
        after = self.reads(lambda n: where.get(n) == "post")
        self.side = list(dict.fromkeys(every_block + [a for a in after if self.early(a) and _tensor(a)]))
        stream = [a for a in self.reads(lambda n: where.get(n) == start) if _tensor(a) and a not in every_block]
        if len(stream) != 1:
            raise StageError(
                f"block {start} reads {[a.name for a in stream]} from before it, besides what every "
                "block reads: pipeline stages pass exactly one stream between blocks"
            )
        self.hidden_in = stream[0]

    def own(self, node: Node) -> bool:
        w = self.where.get(node)
        return isinstance(w, int) and self.start <= w < self.stop

    def later(self, node: Node) -> bool:
        w = self.where.get(node)
        return w == "post" or (isinstance(w, int) and w >= self.stop)

    def early(self, node: Node) -> bool:
        return self.where.get(node) in EARLY

    def reads(self, selected) -> list:
        """Values from outside the selected nodes (parameters aside) that they read, in graph order."""
        found: dict = {}
        for node in self.g.nodes:
            if selected(node):
                found.update((a, None) for a in node.all_input_nodes if not selected(a) and self.where.get(a) != "attr")
        return list(found)

    def hidden_out(self) -> Node:
        outs = list(
            dict.fromkeys(
                a for n in self.g.nodes if self.later(n) for a in n.all_input_nodes if self.own(a) and _tensor(a)
            )
        )  # sizes are made again after the cut
        if len(outs) != 1:
            raise StageError(
                f"what follows block {self.stop - 1} reads {[a.name for a in outs]} from this stage's "
                "blocks: pipeline stages pass exactly one stream between blocks"
            )
        return outs[0]


def _receive(g: torch.fx.Graph, roles: _Roles) -> list:
    """Placeholders for ``[hidden, *side]`` in place of what the pre part (or a neighbour block) computed; sizes
    read off the model's inputs re-read off them.  Returns the placeholders."""
    anchor = next(n for n in g.nodes if n.op == "placeholder")
    received = []
    for role, value in [("stream", roles.hidden_in), *(("side", v) for v in roles.side)]:
        with g.inserting_before(anchor):
            received.append(g.placeholder(f"{role}_{value.name}"))
        received[-1].meta = dict(value.meta)

    def reader(user: Node) -> bool:
        return roles.own(user) or roles.later(user) or user.op == "output"

    for value, placeholder in zip(roles.side, received[1:], strict=True):
        stream = value is roles.hidden_in  # read as the stream by block ``start``, as a side value by the rest
        value.replace_all_uses_with(
            placeholder, delete_user_cb=lambda u, s=stream: reader(u) and not (s and roles.where.get(u) == roles.start)
        )
    roles.hidden_in.replace_all_uses_with(received[0], delete_user_cb=reader)
    sizes = dict.fromkeys(
        a
        for n in g.nodes
        if reader(n)
        for a in n.all_input_nodes
        if not reader(a) and not _tensor(a) and roles.where.get(a) != "attr"
    )
    made: dict = {}
    for value in sizes:
        value.replace_all_uses_with(_size(g, value, received, made), delete_user_cb=reader)
    return received


def _size(g: torch.fx.Graph, value: Node, received: list, made: dict) -> Node:
    """A size computed before the cut (read off the model's inputs, or by an earlier block: export shares size
    arithmetic between blocks), made again from the received tensors: a dim of theirs with the same expression, or
    the same arithmetic on sizes made so."""
    if value not in made:
        expr = getattr(value.meta.get("val"), "node", None)
        at = next(
            (
                (p, d)
                for p in received
                for d, n in enumerate(p.meta["val"].shape)
                if expr is not None and isinstance(n, torch.SymInt) and n.node.expr == expr.expr
            ),
            None,
        )
        if at is None and (value.op != "call_function" or any(_tensor(a) for a in value.all_input_nodes)):
            raise StageError(
                f"the blocks read {value.name} ({value.meta.get('val')}) from before them, which no "
                "value passed between stages carries"
            )
        args = at if at is not None else torch.fx.node.map_arg(value.args, lambda a: _size(g, a, received, made))
        with g.inserting_after(max([received[-1], *made.values()], key=_position(g))):
            made[value] = g.call_function(SIZE if at is not None else value.target, args)
        made[value].meta = dict(value.meta)
    return made[value]


def _position(g: torch.fx.Graph):
    order = {node: k for k, node in enumerate(g.nodes)}
    return order.__getitem__


def _drop_dead(g: torch.fx.Graph, output: Node, received: list) -> None:
    """What the outputs do not need (the other parts, export's input guards).  Reachability, not fx's DCE, which
    keeps ops it calls impure (sdpa) and with them the pre part; dtype/device checks of live values stay."""
    live, todo = set(), [output]
    while todo:
        node = todo.pop()
        if node not in live:
            live.add(node)
            todo.extend(node.all_input_nodes)
    for node in reversed(list(g.nodes)):
        check = "checks_dtype" in op(node.target).tags and node.args[0] in live
        if node not in live and not check and (node.op != "placeholder" or (received and node not in received)):
            g.erase_node(node)


def _plain(gm: torch.fx.GraphModule, g: torch.fx.Graph, model: torch.nn.Module) -> torch.fx.GraphModule:
    """A plain GraphModule of ``g`` (export's refuses ``train()``), holding what the graph reads under every name
    the model gives it (tied names too) and with the model's buffer persistence."""
    stage = torch.fx.GraphModule(gm, g)
    used = {id(t) for _, t in [*stage.named_parameters(), *stage.named_buffers()]}
    for name, tensor in [*gm.named_parameters(remove_duplicate=False), *gm.named_buffers(remove_duplicate=False)]:
        if id(tensor) not in used:
            continue
        owner_path, _, attr = name.rpartition(".")
        owner = _submodule(stage, owner_path)
        if isinstance(tensor, torch.nn.Parameter):
            owner.register_parameter(attr, tensor)
        else:
            held = model.get_submodule(owner_path)
            owner.register_buffer(attr, tensor, persistent=attr not in held._non_persistent_buffers_set)
    return stage


def _submodule(root: torch.nn.Module, path: str) -> torch.nn.Module:
    """The submodule at ``path``, made (as an empty Module) where missing."""
    module = root
    for part in path.split(".") if path else []:
        if not hasattr(module, part):
            module.add_module(part, torch.nn.Module())
        module = getattr(module, part)
    return module


def _tensor(node: Node) -> bool:
    return isinstance(node.meta.get("val"), torch.Tensor)


def _example(placeholder: Node) -> torch.Tensor:
    """A meta tensor of a received value's example sizes (symbolic sizes at their hints)."""
    value = placeholder.meta["val"]
    shape = [int(s.node.hint) if isinstance(s, torch.SymInt) else int(s) for s in value.shape]
    return torch.empty(shape, dtype=value.dtype, device="meta")
