"""What a mixture (`data.mix`) is: its sources, checked. A source is the source fields of
data/spec.py's DataSpec (everything but the run-wide tokenizer, seq_len, mix and document_mask)
plus `weight` and `label`; a field it leaves out takes the data section's value, so there is one
definition of what a source is. Bad sources are one-line DataErrors naming the source and field.
The order of samples over the sources: data/mixture.py.
"""
import math
import typing
from dataclasses import dataclass, fields, replace
from fractions import Fraction
from typing import List

from data.spec import DataError, DataSpec, check_no_credentials

RUN_WIDE = ("tokenizer", "seq_len", "mix", "document_mask", "read_ahead_steps")
"""DataSpec fields that belong to the run, not to a source: one tokenizer, one sample length, one
attention rule, one read-ahead worker."""
SOURCE_FIELDS = tuple(f.name for f in fields(DataSpec) if f.name not in RUN_WIDE)
MIX_FIELDS = SOURCE_FIELDS + ("weight", "label")


@dataclass(frozen=True)
class MixSource:
    """One checked source of a mixture."""
    index: int
    label: str
    weight: Fraction
    """As given (not normalised); exact: 0.3 is 3/10."""
    spec: DataSpec
    """The data section with this source's fields in place of the section's own, and no mix."""


def _typed(where: str, value, annotation):
    """`value` as the DataSpec field's type, or a DataError naming the field and the type."""
    if typing.get_origin(annotation) is typing.Union:  # Optional[T]
        if value is None:
            return None
        annotation = [a for a in typing.get_args(annotation) if a is not type(None)][0]
    if annotation is float and isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    if annotation is int and isinstance(value, int) and not isinstance(value, bool):
        return value
    if annotation in (str, bool) and type(value) is annotation:
        return value
    raise DataError(f"{where}={value!r} has the wrong type: expected {annotation.__name__}")


def _weight(where: str, value) -> Fraction:
    if isinstance(value, str):  # YAML 1.1 reads `3e-1` (no dot) as a string
        try:
            value = float(value)
        except ValueError:
            pass
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise DataError(f"{where}={value!r} must be a number >= 0")
    if value < 0:
        raise DataError(f"{where}={value!r} is negative; weights are shares of the samples, >= 0")
    return Fraction(repr(value)) if isinstance(value, float) else Fraction(value)


def parse_mixture(spec: DataSpec) -> List[MixSource]:
    """The checked sources of `spec.mix` (DataError, one line, naming the source and the field)."""
    hints = typing.get_type_hints(DataSpec)
    sources: List[MixSource] = []
    for i, item in enumerate(spec.mix):
        where = f"data.mix[{i}]"
        check_no_credentials(where, item)  # first: the messages below repeat the values they refuse
        if not isinstance(item, dict):
            raise DataError(f"{where} must be a mapping of source fields ({', '.join(MIX_FIELDS)}), got {item!r}")
        for key in item:
            if key in RUN_WIDE:
                raise DataError(f"{where}.{key}: one {key} for all sources of a mixture; set data.{key} instead")
            if key not in MIX_FIELDS:
                raise DataError(f"{where} has an unknown field {key!r}; the fields of a source: {', '.join(MIX_FIELDS)}")
        values = {k: _typed(f"{where}.{k}", v, hints[k]) for k, v in item.items() if k in SOURCE_FIELDS}
        source_spec = replace(spec, mix=[], **values)
        label = item.get("label", source_spec.name)
        if not isinstance(label, str) or not label:
            raise DataError(f"{where}.label={label!r} must be a non-empty string")
        sources.append(MixSource(i, label, _weight(f"{where}.weight", item.get("weight", 1)), source_spec))
    labels = [s.label for s in sources]
    for s in sources:
        if labels.count(s.label) > 1:
            twins = [i for i, label in enumerate(labels) if label == s.label]
            raise DataError(f"data.mix: sources {twins} share the label {s.label!r}; give each its own `label`")
    if not sources:
        raise DataError("data.mix is empty; list at least one source, or leave data.mix out for one source")
    if sum(s.weight for s in sources) == 0:
        raise DataError("data.mix: every weight is 0; give at least one source a positive weight")
    return sources
