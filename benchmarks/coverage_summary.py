"""The coverage sweep's table and markdown summary (benchmarks/coverage/summary.md) from its JSON-lines records."""

from __future__ import annotations

import re
from collections import defaultdict
from pathlib import Path

OUT = Path(__file__).resolve().parent / "coverage"
SHARDED = 0.6  # a rank holds at most this share of the block weights (Megatron: about half, norms whole)


def sharded(e: dict) -> bool:
    return bool(e.get("planned")) and e.get("share") is not None and e["share"] <= SHARDED


def heads_split(e: dict) -> bool | None:
    """True / False, or None for a model without attention cores."""
    if not e.get("planned") or not e.get("attention_ops"):
        return None
    return not e["unsplit_attention"]


def cheaper(e: dict) -> bool:
    """Over Megatron's count, but the plan at it (the extra collectives' modules kept whole, heads split) costs more
    a step by the same cost model (coverage_sweep.at_count)."""
    return bool((e.get("at_count") or {}).get("better"))


def at_megatron(e: dict) -> bool:
    """At Megatron's count or better: at most its collectives a block, or cheaper than the plan at it."""
    return sharded(e) and (e.get("over_megatron", 1) <= 0 or cheaper(e))


def _worst_block(e: dict) -> str:
    per = e.get("per_block") or {}
    if not per:
        return "-"
    texts = {b: ", ".join(f"{n} {op}" for op, n in sorted(c.items())) or "0" for b, c in per.items()}
    return "; ".join(f"{b}: {t}" for b, t in sorted(texts.items()))


def _why_not_sharded(e: dict) -> str:
    reason = e["replicated"][0] if e.get("replicated") else "no op runs replicated: the solver kept weights whole"
    return f"share {e['share']:.2f} a rank; {reason}" if e.get("share") is not None else f"no block weights; {reason}"


def _why_heads(e: dict) -> str:
    """The attention op and its placement (without the module: models group by it), and the first op that ran
    replicated in the model, if any."""
    found = re.match(r"(\S+) in (\S+): out (\S+)", e["unsplit_attention"][0])
    text = f"{found.group(1)} out {found.group(3)}" if found else e["unsplit_attention"][0]
    return text + (f"; runs replicated: {e['replicated'][0]}" if e.get("replicated") else "; no op runs replicated")


_COLLECTIVE = re.compile(r"^(\w+) of \S+ \((.+?)\) in (.*)$")


def _extra(e: dict) -> str:
    """The worst block's collectives beyond the residual sums (all-reduces of an add at the block's own level),
    each as its kind, the op whose output it moves and the module relative to the block."""
    items = set()
    for text in e.get("collectives", []):
        found = _COLLECTIVE.match(text)
        if not found:
            continue
        op, node_op, module = found.groups()
        relative = re.sub(r"^.*?\.\d+\.?", "", module, count=1)
        if op in ("all_reduce", "reduce_scatter") and not relative and node_op.startswith("aten.add"):
            continue
        items.add(f"{op} of {node_op} in {relative or 'the block'}")
    return "; ".join(sorted(items)) if items else _worst_block(e)


def _kept_whole(e: dict) -> str:
    """What the plan at Megatron's count (those modules kept whole) would be: not at it, not split by heads, or
    cheaper a step (then the sweep's forcing of block matrices, memory, is what chose the extra collectives)."""
    alt = e.get("at_count") or {}
    if "seconds" not in alt:
        return ""
    if alt["over_megatron"] > 0 or alt["unsplit_attention"]:
        return "; kept whole, still over the count" if alt["over_megatron"] > 0 else "; kept whole, heads not split"
    return "; kept whole (those weights on every rank, which the sweep's forcing rules out): at the count, cheaper"


