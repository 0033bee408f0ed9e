"""Fold repeated blocks: plan a deep model from four of its blocks.

A stack of N identical blocks (an ``nn.ModuleList`` whose modules have the same classes, parameter
shapes and settings) is captured as blocks 0, 1, N-2 and N-1 only.  Block 1 stands for blocks
1..N-3: the solver counts its costs and memory N-3 times and gives block N-2 the same choices, so
every edge of the whole graph is priced (first -> middle, middle -> middle, middle -> last) and the
folded ILP is the whole-graph ILP over plans whose middle blocks agree.  Capture and solve cost the
same at any depth.  Which nodes are copies of which is read from the graph (module scopes and
parameter paths of the one repeated list), never from model or module names; a full graph whose
blocks turn out not to match is refused when the plan is applied.  Blocks before the run of identical ones
(DeepSeek-V3's three dense layers before its MoE layers) are kept whole, and the run is folded after them.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
from torch.fx import Node
from torch.fx.node import map_arg

from autotp.passes.capture import fingerprint

MIN_BLOCKS = 5  # below this, four kept blocks save nothing


class NotFoldable(ValueError):
    pass


@dataclass(frozen=True)
class Fold:
    path: str  # the repeated nn.ModuleList, e.g. "model.layers"
    count: int  # its length N in the real model
    start: int = 0  # the blocks before this one differ from the rest and are kept whole (DeepSeek-V3's dense
    #                 layers before its MoE ones): blocks start, start + 1, N-2, N-1 stand for the run

    @property
    def first(self) -> int:
        """The kept block that stands for the middle blocks (block 1 of an all-identical list)."""
        return self.start + 1

    @property
    def kept(self) -> tuple:
        return *range(self.start), self.start, self.first, self.count - 2, self.count - 1

    def rep(self, i: int) -> int:
        """The kept block that block ``i`` is planned as."""
        return i if i in self.kept else self.first

    def weight(self, i: int) -> int:
        """How many real blocks the kept block ``i`` stands for."""
        return self.count - self.start - 3 if i == self.first else 1

    def locate(self, name: str) -> tuple[int, str] | None:
        """(block index, the name inside that block) for a parameter or module path in the list."""
        head = self.path + "."
        if not name.startswith(head):
            return None
        index, _, inside = name[len(head) :].partition(".")
        return (int(index), inside) if index.isdigit() else None

    def name(self, i: int, inside: str) -> str:
        return f"{self.path}.{i}.{inside}" if inside else f"{self.path}.{i}"

    def block_of_name(self, name: str) -> int | None:
        found = self.locate(name)
        return found[0] if found else None

    def canonical(self, name: str) -> str:
        """A parameter or module path with its block index replaced by its representative's."""
        found = self.locate(name)
        return self.name(self.rep(found[0]), found[1]) if found else name

    def expand(self, by_name: dict) -> dict:
        """Entries keyed by kept-block names, copied to every block they stand for."""
        out = dict(by_name)
        for name, value in by_name.items():
            found = self.locate(name)
            if found and found[0] == self.first:
                out.update({self.name(i, found[1]): value for i in range(self.first + 1, self.count - 2)})
        return out


def _settings(module: torch.nn.Module) -> dict:
    """What makes two blocks compute the same thing: classes, tensor shapes, plain attributes."""
    found = {}
    for name, sub in module.named_modules():
        found[name, "class"] = type(sub).__qualname__
        found.update(
            ((name, k), v)
            for k, v in vars(sub).items()
            if not k.startswith("_") and isinstance(v, (bool, int, float, str, type(None), tuple))
        )
    for name, t in [*module.named_parameters(remove_duplicate=False), *module.named_buffers(remove_duplicate=False)]:
        found[name, "tensor"] = (tuple(t.shape), t.dtype, t.requires_grad)
    return found


def _identical(blocks: list, first: int = 0) -> bool:
    """Same settings, apart from an attribute that is each block's own index (a cache slot; the blocks are the
    list's from ``first`` on)."""
    settings = [_settings(b) for b in blocks]
    position = {
        k for k in settings[0] if all(type(s.get(k)) is int and s[k] == first + i for i, s in enumerate(settings))
    }
    return len({repr(sorted((k, v) for k, v in s.items() if k not in position)) for s in settings}) == 1


