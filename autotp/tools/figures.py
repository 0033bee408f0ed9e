"""Plans as pictures: one block's ops with their placements and collectives, and the mesh planner's layouts by
estimated step time (``--svg`` / ``--html`` of ``autotp plan``, ``show`` and ``mesh``).  Plain SVG text, no
plotting library."""

from __future__ import annotations

import html
import re

from autotp.ops.table import TABLE

_ROWS = {str(target): row for target, row in TABLE.items()}
_SHOWN = {"linear", "matmul", "grouped_mm", "attention", "embedding", "layer_norm", "softmax", "reduction"}
_COLOURS = {"R": "#b0b0b0", "S": "#4a90d9", "P": "#f5a623", "D": "#9b59b6"}
_KEY = [("R", "replicated"), ("S", "split (shard)"), ("P", "partial sums"), ("D", "disjoint partial (experts)")]
_FONT = 'font-family="monospace" font-size="12"'
CHAR_WIDTH = 7.3  # px per character of that font, to leave room for the longest label


def _text(x: float, y: float, text: str, extra: str = "") -> str:
    return f'<text x="{x:.0f}" y="{y:.0f}" {_FONT} {extra}>{html.escape(text)}</text>'


def _box(x: float, y: float, w: float, h: float, fill: str, extra: str = "") -> str:
    return f'<rect x="{x:.0f}" y="{y:.0f}" width="{w:.0f}" height="{h:.0f}" rx="3" fill="{fill}" {extra}/>'


def _svg(width: float, height: float, body: list) -> str:
    return (
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width:.0f}" height="{height:.0f}" '
        f'viewBox="0 0 {width:.0f} {height:.0f}"><rect width="100%" height="100%" fill="white"/>'
        + "".join(body)
        + "</svg>\n"
    )


def _blocks(plan) -> list[str]:
    """The module prefixes of the plan's repeated blocks, in order (``model.layers.1.``)."""
    found = []
    for entry in plan.nodes.values():
        match = re.match(r"(.*?\.\d+\.)", entry.get("module", "") + ".")
        if match and match.group(1) not in found:
            found.append(match.group(1))
    return found


def plan_svg(plan, block: int | None = None) -> str:
    """One block of ``plan`` (default: the one folded blocks stand for, else the middle one): its products,
    attention, norms and lookups in graph order, each coloured by the placement of its output, with the
    collectives of the block beside the value they move."""
    blocks = _blocks(plan)
    if not blocks:
        raise ValueError("the plan has no repeated blocks (module paths with an index) to draw")
    prefix = blocks[block if block is not None else (1 if plan.fold else len(blocks) // 2)]

    def inside(module: str) -> bool:
        return module == prefix[:-1] or module.startswith(prefix)

    moved: dict = {}
    for c in plan.collectives:
        if inside(c.get("module", "")):
            moved.setdefault(c["tensor"], []).append(c)
    ops = [
        (name, entry)
        for name, entry in plan.nodes.items()
        if inside(entry.get("module", ""))
        and ((_ROWS.get(entry.get("op")) is not None and _ROWS[entry["op"]].family in _SHOWN) or name in moved)
    ]
    line, top = 26, 70
    body = [
        _text(
            10, 20, f"{prefix.rstrip('.')} at TP {plan.world_size}: placements and collectives", 'font-weight="bold"'
        ),
        _text(
            10,
            40,
            "est. step "
            f"{plan.cost.get('seconds', 0) * 1e3:.3f} ms for the whole model; "
            "backward collectives in italics",
        ),
    ]
    for k, (key, words) in enumerate(_KEY):
        body += [_box(10 + 190 * k, 48, 12, 12, _COLOURS[key]), _text(28 + 190 * k, 59, words)]
    for i, (name, entry) in enumerate(ops):
        y = top + i * line
        out = str(entry.get("out"))
        body.append(_box(10, y, 560, line - 4, _COLOURS.get(out[:1], "#dddddd"), 'fill-opacity="0.35"'))
        module = entry.get("module", "")[len(prefix) :] or "-"
        op = entry.get("op", "").replace("aten.", "").replace(".default", "")
        placements = f"{', '.join(str(p) for p in entry.get('in', []) if p)} -> {out}"
        body += [_text(16, y + 16, f"{module[:28]:28s} {op[:22]:22s}"), _text(400, y + 16, placements[:24])]
        for j, c in enumerate(moved.get(name, [])):
            style = 'fill="#c0392b"' + (' font-style="italic"' if c["phase"] == "backward" else "")
            body.append(_text(580 + 200 * j, y + 16, f"{c['op']} {c['bytes'] / 1e6:.2f} MB", style))
    return _svg(1000, top + len(ops) * line + 10, body)


def mesh_svg(result) -> str:
    """Every tp x pp x dp layout the mesh planner priced, by estimated step time (fitting ones first), the chosen
    one in green; layouts over the memory limit in grey with the memory they would need."""
    rows = sorted(result.candidates, key=lambda c: (not c.fits, c.step_seconds or 0.0, c.memory_bytes or 0.0))
    slowest = max((c.step_seconds for c in rows if c.fits), default=1.0)
    labels = [f"TP {c.tp} x PP {c.pp} x DP {c.dp}" for c in rows]
    line, top, width = 22, 50, 600
    left = 10 + CHAR_WIDTH * max(map(len, labels), default=0) + 12  # the longest label, then a gap
    body = [
        _text(
            10,
            20,
            f"{result.devices} devices of {result.topology}, global batch {result.global_batch}: "
            "estimated step time per layout",
            'font-weight="bold"',
        )
    ]
    for i, (c, label) in enumerate(zip(rows, labels, strict=True)):
        y = top + i * line
        body.append(_text(10, y + 14, label))
        if not c.fits:
            need = f"{c.memory_bytes / 1e9:.1f} GB" if c.memory_bytes else c.note[:70]
            body.append(_text(left, y + 14, f"does not fit ({need})", 'fill="#888888"'))
            continue
        chosen = (c.tp, c.pp, c.dp) == (result.choice.tp, result.choice.pp, result.choice.dp)
        length = width * c.step_seconds / slowest
        body += [
            _box(left, y, length, line - 6, "#27ae60" if chosen else "#4a90d9"),
            _text(
                left + length + 6,
                y + 14,
                f"{c.step_seconds:.2f} s, {c.memory_bytes / 1e9:.1f} GB" + (f", MFU {c.mfu:.0%}" if c.mfu else ""),
            ),
        ]
    return _svg(left + width + 260, top + len(rows) * line + 10, body)


def html_page(title: str, svg: str, notes: str = "") -> str:
    return (
        f"<!doctype html><html><head><meta charset='utf-8'><title>{html.escape(title)}</title></head>"
        f"<body><h1>{html.escape(title)}</h1>{svg}<p>{html.escape(notes)}</p></body></html>\n"
    )
