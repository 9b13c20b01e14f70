"""Hypothesis strategies for protobuf messages, built from their descriptors: every field drawn
from its wire type at full range (NaN and infinities for floats, any text for strings, extreme
integers), repeated fields as short lists, each field present or not; a field's strategy can be
overridden by its full name (to keep generated work small, or to aim at valid values more often)."""

from __future__ import annotations

from google.protobuf.descriptor import FieldDescriptor as F
from hypothesis import strategies as st

_INTS = {
    F.TYPE_INT32: (-(2**31), 2**31 - 1), F.TYPE_SINT32: (-(2**31), 2**31 - 1), F.TYPE_SFIXED32: (-(2**31), 2**31 - 1),
    F.TYPE_UINT32: (0, 2**32 - 1), F.TYPE_FIXED32: (0, 2**32 - 1),
    F.TYPE_INT64: (-(2**63), 2**63 - 1), F.TYPE_SINT64: (-(2**63), 2**63 - 1), F.TYPE_SFIXED64: (-(2**63), 2**63 - 1),
    F.TYPE_UINT64: (0, 2**64 - 1), F.TYPE_FIXED64: (0, 2**64 - 1),
}


def _scalar(f):
    if f.type in _INTS:
        lo, hi = _INTS[f.type]
        return st.one_of(st.sampled_from([lo, hi, 0, 1, -1 if lo < 0 else 2]), st.integers(lo, hi))
    if f.type == F.TYPE_FLOAT:
        return st.floats(width=32)
    if f.type == F.TYPE_DOUBLE:
        return st.floats()
    if f.type == F.TYPE_BOOL:
        return st.booleans()
    if f.type == F.TYPE_STRING:
        return st.text(max_size=40)
    if f.type == F.TYPE_BYTES:
        return st.binary(max_size=40)
    if f.type == F.TYPE_ENUM:
        return st.one_of(st.sampled_from([v.number for v in f.enum_type.values]), st.integers(-5, 50))
    raise TypeError(f"no strategy for {f.full_name} (type {f.type})")


def messages(cls, overrides: dict | None = None, max_list: int = 4, depth: int = 3):
    """A strategy of cls instances. overrides: {field full name: strategy of its value (a list for
    a repeated field)}; a field named there is always set."""
    overrides = overrides or {}
    desc = cls.DESCRIPTOR
    required, optional = {}, {}
    for f in desc.fields:
        if f.full_name in overrides:
            required[f.name] = overrides[f.full_name]
            continue
        if f.type == F.TYPE_MESSAGE and f.message_type.GetOptions().map_entry:  # map<k, v>
            key, value = f.message_type.fields_by_name["key"], f.message_type.fields_by_name["value"]
            optional[f.name] = st.dictionaries(_scalar(key), _scalar(value), max_size=max_list)
            continue
        if f.type == F.TYPE_MESSAGE:
            if depth == 0 or f.message_type.full_name.startswith("google."):
                continue
            one = messages(f.message_type._concrete_class, overrides, max_list, depth - 1)
        else:
            one = _scalar(f)
        repeated = f.is_repeated if hasattr(f, "is_repeated") else f.label == F.LABEL_REPEATED
        optional[f.name] = st.lists(one, max_size=max_list) if repeated else one
    return st.builds(lambda fields: cls(**fields), st.fixed_dictionaries(required, optional=optional))
