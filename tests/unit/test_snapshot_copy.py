"""The copy a background snapshot serializes is independent of the live training state."""

from __future__ import annotations

import io

import torch

from trainguard.runtime.state import SnapshotBuffers, detached_copy, param_hash


def _trained() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.LayerNorm(3))
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.randn(5, 4)).sum().backward()
    opt.step()
    return model, opt


def test_later_updates_do_not_reach_the_copy() -> None:
    model, opt = _trained()
    snap = detached_copy({"model": model.state_dict(), "optimizer": opt.state_dict()})
    before = param_hash(model)
    model(torch.randn(5, 4)).sum().backward()
    opt.step()  # in place, on the tensors the state dicts pointed at
    assert param_hash(model) != before
    restored, restored_opt = _trained()
    restored.load_state_dict(snap["model"])
    restored_opt.load_state_dict(snap["optimizer"])
    assert param_hash(restored) == before
    exp_avg = next(iter(snap["optimizer"]["state"].values()))["exp_avg"]
    live = next(iter(opt.state_dict()["state"].values()))["exp_avg"]
    assert exp_avg.data_ptr() != live.data_ptr()


def test_state_dict_metadata_and_types_survive() -> None:
    model, _ = _trained()
    sd = model.state_dict()
    snap = detached_copy({"model": sd, "rng": (1, (2, 3), None), "lr": [0.1]})
    assert type(snap["model"]) is type(sd)
    assert snap["model"]._metadata == sd._metadata
    assert snap["rng"] == (1, (2, 3), None)
    buf = io.BytesIO()
    torch.save(snap, buf)  # what the snapshot thread does with it
    buf.seek(0)
    back = torch.load(buf, weights_only=False)
    assert all(torch.equal(back["model"][k], sd[k]) for k in sd)


def test_buffers_are_reused_and_follow_the_state() -> None:
    model, opt = _trained()
    bufs = SnapshotBuffers()
    first = bufs.copy({"model": model.state_dict(), "optimizer": opt.state_dict()})
    h1 = param_hash(model)
    ptr = first["model"]["0.weight"].data_ptr()
    assert ptr != model.state_dict()["0.weight"].data_ptr()
    model(torch.randn(5, 4)).sum().backward()
    opt.step()
    assert first["model"]["0.weight"].data_ptr() == ptr  # untouched by training
    restored, _ = _trained()
    restored.load_state_dict(first["model"])
    assert param_hash(restored) == h1
    second = bufs.copy({"model": model.state_dict(), "optimizer": opt.state_dict()})
    assert second["model"]["0.weight"].data_ptr() == ptr  # the same buffers, refilled
    restored.load_state_dict(second["model"])
    assert param_hash(restored) == param_hash(model)
    grown = bufs.copy({"model": model.state_dict(), "extra": torch.ones(7)})
    assert torch.equal(grown["extra"], torch.ones(7))  # a new layout gets new buffers