def rows(plans: dict, exacts: dict) -> list[dict]:
    out = []
    for name, e in sorted(plans.items()):
        if not e.get("captured"):
            continue
        x = exacts.get(name, {})
        exact = x.get("result", "not run")
        if exact == "mismatch":
            exact = f"mismatch ({x.get('mismatch')})"
        elif exact in ("crash", "refused"):
            exact = f"{exact} ({x.get('error', '')[:120]})"
        h = heads_split(e)
        out.append(
            {
                "name": name,
                "family": e.get("family", "?"),
                "planned": "yes" if e.get("planned") else "no",
                "share": "-" if e.get("share") is None else f"{e['share']:.2f}",
                "forward a block": _worst_block(e) if e.get("planned") else "-",
                "heads split": "-" if h is None else ("yes" if h else "no"),
                "Megatron": "yes" if at_megatron(e) else "no",
                "exact": exact,
            }
        )
    return out


def shortfalls(plans: dict, exacts: dict) -> dict:
    """reason -> model names, for every captured architecture short of a full result."""
    found = defaultdict(list)
    for name, e in sorted(plans.items()):
        if not e.get("captured"):
            continue
        if e.get("error"):
            found[f"planning failed at {e.get('stage')}: {e.get('error')} [{e.get('where')}]"].append(name)
            continue
        if not e.get("autotp_capture"):
            found[f"autotp's capture failed (plain torch.export takes it): {e.get('capture_error')}"].append(name)
            continue
        if not sharded(e):
            found[f"not sharded: {_why_not_sharded(e)}"].append(name)
        if heads_split(e) is False:
            found[f"attention not split by heads: {_why_heads(e)}"].append(name)
        if e.get("planned_on"):
            found[f"capture on meta failed (the same model on the CPU planned): {e.get('capture_error')}"].append(name)
        if sharded(e) and not at_megatron(e):
            found[f"above Megatron's count: {_extra(e)}{_kept_whole(e)}"].append(name)
        x = exacts.get(name)
        if x and x.get("result") == "mismatch":
            found[f"not exact: {x['mismatch']}"].append(name)
        elif x and x.get("result") == "crash":
            found[f"crashed at 2 ranks: {x.get('error')}"].append(name)
        elif x and x.get("result") == "refused":
            found[f"refused with a reason: {x.get('error')}"].append(name)
    return found


def excluded(plans: dict) -> dict:
    found = defaultdict(list)
    for name, e in sorted(plans.items()):
        if not e.get("captured"):
            what = e.get("capture_error") or e.get("error")
            found[f"{e.get('stage', 'capture')}: {what}"].append(name)
    return found


def counts(plans: dict, exacts: dict) -> dict:
    captured = [e for e in plans.values() if e.get("captured")]
    ran = [n for n in exacts if plans.get(n, {}).get("captured")]
    return {
        "found": len(plans),
        "built": sum(bool(e.get("built")) for e in plans.values()),
        "captured": len(captured),
        "autotp captured": sum(bool(e.get("autotp_capture")) for e in captured),
        "planned": sum(bool(e.get("planned")) for e in captured),
        "sharded": sum(sharded(e) for e in captured),
        "with attention": sum(heads_split(e) is not None for e in captured),
        "heads split": sum(heads_split(e) is True for e in captured),
        "at Megatron's count": sum(at_megatron(e) for e in captured),
        "heads split at Megatron's count": sum(heads_split(e) is True and at_megatron(e) for e in captured),
        "... of them cheaper than the plan at its count": sum(
            heads_split(e) is True and at_megatron(e) and cheaper(e) for e in captured
        ),
        "exact runs": len(ran),
        "exact": sum(exacts[n].get("result") == "exact" for n in ran),
        "refused with a reason": sum(exacts[n].get("result") == "refused" for n in ran),
        "seconds (plan)": round(sum(e.get("seconds", 0) for e in plans.values())),
        "seconds (exact)": round(sum(x.get("seconds", 0) for x in exacts.values())),
    }


