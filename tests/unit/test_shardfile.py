"""Shard files hold the state exactly, whatever its tensors, and older torch.save shards still load."""

from __future__ import annotations

import random
from collections import OrderedDict
from pathlib import Path

import pytest
import torch

from trainguard.runtime import shardfile
from trainguard.runtime.state import detached_copy, rng_state


def _state() -> dict[str, object]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.BatchNorm1d(3))
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.randn(5, 4)).sum().backward()
    opt.step()
    return detached_copy({"model": model.state_dict(), "optimizer": opt.state_dict(), "rng": rng_state()})


def test_a_training_state_comes_back_exactly() -> None:
    state = _state()
    back = shardfile.loads(shardfile.dumps(state))
    sd = state["model"]
    assert isinstance(sd, OrderedDict)
    assert type(back["model"]) is type(sd) and list(back["model"]) == list(sd)
    assert back["model"]._metadata == sd._metadata
    for k, v in sd.items():
        assert back["model"][k].dtype == v.dtype and torch.equal(back["model"][k], v), k
    assert back["optimizer"]["param_groups"] == state["optimizer"]["param_groups"]  # type: ignore[index]
    assert back["rng"]["python"] == state["rng"]["python"]  # type: ignore[index]
    random.setstate(back["rng"]["python"])
    torch.set_rng_state(back["rng"]["torch"])
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.BatchNorm1d(3))
    model.load_state_dict(back["model"])


@pytest.mark.parametrize(
    "t",
    [
        torch.tensor(3.5),  # 0-dim
        torch.empty(0, 4),  # no elements
        torch.tensor([True, False, True]),
        torch.arange(12, dtype=torch.bfloat16).reshape(3, 4),
        torch.arange(6, dtype=torch.int64).reshape(2, 3).t(),  # not contiguous
        torch.complex(torch.ones(2), torch.arange(2.0)).conj(),  # a lazy conjugate
        torch.arange(5, dtype=torch.uint8),
    ],
    ids=["scalar", "empty", "bool", "bfloat16", "transposed", "conj", "uint8"],
)
def test_odd_tensors_come_back_equal(t: torch.Tensor) -> None:
    back = shardfile.loads(shardfile.dumps({"t": t}))["t"]
    assert back.dtype == t.dtype and back.shape == t.shape
    assert torch.equal(back, t.resolve_conj())
    before = t.resolve_conj().clone()
    if t.dtype == torch.bool:
        back.logical_not_()  # writable, and its own memory
    else:
        back.add_(1)
    assert torch.equal(t.resolve_conj(), before)


def test_a_torch_save_shard_still_loads(tmp_path: Path) -> None:
    """Shards written before this format (torch.save) restore as they did."""
    state = {"step": 3, "w": torch.arange(4.0)}
    path = tmp_path / "rank-00000.pt"
    torch.save(state, path)
    back = shardfile.load_shard(path)
    assert back["step"] == 3 and torch.equal(back["w"], torch.arange(4.0))


def test_other_tensor_kinds_fall_back_to_their_own_pickling() -> None:
    sparse = torch.eye(3).to_sparse()
    back = shardfile.loads(shardfile.dumps({"s": sparse, "p": torch.nn.Parameter(torch.ones(2))}))
    assert torch.equal(back["s"].to_dense(), torch.eye(3))
    assert torch.equal(back["p"], torch.ones(2))