def find_fold(model: torch.nn.Module, min_blocks: int = MIN_BLOCKS) -> Fold | None:
    """The longest run of at least ``min_blocks`` identical blocks ending a list (the blocks before it kept whole)
    whose tensors belong to nothing else, or None."""
    owners: dict = {}
    for name, t in [*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)]:
        owners.setdefault(id(t), set()).add(name)
    best = None
    for path, mod in model.named_modules():
        if not isinstance(mod, torch.nn.ModuleList) or len(mod) < min_blocks:
            continue
        blocks = list(mod)
        if any(b is None for b in blocks):
            continue  # a ModuleList may hold None (x-transformers' missing norms): no blocks to fold
        start = next((s for s in range(len(blocks) - min_blocks + 1) if _identical(blocks[s:], s)), None)
        if (
            start is None
            or len({id(b) for b in blocks}) < len(blocks)
            or (best and len(blocks) - start <= best.count - best.start)
        ):
            continue
        tensors = [t for b in blocks for t in [*b.parameters(), *b.buffers()]]
        if any(len(owners[id(t)]) > 1 for t in tensors):
            continue  # a weight shared with another module: its copies are not independent
        best = Fold(path, len(blocks), start)
    return best


@contextlib.contextmanager
def folded(model: torch.nn.Module, fold: Fold, kept=None):
    """The model with only the kept blocks (default: ``fold.kept``) in its list, under their own names
    (``layers.78``); a pipeline stage captures its own blocks this way (parallel/split.py)."""
    parent_path, _, attr = fold.path.rpartition(".")
    parent = model.get_submodule(parent_path)
    full = getattr(parent, attr)
    short = torch.nn.ModuleList()
    for i in fold.kept if kept is None else kept:
        short._modules[str(i)] = full[i]
    setattr(parent, attr, short)
    try:
        yield model
    finally:
        setattr(parent, attr, full)


def scope_block(node: Node, fold: Fold) -> int | None:
    """The block a node runs in by its module scope (a get_attr by its name), or None."""
    if node.op == "get_attr":
        return fold.block_of_name(node.target)
    if node.op == "call_module":  # torch.export's input guards, scoped to whichever module came first
        return None
    for path, _ in (node.meta.get("nn_module_stack") or {}).values():
        i = fold.block_of_name(path)
        if i is not None:
            return i
    return None


@dataclass
class Blocks:
    """Each node's place: a block index, "pre" or "post"; and its canonical key, the same for a node
    and its copy in every graph of this model (full or folded)."""

    where: dict  # node -> block index | "pre" | "post" | "attr" | "input"
    key: dict  # node -> str
    order: list  # block indices in graph order
    position: dict  # op node -> its index among the ops of its block (or of pre / post)


def blocks(gm: torch.fx.GraphModule, fold: Fold, between: bool = False) -> Blocks:
    """Ops are placed by their module scope; unscoped ones (export's guards, size reads) by position.  An unscoped
    op between two blocks (a residual add in the model's loop) is refused, or with ``between`` placed with the
    block before it (pipeline stages are cut where the next block begins)."""
    where, key, seen = {}, {}, []
    ops = [n for n in gm.graph.nodes if n.op not in ("placeholder", "get_attr", "output")]
    scoped = [scope_block(n, fold) for n in ops]
    known = [i for i, b in enumerate(scoped) if b is not None]
    if not known:
        raise NotFoldable("no op runs inside the repeated blocks")
    for i, node in enumerate(ops):
        b = scoped[i]
        if b is None:  # between ops of one block it is that block's; before or after all blocks, pre or post
            before = next((scoped[k] for k in reversed(known) if k < i), None)
            after = next((scoped[k] for k in known if k > i), None)
            if before is not None and after is not None and before != after and not between:
                raise NotFoldable(f"{node.name} runs between two blocks")
            b = before if before is not None and after is not None else ("pre" if before is None else "post")
        if isinstance(b, int) and (not seen or seen[-1] != b):
            if b in seen:
                raise NotFoldable(f"block {b} is interleaved with another")
            seen.append(b)
        where[node] = b
    if seen != sorted(seen):  # block 1's weight stands for blocks run between the first and the last
        raise NotFoldable(f"the blocks run in the order {seen}")
    counted: dict = {}
    position = {}
    for node in ops:
        b = where[node]
        position[node] = counted[b] = counted.get(b, -1) + 1
        key[node] = f"{b if isinstance(b, str) else f'b{fold.rep(b)}'}:{position[node]}"
    for node in gm.graph.nodes:
        if node.op == "placeholder":
            where[node], key[node] = "input", f"in:{node.name}"
        elif node.op == "get_attr":
            where[node], key[node] = "attr", f"attr:{fold.canonical(node.target)}"
        elif node.op == "output":
            where[node], key[node] = "post", "output"
    return Blocks(where, key, seen, position)


def _relative(node: Node, b: Blocks, fold: Fold, ordinal: dict, sizes: dict) -> str:
    """A block op described relative to its own block, equal for every copy of a block (values of the
    previous block are counted from its end, so block 0 may differ in what comes first)."""
    me = ordinal[b.where[node]]

    def ref(a: Node) -> str:
        w = b.where[a]
        size = a.meta.get("val")
        if isinstance(size, torch.SymInt) and not size.node.expr.is_number:
            return f"size:{size.node.expr}"  # a size computed once and read by later blocks (tokens x top-k)
        if isinstance(w, int):
            step = me - ordinal[w]
            if step not in (0, 1):
                raise NotFoldable(f"{node.name} uses a value from {step} blocks back")
            return f"{step}:{b.position[a] - step * sizes[w]}"
        found = fold.locate(a.target) if w == "attr" else None
        if found:
            return f"{me - ordinal[found[0]]}:{found[1]}"
        return b.key[a]

    return f"{node.op}|{node.target}|{map_arg((node.args, node.kwargs), ref)}"