def families(plans: dict, exacts: dict) -> list[dict]:
    """Counts by family (the sweep's classification from config fields and the main input)."""
    out = []
    for family in sorted({e.get("family", "?") for e in plans.values() if e.get("captured")}):
        of = {n: e for n, e in plans.items() if e.get("captured") and e.get("family", "?") == family}
        c = counts(of, {n: x for n, x in exacts.items() if n in of})
        out.append(
            {
                "family": family,
                "captured": c["captured"],
                "planned": c["planned"],
                "sharded": c["sharded"],
                "heads split": f"{c['heads split']} of {c['with attention']}",
                "at Megatron's count": c["at Megatron's count"],
                "exact": f"{c['exact']} of {c['exact runs']}",
            }
        )
    return out


def _table(items: list[dict]) -> list[str]:
    if not items:
        return []
    head = list(items[0])
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join(str(r[h]).replace("|", "\\|") for h in head) + " |" for r in items]
    return lines


def _at_four(plans: dict, at_four: dict) -> list:
    """Exactness at 4 ranks, one model a family (``coverage_sweep.py exact4``)."""
    if not at_four:
        return []
    lines = [
        "## At 4 ranks",
        "",
        f"{sum(e.get('result') == 'exact' for e in at_four.values())} of {len(at_four)} "
        "exact: the first planned model of each family, in name order.",
        "",
        "| model | family | result | output error | gradient error |",
        "|---|---|---|---|---|",
    ]
    for name, e in sorted(at_four.items()):
        result = e.get("result", "?") + (f" ({e['error'][:120]})" if e.get("error") else "")
        lines.append(
            f"| {name} | {plans.get(name, {}).get('family', '?')} | {result} | "
            f"{e.get('out_err', float('nan')):.2g} | {e.get('grad_err', float('nan')):.2g} |"
        )
    return [*lines, ""]


def summarize(plans: dict, exacts: dict, at_four: dict | None = None) -> str:
    from coverage_build import family_of

    for name, e in plans.items():  # families by today's rule (records keep the one of their run)
        if e.get("captured"):
            e["family"] = family_of(name) or e.get("family", "?")
    c = counts(plans, exacts)
    m, megatron, both = c["captured"], c["at Megatron's count"], c["heads split at Megatron's count"]
    head = (
        f"{c['exact']} of {m} exact ({c['exact runs']} run at 2 ranks), {c['sharded']} of {m} sharded, "
        f"{megatron} of {m} at Megatron's count; heads split in {c['heads split']} of "
        f"{c['with attention']} with attention cores, {both} of them at Megatron's count"
    )
    lines = [
        "# Coverage sweep",
        "",
        head,
        "",
        f"M = {m}: the architectures whose model torch.export captures in one process (autotp's capture, or a "
        f"plain static torch.export where autotp's failed), of {c['found']} found and {c['built']} that build "
        "from the shrunk config and run a forward on the CPU.",
        "",
        "| count | value |",
        "|---|---|",
        *[f"| {k} | {v} |" for k, v in c.items()],
        "",
        *_table(families(plans, exacts)),
        "",
        *_at_four(plans, at_four or {}),
        "## Shortfalls",
        "",
    ]
    for reason, who in sorted(shortfalls(plans, exacts).items(), key=lambda kv: -len(kv[1])):
        lines.append(f"- {reason.replace('|', '/')} ({len(who)}): {', '.join(who)}")
    lines += ["", "## Results", "", *_table(rows(plans, exacts)), "", "## Not in the denominator", ""]
    for reason, who in sorted(excluded(plans).items(), key=lambda kv: -len(kv[1])):
        lines.append(f"- {reason} ({len(who)}): {', '.join(who)}")
    text = "\n".join(lines) + "\n"
    OUT.mkdir(exist_ok=True)
    (OUT / "summary.md").write_text(text)
    print(head)
    for k, v in c.items():
        print(f"  {k}: {v}")
    print(f"written {OUT / 'summary.md'}")
    return text
