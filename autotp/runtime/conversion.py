"""transformers' stored layout: the model's own conversion mapping, applied slice by slice.

transformers 5 stores some tensors under other names or in other shapes than the model holds them:
GPT-NeoX's ``lm_head`` is stored as ``embed_out``; Mixtral's and Qwen-MoE's experts are stored one
matrix per expert (``experts.3.w1.weight``) and stacked, gate and up concatenated, into 3-D parameters
(``experts.gate_up_proj [E, 2I, H]``) only on load.  The conversions are transformers' own (looked up
for the model's class and type, never by a name here); autotp understands renames and the stack /
concatenate conversions, so that a rank reads only the rows of each expert's file tensor its slice
needs.  Any other conversion that matches a stored tensor is refused rather than guessed.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch


class CheckpointError(ValueError):
    pass


@dataclass(frozen=True)
class Assembled:
    """One model tensor made of stored tensors: ``keys[p][e]`` is pattern ``p``'s tensor of expert ``e``;
    experts are stacked along ``stack`` (None: one stored tensor per pattern), patterns concatenated
    along ``concat`` (None: one pattern)."""

    keys: tuple
    stack: int | None = None
    concat: int | None = None

    @staticmethod
    def plain(key: str) -> Assembled:
        return Assembled(((key,),))

    def shape(self, stored_shape) -> tuple:
        parts = [self._part_shape(stored_shape, keys) for keys in self.keys]
        if self.concat is None:
            return parts[0]
        shape = list(parts[0])
        shape[self.concat] = sum(part[self.concat] for part in parts)
        return tuple(shape)

    def read(self, box: list, stored_shape, read_stored) -> torch.Tensor:
        """The box (one ``slice`` per model dim, steps of 1) of the model tensor, reading only those
        bytes: ``read_stored(key, stored box)`` reads a piece of one stored tensor."""
        if self.concat is None:
            return self._read_part(self.keys[0], box, read_stored)
        pieces, offset, wanted = [], 0, box[self.concat]
        for keys in self.keys:  # each pattern's rows of the concatenated dim, in its own coordinates
            low = offset
            offset += self._part_shape(stored_shape, keys)[self.concat]
            start, stop = max(wanted.start, low), min(wanted.stop, offset)
            if start < stop or (not pieces and offset >= wanted.stop):  # an empty box still reads its shape
                part_box = list(box)
                part_box[self.concat] = slice(start - low, max(start, stop) - low)
                pieces.append(self._read_part(keys, part_box, read_stored))
        return pieces[0] if len(pieces) == 1 else torch.cat(pieces, self.concat)

    def _part_shape(self, stored_shape, keys) -> tuple:
        shape = list(stored_shape(keys[0]))
        if self.stack is not None:
            shape.insert(self.stack, len(keys))
        return tuple(shape)

    def _read_part(self, keys, box: list, read_stored) -> torch.Tensor:
        if self.stack is None:
            return read_stored(keys[0], box)
        inner = box[: self.stack] + box[self.stack + 1 :]
        experts = keys[box[self.stack]]
        if not experts:  # an empty range still has the right shape
            return read_stored(keys[0], inner).unsqueeze(self.stack).narrow(self.stack, 0, 0)
        return torch.stack([read_stored(key, inner) for key in experts], self.stack)


def model_conversions(model) -> list:
    """transformers' conversion mapping for ``model`` (empty for a model that is not transformers')."""
    try:
        from transformers import PreTrainedModel
        from transformers.conversion_mapping import get_model_conversion_mapping
    except ImportError:
        return []
    return get_model_conversion_mapping(model) if isinstance(model, PreTrainedModel) else []


def assemble(stored_keys, conversions: list) -> dict:
    """Model tensor name -> Assembled, by transformers' rules: every renaming in order, then at most
    one converter, stored tensors taken in transformers' order (natural: expert 2 before expert 10)."""
    from transformers.core_model_loading import WeightConverter, apply_renamings, dot_natural_key

    renamings = [c for c in conversions if not isinstance(c, WeightConverter)]
    converters = [c for c in conversions if isinstance(c, WeightConverter)]
    plain, grouped = {}, {}
    for key in sorted(stored_keys, key=dot_natural_key):
        renamed = apply_renamings(key, renamings)
        for converter in converters:
            target, pattern = converter.rename_source_key(renamed)
            if pattern is not None:
                entry = grouped.setdefault(target, (converter, {}))
                if entry[0] is not converter:
                    raise CheckpointError(f"{target} is the target of two conversions ({entry[0]}, {converter})")
                entry[1].setdefault(pattern, []).append(key)
                break
        else:
            if renamed in plain:
                raise CheckpointError(f"{plain[renamed].keys[0][0]} and {key} are both stored for {renamed}")
            plain[renamed] = Assembled.plain(key)
    for target, (converter, by_pattern) in grouped.items():
        if target in plain:
            raise CheckpointError(f"{target} is stored both whole and as parts ({converter})")
        plain[target] = _converted(target, converter, by_pattern)
    return plain


