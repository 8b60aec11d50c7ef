"""The copy a background snapshot serializes is independent of the live training state."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.unit.single_rank import single_rank_context
from trainguard.runtime import shardfile
from trainguard.runtime.context import Context
from trainguard.runtime.shardfile import load_shard
from trainguard.runtime.state import SnapshotBuffers, detached_copy, param_hash, rng_state
from trainguard.runtime.tracked import TrackedState


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
    back = shardfile.loads(shardfile.dumps(snap))  # what the snapshot thread writes
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


def test_deferred_tensors_are_filled_only_when_asked() -> None:
    model, _ = _trained()
    extra = torch.zeros(3)
    owned = {p.data_ptr() for p in model.parameters()}
    snap, rest = SnapshotBuffers().copy_deferred(
        {"model": model.state_dict(), "extra": extra}, lambda t: t.data_ptr() in owned
    )
    extra += 1  # not deferred: the copy already holds the old value
    assert torch.equal(snap["extra"], torch.zeros(3))
    rest()
    assert torch.equal(snap["model"]["0.weight"], model.state_dict()["0.weight"])


def _context(tmp_path: Path) -> Context:
    return single_rank_context(tmp_path, target_steps=10, ckpt_every=1)


def _fence_watch(ctx: Context, monkeypatch: pytest.MonkeyPatch) -> threading.Event:
    """An event set when training reaches the optimizer-step fence."""
    at_fence = threading.Event()
    fence = ctx._fence

    def fence_reached() -> None:
        at_fence.set()
        fence()

    monkeypatch.setattr(ctx, "_fence", fence_reached)
    return at_fence


def _hold_back_tracked(monkeypatch: pytest.MonkeyPatch, until: threading.Event) -> None:
    """The copier's part of a tracked snapshot waits for ``until``."""
    rest = TrackedState.rest

    def held_back(self: TrackedState, now: dict[str, Any], later: SnapshotBuffers) -> Any:
        complete = rest(self, now, later)

        def late() -> dict[str, Any]:
            assert until.wait(timeout=30), "the copier was never let go"
            return complete()

        return late

    monkeypatch.setattr(TrackedState, "rest", held_back)