def signatures(gm: torch.fx.GraphModule, fold: Fold, b: Blocks) -> dict:
    """block index -> its ops described relative to itself."""
    ordinal = {block: k for k, block in enumerate(b.order)}
    members = [n for n in gm.graph.nodes if isinstance(b.where.get(n), int)]
    sizes = {block: sum(b.where[n] == block for n in members) for block in b.order}
    out: dict = {}
    for node in members:
        out.setdefault(b.where[node], []).append(_relative(node, b, fold, ordinal, sizes))
    return {block: tuple(sig) for block, sig in out.items()}


def check_repeats(gm: torch.fx.GraphModule, fold: Fold, b: Blocks) -> None:
    """Every block planned as block 1 must compute exactly what block 1 computes."""
    sig = signatures(gm, fold, b)
    if sorted(sig) != list(range(fold.count)) and sorted(sig) != list(fold.kept):
        raise NotFoldable(f"the graph has blocks {sorted(sig)} of {fold.path}")
    for i, s in sig.items():
        if fold.first <= i <= fold.count - 2 and s != sig[fold.first]:
            raise NotFoldable(f"{fold.path}.{i} computes something different from {fold.path}.{fold.first}")


def fold_fingerprint(gm: torch.fx.GraphModule, fold: Fold, b: Blocks) -> str:
    """capture.fingerprint over the kept blocks' copies with canonical keys: equal for the folded
    graph and the full graph of one model."""

    def kept(node: Node) -> bool:
        w = b.where[node]
        if w == "attr":
            return fold.block_of_name(node.target) in (None, *fold.kept)
        return not isinstance(w, int) or w in fold.kept

    seed = f"{fold.path}*{fold.count};" + (f"from {fold.start};" if fold.start else "")
    return fingerprint(gm, key=b.key.__getitem__, keep=kept, seed=seed)


def weights_and_ties(fold: Fold, b: Blocks) -> tuple[dict, list]:
    """node -> how many real nodes it stands for; (block 1 node, its block N-2 copy) pairs."""
    weights, by_key = {}, {}
    for node, w in b.where.items():
        i = w if isinstance(w, int) else fold.block_of_name(node.target) if w == "attr" else None
        weights[node] = fold.weight(i) if i is not None else 1
        if i in (fold.first, fold.count - 2):
            tail = ("attr", fold.locate(node.target)[1]) if w == "attr" else ("op", b.position[node])
            by_key.setdefault(tail, {})[i] = node
    ties = [(pair[fold.first], pair[fold.count - 2]) for pair in by_key.values() if len(pair) == 2]
    if len(ties) != len(by_key):
        raise NotFoldable(f"{fold.path}.{fold.first} and {fold.path}.{fold.count - 2} have different nodes")
    return weights, ties


@dataclass
class Folded:
    """A folded graph's bookkeeping, kept in ``gm.meta["autotp_fold"]`` for the solver and reports."""

    fold: Fold
    blocks: Blocks
    weights: dict
    ties: list

    def fingerprint(self, gm: torch.fx.GraphModule) -> str:
        return fold_fingerprint(gm, self.fold, self.blocks)


def fold_graph(gm: torch.fx.GraphModule, fold: Fold) -> Folded:
    """Check a graph's blocks repeat and record how to weigh and tie them (raises NotFoldable)."""
    b = blocks(gm, fold)
    check_repeats(gm, fold, b)
    return Folded(fold, b, *weights_and_ties(fold, b))


def sections(gm: torch.fx.GraphModule, fold: Fold | None = None) -> tuple[dict, int | None, Fold | None]:
    """node -> "pre" | "post" | kept block index; the real block count; the fold (None if not folded).  ``fold``:
    the blocks of a graph captured whole (every block kept)."""
    folding = gm.meta.get("autotp_fold")
    if folding is None and fold is None:
        return dict.fromkeys(gm.graph.nodes, "pre"), None, None
    fold, where = (folding.fold, dict(folding.blocks.where)) if folding else (fold, dict(blocks(gm, fold).where))
    for n in gm.graph.nodes:
        if where.get(n) == "attr":
            block = fold.block_of_name(n.target)
            users = [where[u] for u in n.users if where.get(u) not in (None, "attr")]
            where[n] = block if block is not None else (users[0] if users else "pre")
        elif where.get(n) in (None, "input"):
            where[n] = "pre"
    return where, fold.count, fold