def _converted(target: str, converter, by_pattern: dict) -> Assembled:
    """The stack-then-concatenate converters (MergeModulelist, Concatenate); any other is refused."""
    from transformers.core_model_loading import Concatenate, MergeModulelist

    ops = converter.operations
    kinds = tuple(type(op) for op in ops)
    stack = ops[0].dim if kinds in ((MergeModulelist,), (MergeModulelist, Concatenate)) else None
    concat = ops[-1].dim if kinds in ((Concatenate,), (MergeModulelist, Concatenate)) else None
    keys = tuple(tuple(by_pattern[p]) for p in converter.source_patterns if p in by_pattern)
    understood = (
        (stack is not None or concat is not None)
        and (len(keys) == 1 or concat is not None)
        and (stack is not None or all(len(k) == 1 for k in keys))
    )
    if not understood:
        raise CheckpointError(
            f"{target}: transformers converts the stored tensors {sorted(k for ks in keys for k in ks)[:4]} with "
            f"{[type(op).__name__ for op in ops]}, which autotp cannot read in slices (it reads renames, "
            "MergeModulelist and Concatenate): load the model with transformers' from_pretrained and pass it to "
            "autotp.parallelize instead"
        )
    return Assembled(keys, stack, concat)


def weightless(model):
    """What ``stored_layout`` needs of ``model`` and nothing more, for holders that must not keep every weight of
    the model alive (a pipeline's stages): a copy whose parameters and buffers are on the meta device (classes,
    config and module tree kept), or None for a model transformers has no conversion mapping for."""
    return on_meta(model) if model_conversions(model) else None


def on_meta(model):
    """``model`` itself when every tensor of it is on the meta device, else a copy of it that holds them there
    (tied tensors stay tied)."""
    tensors = [*model.parameters(), *model.buffers()]
    if all(t.is_meta for t in tensors):
        return model
    memo = {
        id(t): torch.nn.Parameter(t.detach().to("meta"), t.requires_grad)
        if isinstance(t, torch.nn.Parameter)
        else t.to("meta")
        for t in tensors
    }
    return copy.deepcopy(model, memo)


def stored_layout(model, named_tensors):
    """(name, full tensor) pairs in the layout transformers' ``save_pretrained`` writes for ``model``
    (its conversions reversed: stacked experts split per expert, renamed tensors under their stored names)."""
    conversions = model_conversions(model)
    if not conversions:
        yield from named_tensors
        return
    from transformers.core_model_loading import WeightConverter, revert_weight_conversion

    joint = [
        c.reverse_transform() for c in conversions if isinstance(c, WeightConverter) and len(c.target_patterns) > 1
    ]
    for name, tensor in named_tensors:
        for reverse in joint:
            if reverse.rename_source_key(name)[1] is not None:
                raise CheckpointError(
                    f"saving {name} needs {reverse.source_patterns} together to reverse "
                    "transformers' conversion; autotp writes one tensor at a time: save with "
                    "transformers instead"
                )
        yield from revert_weight_conversion(model, {name: tensor}).items()
