"""The copy a background snapshot serializes is independent of the live training state."""

from __future__ import annotations

import io

import torch

from trainguard.runtime.state import detached_copy, param_hash


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
