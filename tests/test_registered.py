"""registered.json holds plain data only: 0-d tensors and numpy scalars become the exact numbers they hold,
and state that JSON would refuse or silently change is refused, naming the object and the key."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from musiclm_stab.training import registered


class Holder:
    def __init__(self, state):
        self.state = state

    def state_dict(self):
        return self.state

    def load_state_dict(self, state):
        self.state = state


def test_tensor_and_numpy_scalars_are_stored_as_their_exact_numbers():
    """A float32 0-d tensor, numpy float32/int64/bool scalars and a tuple round-trip through registered.json
    as the same Python values (before: json.dumps raised TypeError on the tensor)."""
    third = torch.tensor(1 / 3, dtype=torch.float32)
    state = {"scale": third, "f": np.float32(0.1), "n": np.int64(7), "b": np.bool_(True), "t": (1, 2.5)}
    loaded = json.loads(registered.to_json([("obj", Holder(state))]))["obj"]
    assert loaded == {"scale": third.item(), "f": float(np.float32(0.1)), "n": 7, "b": True, "t": [1, 2.5]}
    assert torch.tensor(loaded["scale"], dtype=torch.float32) == third  # exact: float32 -> float64 -> float32
    assert type(loaded["n"]) is int and type(loaded["b"]) is bool


@pytest.mark.parametrize(("state", "where", "why"), [
    ({"window": {3: 1.0}}, "['window']", "key 3 (int)"),
    ({"m": torch.zeros(2)}, "['m']", "Tensor of shape (2,)"),
    ({"a": [np.ones((1, 1))]}, "['a'][0]", "ndarray of shape (1, 1)"),
    ({"f": lambda: 0}, "['f']", "is a function"),
])
def test_state_json_would_refuse_or_change_is_refused_naming_it(state, where, why):
    """An int key (JSON would make it a str), a tensor or array of several values, or an object: TypeError
    naming the registered object, its key and the reason (before: the int key was silently turned into
    "3", the others raised json's message naming neither object nor key)."""
    with pytest.raises(TypeError) as e:
        registered.to_json([("guard", Holder(state))])
    assert str(e.value).startswith(f"guard (Holder) state_dict(){where} ") and why in str(e.value), str(e.value)
