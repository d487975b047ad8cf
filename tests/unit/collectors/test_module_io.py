"""How a module's inputs and outputs are flattened into tensors (collectors.module_io)."""

from __future__ import annotations

import dataclasses
from collections import OrderedDict, namedtuple

import torch

from msmon.collectors.module_io import select, tensors_in
from msmon.config import TensorSpec


def walked(value, depth=0):
    """The order a reader expects, written out plainly: a tensor itself; else, up to nesting 8,
    the items of a tuple or list, a dict's values, a dataclass's fields, each walked in turn."""
    if isinstance(value, torch.Tensor):
        return [value]
    if depth > 8:
        return []
    if isinstance(value, (tuple, list)):
        items = list(value)
    elif isinstance(value, dict):
        items = list(value.values())
    elif dataclasses.is_dataclass(value) and not isinstance(value, type):
        items = [getattr(value, f.name) for f in dataclasses.fields(value)]
    else:
        return []
    return [t for item in items for t in walked(item, depth + 1)]


@dataclasses.dataclass
class Output:
    logits: torch.Tensor
    extras: tuple
    note: str = "not a tensor"


def nested(depth: int, leaf: torch.Tensor):
    value = leaf
    for _ in range(depth):
        value = [value]
    return value


def test_tensors_in_nested_outputs_come_depth_first_in_order_from_every_container_kind():
    t = [torch.full((2,), float(i)) for i in range(9)]
    Pair = namedtuple("Pair", "a b")
    value = (
        t[0],
        [t[1], {"x": t[2], "skip": 3, "y": (t[3], None)}],
        OrderedDict(first=t[4], second=Output(t[5], (t[6], "s"))),
        Pair(t[7], [[t[8]]]),
        "text",
    )
    found = tensors_in(value)
    assert [id(x) for x in found] == [id(x) for x in walked(value)]
    assert [int(x[0]) for x in found] == list(range(9))


def test_tensors_in_takes_tensors_nested_nine_deep_and_leaves_out_deeper_ones():
    leaf = torch.ones(1)
    assert tensors_in(nested(9, leaf)) == walked(nested(9, leaf)) == [leaf]
    assert tensors_in(nested(10, leaf)) == walked(nested(10, leaf)) == []


def test_tensors_in_a_lone_tensor_is_that_tensor_and_a_value_without_tensors_gives_none():
    leaf = torch.ones(1)
    assert tensors_in(leaf) == [leaf]
    assert tensors_in(None) == tensors_in("x") == tensors_in(()) == tensors_in({}) == []


def test_select_applies_a_tuple_spec_to_one_element_and_names_a_mismatch():
    a, b = torch.ones(1), torch.zeros(2)
    assert select((a, (b, a)), TensorSpec.parse("tuple[2]:1", "test"))[0] == [b, a]
    assert select((a, b), None)[0] == [a, b]
    assert select(a, TensorSpec.parse("tensor", "test"))[0] == [a]
    tensors, problem = select((a,), TensorSpec.parse("tuple[2]:1", "test"))
    assert tensors == [] and "tuple of 1" in problem