def test_the_next_optimizer_step_waits_for_the_snapshot_copy(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The snapshot thread copies parameters and optimizer state while the next step computes;
    here it is held back until training reaches the fence, so a fence that did not wait would
    let the optimizer change them first."""
    ctx = _context(tmp_path)
    model, opt = _trained()  # after the context: its optimizer step is seen
    at_fence = _fence_watch(ctx, monkeypatch)
    deferred = SnapshotBuffers.copy_deferred

    def held_back(self: SnapshotBuffers, state: Any, defer: Any) -> tuple[Any, Any]:
        snap, rest = deferred(self, state, defer)

        def late() -> None:
            assert at_fence.wait(timeout=30), "training never reached the fence"
            rest()

        return snap, late

    monkeypatch.setattr(SnapshotBuffers, "copy_deferred", held_back)
    extra = torch.zeros(2)
    before = param_hash(model)
    state = {"model": model.state_dict(), "optimizer": opt.state_dict(), "extra": extra}
    path = ctx.save_checkpoint(1, state)
    extra += 1  # copied at once, not by the snapshot thread
    model(torch.randn(5, 4)).sum().backward()
    opt.step()
    assert param_hash(model) != before
    ctx.wait_snapshot()
    saved = load_shard(path)
    restored, _ = _trained()
    restored.load_state_dict(saved["model"])
    assert param_hash(restored) == before
    assert torch.equal(saved["extra"], torch.zeros(2))
    assert ctx._fence_wait_s > 0  # charged to the next snapshot's blocking time
    ctx.finish(param_hash(model))


# -- a tracked model and optimizer (Context.track) ------------------------------------------


def _with_buffers() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.BatchNorm1d(3))
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.randn(5, 4)).sum().backward()
    opt.step()
    return model, opt


def _step(model: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
    model(torch.randn(5, 4)).sum().backward()  # train mode: BatchNorm updates its buffers
    opt.step()


def test_a_tracked_snapshot_is_the_state_at_the_hand_over(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The copier takes the state dicts only while the next step computes (held back here
    until training reaches the fence); what the forward, a scheduler and the RNG change in
    the meantime must not reach the snapshot."""
    ctx = _context(tmp_path)
    model, opt = _with_buffers()
    ctx.track(model, opt)
    _hold_back_tracked(monkeypatch, until=_fence_watch(ctx, monkeypatch))
    expected = detached_copy({"model": model.state_dict(), "optimizer": opt.state_dict(), "rng": rng_state()})
    before = param_hash(model)
    path = ctx.maybe_save(1, lambda: {"data_position": torch.tensor([7])})
    assert path is not None
    opt.param_groups[0]["lr"] = 0.5  # a scheduler setting the next step's rate
    torch.rand(3)
    _step(model, opt)
    assert param_hash(model) != before
    ctx.wait_snapshot()
    saved = load_shard(path)
    assert list(saved) == ["step", "model", "optimizer", "rng", "data_position"]
    assert saved["step"] == 1
    assert list(saved["model"]) == list(expected["model"])
    assert saved["model"]._metadata == expected["model"]._metadata
    for key, value in expected["model"].items():
        assert torch.equal(saved["model"][key], value), key
    assert saved["optimizer"]["param_groups"] == expected["optimizer"]["param_groups"]
    for p, st in expected["optimizer"]["state"].items():
        for k, v in st.items():
            assert torch.equal(saved["optimizer"]["state"][p][k], v), (p, k)
    assert saved["rng"]["python"] == expected["rng"]["python"]
    assert torch.equal(saved["rng"]["torch"], expected["rng"]["torch"])
    assert torch.equal(saved["data_position"], torch.tensor([7]))
    restored, restored_opt = _with_buffers()
    restored.load_state_dict(saved["model"])
    restored_opt.load_state_dict(saved["optimizer"])
    assert param_hash(restored) == before
    ctx.finish(param_hash(model))


def test_a_replaced_buffer_is_the_one_saved(tmp_path: Path) -> None:
    """Buffers are looked up by name at each snapshot: one a module replaces is still seen."""
    ctx = _context(tmp_path)
    model, opt = _with_buffers()
    ctx.track(model, opt)
    model[1].running_mean = torch.full((3,), 4.0)
    path = ctx.save_checkpoint(1)
    model[1].running_mean = torch.zeros(3)
    ctx.wait_snapshot()
    assert torch.equal(load_shard(path)["model"]["1.running_mean"], torch.full((3,), 4.0))
    ctx.finish(param_hash(model))


def test_tracked_and_untracked_saves_refuse_what_they_cannot_save(tmp_path: Path) -> None:
    ctx = _context(tmp_path)
    with pytest.raises(ValueError, match="track"):
        ctx.save_checkpoint(1)  # nothing tracked, no state
    model, opt = _with_buffers()
    ctx.track(model, opt)
    with pytest.raises(ValueError, match=r"\['rng'\]"):
        ctx.save_checkpoint(1, {"rng": 1})
    renamed = torch.nn.BatchNorm1d(3)
    renamed._register_state_dict_hook(
        lambda m, sd, prefix, local: type(sd)((k.replace("running", "avg"), v) for k, v in sd.items())
    )
    with pytest.raises(ValueError, match="running_mean"):
        ctx.track(renamed, opt)
    ctx.finish(param_hash(model))


def test_a_shared_module_s_buffers_are_copied_under_every_key(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A submodule used twice has a state-dict key on each path; each is copied at the hand-over
    (the copier is held back until the buffer has changed)."""
    ctx = _context(tmp_path)
    shared = torch.nn.BatchNorm1d(3)
    model = torch.nn.Sequential(shared, shared)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ctx.track(model, opt)
    changed = threading.Event()
    _hold_back_tracked(monkeypatch, until=changed)
    path = ctx.save_checkpoint(1)
    shared.running_mean += 5  # in place, as the next forward would
    changed.set()
    ctx.wait_snapshot()
    saved = load_shard(path)["model"]
    assert torch.equal(saved["0.running_mean"], torch.zeros(3))
    assert torch.equal(saved["1.running_mean"], torch.zeros(3))
    ctx.finish(param_hash(model))
