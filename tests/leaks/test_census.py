"""Tests for the tensor census: categories, holder paths of planted leaks, diffs, cost."""

from __future__ import annotations

import collections
import dataclasses
import gc
import importlib
import json
import sys
import textwrap
import weakref

import pytest
import torch
from torch import nn

from memcallbacks._base.storage import storage_keys
from memcallbacks.leaks import find_holders, take_census
from memcallbacks.leaks.census import NO_ROOT, NOT_SEARCHED
from memcallbacks.leaks.tensors import graph_tensors, iter_tensors

KiB, MiB = 1024, 1024 * 1024
BUDGET = 30.0  # generous: a shared CI box must not truncate the searches under test

pytestmark = pytest.mark.usefixtures("one_thread")


class Scratch(nn.Module):
    """Keeps its last input on a plain attribute (a classic per-module cache)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.buf = x.detach()
        return x


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.Sequential(nn.Linear(64, 64), Scratch(), nn.BatchNorm1d(64), nn.Linear(64, 8))
        self.cache: list[torch.Tensor] = []
        self.memo: dict[int, torch.Tensor] = {}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers(x)


def _nbytes(tensors) -> int:
    return sum(t.untyped_storage().nbytes() for t in tensors)


def _record(census, path_start: str):
    hits = [r for r in census.records if r.path and r.path.startswith(path_start)]
    assert hits, f"no record with a path starting {path_start!r}: {[r.path for r in census.records if r.path][:20]}"
    return hits


# ----------------------------------------------------------------------------------------------
# Categories
# ----------------------------------------------------------------------------------------------


def test_census_categories_match_model_optimizer_and_batches():
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    prev = {"x": torch.randn(32, 64), "y": torch.randn(32, 8)}
    cur = {"x": torch.randn(32, 64), "y": torch.randn(32, 8)}
    for batch in (prev, cur):
        loss = nn.functional.mse_loss(model(batch["x"]), batch["y"])
        loss.backward()
        opt.step()
    del loss
    census = take_census(
        model=model, optimizer=opt, current_batch=cur, previous_batches=[prev], time_budget_s=BUDGET, step=2
    )
    category = {r.data_ptr: r.category for r in census.records}

    def categories(tensors) -> set[str]:
        return {category[t.untyped_storage().data_ptr()] for t in tensors}

    # other tests may leave models alive in this process: check this model's storages one by one
    params = list(model.parameters())
    assert categories(params) == {"parameters"}
    assert categories(p.grad for p in params) == {"gradients"}
    assert categories(t for s in opt.state.values() for t in s.values()) == {"optimizer state"}
    assert categories(model.buffers()) == {"buffers"}
    assert census.bytes_by_category["parameters"] >= _nbytes(params)
    assert census.bytes_by_category["current batch"] == _nbytes(cur.values())
    assert census.bytes_by_category["previous batches"] == _nbytes(prev.values())
    assert census.tensors_by_category["previous batches"] == 2
    assert census.step == 2 and census.total_bytes == sum(census.bytes_by_category.values())
    # the previous batch is also a local here: the census says where it lives
    prev_records = [r for r in census.records if r.category == "previous batches"]
    assert all(r.path.startswith("test_census_categories_match_model_optimizer_and_batches() local prev[")
               for r in prev_records), [r.path for r in prev_records]
    # Scratch.buf is an activation kept on a submodule attribute
    buf = _record(census, "Net.layers.1.buf")
    assert buf[0].category == "other" and buf[0].holder == "Net.layers.1.buf"
    assert buf[0].shape == "32x64 float32"
    json.dumps(census.to_dict())
    frame = census.to_frame()
    assert {"category", "nbytes", "holder", "path"} <= set(frame.columns)
    assert "parameters" in census.summary()


# ----------------------------------------------------------------------------------------------
# Planted leaks: the holder path names the attribute or variable
# ----------------------------------------------------------------------------------------------


def _train_with(leak, steps: int = 4, **census_kw):
    """A real loop; `leak(step, model, out, loss)` plants the leak; a census is taken at the end."""
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for step in range(steps):
        x, y = torch.randn(16, 64), torch.randn(16, 8)
        out = model(x)
        loss = nn.functional.mse_loss(out, y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        leak(step, model, out, loss)
    del x, y, out, loss
    return take_census(model=model, optimizer=opt, time_budget_s=BUDGET, **census_kw), model


def test_leak_list_on_module_attribute():
    census, model = _train_with(lambda step, model, out, loss: model.cache.append(out.detach() * 1))
    hits = _record(census, "Net.cache[")
    assert len(hits) == 4 and {r.holder for r in hits} == {"Net.cache"}
    assert {r.path for r in hits} == {f"Net.cache[{i}]" for i in range(4)}
    assert all(r.category == "other" and r.shape == "16x8 float32" for r in hits)


def test_leak_dict_cache_keyed_by_step():
    census, _ = _train_with(lambda step, model, out, loss: model.memo.__setitem__(step, out.detach() + 0))
    hits = _record(census, "Net.memo[")
    assert {r.path for r in hits} == {f"Net.memo[{i}]" for i in range(4)}
    assert {r.holder for r in hits} == {"Net.memo"}


def test_leak_module_level_global_list(tmp_path, monkeypatch):
    (tmp_path / "leaky_train.py").write_text(
        textwrap.dedent(
            """
            SEEN = []

            def remember(out):
                SEEN.append(out.detach().clone())
            """
        )
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    leaky = importlib.import_module("leaky_train")
    try:
        census, _ = _train_with(lambda step, model, out, loss: leaky.remember(out))
        hits = _record(census, "module leaky_train: global SEEN[")
        assert {r.path for r in hits} == {f"module leaky_train: global SEEN[{i}]" for i in range(4)}
        assert {r.holder for r in hits} == {"module leaky_train: global SEEN"}
    finally:
        sys.modules.pop("leaky_train", None)


def test_leak_running_sum_without_detach_holds_every_step_through_the_graph():
    """`total = total + loss` keeps each step's graph, and with it each step's embedding leaf."""
    torch.manual_seed(0)
    tower = nn.Sequential(nn.Linear(32, 16), nn.ReLU(), nn.Linear(16, 1))
    opt = torch.optim.SGD(tower.parameters(), lr=0.01)

    def train():
        total = 0.0
        for _ in range(5):
            emb = torch.randn(64, 32).requires_grad_()  # pulled from a parameter server
            loss = tower(emb).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            total = total + loss  # should be loss.item()
        del emb, loss
        return take_census(model=tower, optimizer=opt, time_budget_s=BUDGET)

    census = train()
    hits = [r for r in census.records if r.path and r.path.startswith("train() local total (test_census.py:")]
    leaves = [r for r in hits if r.path.endswith("-> autograd graph -> leaf tensor 64x32 float32")]
    assert len(leaves) == 5, [r.path for r in hits]
    assert all(r.category == "graph-held" and r.via_graph for r in leaves)
    assert {r.holder for r in leaves} == {"train() local total -> autograd graph"}
    grads = [r for r in hits if r.path.endswith("leaf tensor 64x32 float32.grad")]
    assert len(grads) == 5


def test_leak_output_dict_kept_on_self():
    def keep(step, model, out, loss):
        model.last_outputs = {"loss": loss, "logits": out}

    census, _ = _train_with(keep)
    logits = _record(census, "Net.last_outputs['logits']")
    assert logits[0].holder == "Net.last_outputs" and logits[0].shape == "16x8 float32"
    # the kept loss keeps its graph: the BatchNorm input saved for backward is gone after
    # backward, but the Scratch buffer and the graph's tensors are accounted for
    assert census.bytes_by_category["other"] >= 16 * 8 * 4


def test_tensors_in_unreachable_cycles_have_no_root():
    class Node:
        def __init__(self) -> None:
            self.buf = torch.randn(128, 128)
            self.peer = self

    was = gc.isenabled()
    gc.disable()
    try:
        Node()  # garbage: a self-cycle gc has not collected yet
        census = take_census(time_budget_s=BUDGET)
    finally:
        if was:
            gc.enable()
        gc.collect()
    hits = [r for r in census.records if r.shape == "128x128 float32"]
    assert hits and hits[0].holder == NO_ROOT and hits[0].path is None


def test_saved_tensor_path_through_graph_never_backpropagated():
    model = nn.Sequential(nn.Linear(64, 128), nn.Tanh(), nn.Linear(128, 1))
    kept = [model(torch.randn(32, 64)).sum()]  # a metric kept with its graph
    paths = [p.path for p in find_holders(graph_target(kept[0]), time_budget_s=BUDGET).paths]
    assert any(
        p.startswith("test_saved_tensor_path_through_graph_never_backpropagated() local kept[0]")
        and p.endswith("-> autograd graph -> saved tensor 32x128 float32")
        for p in paths
    ), paths


def graph_target(t: torch.Tensor) -> list[torch.Tensor]:
    """The tanh output saved in ``t``'s graph."""
    return [s for s, how in graph_tensors([t]) if how == "saved" and tuple(s.shape) == (32, 128)][:1]


# ----------------------------------------------------------------------------------------------
# Diff, cost, robustness
# ----------------------------------------------------------------------------------------------


def test_census_diff_names_what_grew():
    model = Net()
    before = take_census(model=model, time_budget_s=BUDGET)
    for _ in range(40):
        model.cache.append(torch.zeros(64 * 1024))  # 256 KiB each
    after = take_census(model=model, time_budget_s=BUDGET)
    delta = after.diff(before)
    assert delta[0].holder == "Net.cache" and delta[0].tensors == 40 and delta[0].bytes == 10 * MiB
    assert str(delta[0]) == "Net.cache grew by 40 tensors / 10.0 MiB"
    assert after.top_holders(1)[0] == ("Net.cache", 40, 10 * MiB)


STASH: dict[str, torch.Tensor] = {}


def test_census_diff_ignores_a_storage_reached_through_another_holder():
    """The path search may reach a storage that was there all along through another holder the
    second time (seen with Lightning: a dataset found first through a frame's local, then through
    ``Trainer.fit_loop``); the diff names only what is new."""
    model = Net()
    STASH["data"] = torch.zeros(256 * 1024)  # 1 MiB, found through a module global first
    before = take_census(model=model, time_budget_s=BUDGET)
    model.moved = STASH.pop("data")  # the same storage, now under the model
    for _ in range(4):
        model.cache.append(torch.zeros(64 * 1024))
    after = take_census(model=model, time_budget_s=BUDGET)
    assert any(r.holder == "Net.moved" for r in after.records)  # reached the second way
    delta = after.diff(before)
    assert [(d.holder, d.tensors, d.bytes) for d in delta if d.bytes > 0] == [("Net.cache", 4, MiB)]
    assert not [d for d in delta if d.bytes < 0]  # nor did its first holder shrink


def test_census_diff_counts_a_storage_a_frame_held_first_as_growth():
    """The step's batch, held by a frame's local at the first census and kept by a list at the
    second, is that list's growth (the leak of a loop that keeps its batches)."""
    model = Net()
    batch = torch.zeros(256 * 1024)
    before = take_census(model=model, time_budget_s=BUDGET)
    model.cache.append(batch)
    del batch
    after = take_census(model=model, time_budget_s=BUDGET)
    assert [(d.holder, d.tensors, d.bytes) for d in after.diff(before) if d.bytes > 0] == [("Net.cache", 1, MiB)]


LOADER: list[torch.Tensor] = []


def test_census_diff_ignores_a_fixed_list_of_batches():
    """``for x in monitor.track(loader)`` over a list built before the loop: the first census sees
    ``loader[0]`` as the step's batch (no holder searched), the second reaches it through ``loader``
    and sees ``loader[1]`` as the batch. The list never grew (user check: "global loader grew by 1
    tensor / 256.0 KiB; it keeps 58 tensors"); the list that did grow is the only growth, and a list
    that keeps every batch of a loader that makes new ones still grows by all of them."""
    model = Net()
    LOADER[:] = [torch.zeros(64 * 1024) for _ in range(6)]
    before = take_census(model=model, current_batch=LOADER[0], time_budget_s=BUDGET)
    for x in LOADER[:2]:
        model.cache.append(x * 2)
    after = take_census(model=model, current_batch=LOADER[1], time_budget_s=BUDGET)
    assert any(r.holder and r.holder.endswith("global LOADER") for r in after.records if r.data_ptr == LOADER[0].data_ptr())
    assert [(d.holder, d.tensors) for d in after.diff(before) if d.bytes > 0] == [("Net.cache", 2)]
    batch = torch.zeros(64 * 1024)
    before = take_census(model=model, current_batch=batch, time_budget_s=BUDGET)
    model.cache.append(batch)
    model.cache.append(torch.zeros(64 * 1024))  # the next step's batch, kept too
    del batch
    after = take_census(model=model, current_batch=None, time_budget_s=BUDGET)
    assert [(d.holder, d.tensors) for d in after.diff(before) if d.bytes > 0] == [("Net.cache", 2)]
    LOADER.clear()


def test_census_diff_ignores_a_loop_variable_bound_to_a_dataset_view():
    """``for x in list(data)``: every step binds ``x`` to a view of a storage that was there all
    along (found through the list the first time, through ``x`` the second). It keeps nothing;
    the list that grew in the same loop is the only growth."""
    model = Net()
    data = list(torch.zeros(4, 256 * 1024))  # one 4 MiB storage, four row views
    before = take_census(model=model, time_budget_s=BUDGET)
    for x in data:
        model.cache.append(torch.zeros(64 * 1024))
        if len(model.cache) == 2:
            break
    del data
    after = take_census(model=model, time_budget_s=BUDGET)
    assert any(r.holder and r.holder.endswith(" local x") for r in after.records)  # reached through the loop variable
    assert [(d.holder, d.tensors, d.bytes) for d in after.diff(before) if d.bytes > 0] == [("Net.cache", 2, MiB // 2)]
    assert not [d for d in after.diff(before) if d.bytes < 0]


def test_census_diff_never_counts_the_model_states_that_were_there_before():
    """A census that missed a model (the pytest plugin freezes the heap after warm-up, and
    ``gc.get_objects()`` leaves frozen objects out) and one that saw it: that model's parameters and
    optimizer state were there all along and did not grow (a Transformers Trainer's test under the
    plugin named "parameters grew by 28 tensors" from the previous test's model)."""
    import gc

    torch.manual_seed(0)
    model, earlier = Net(), Net()
    optimizer = torch.optim.Adam(earlier.parameters())
    earlier(torch.randn(2, 64)).sum().backward()
    optimizer.step()
    holder = [earlier, optimizer]
    del earlier, optimizer
    gc.freeze()
    try:
        before = take_census(model=model, time_budget_s=BUDGET)  # the frozen model is not listed
    finally:
        gc.unfreeze()
    model.cache.append(torch.zeros(64 * 1024))
    after = take_census(model=model, time_budget_s=BUDGET)
    assert {r.category for r in after.records} >= {"parameters", "optimizer state"}
    assert [(d.holder, d.tensors) for d in after.diff(before) if d.bytes > 0] == [("Net.cache", 1)]
    del holder


def test_census_reports_cost_and_truncates_at_budget():
    keep = [torch.randn(8) for _ in range(3)]
    census = take_census(time_budget_s=BUDGET)
    assert census.seconds > 0 and not census.truncated
    assert census.objects_scanned >= len(gc.get_objects()) // 2
    quick = take_census(time_budget_s=1e-9)
    assert quick.truncated
    assert any(r.holder == NOT_SEARCHED for r in quick.records)
    no_paths = take_census(find_paths=False, time_budget_s=BUDGET)
    assert all(r.path is None for r in no_paths.records)
    with pytest.raises(ValueError, match="time_budget_s=0"):
        take_census(time_budget_s=0)
    del keep


PINNED_TENSOR = None  # a module global: a root, which even a census out of time looks at


def test_top_holders_put_named_holders_before_the_unsearched_rest():
    """A census out of time still names the holders it reached; the larger unsearched rest comes last."""
    global PINNED_TENSOR
    gc.collect()
    PINNED_TENSOR = torch.zeros(2 * MiB)  # 8 MiB, module global
    held = torch.zeros(1 * MiB)  # 4 MiB, a local of this test
    hidden = [torch.zeros(1 * MiB) for _ in range(16)]  # 64 MiB, one level below the roots: not reached
    try:
        quick = take_census(time_budget_s=1e-9)  # the search stops after the roots themselves
        assert quick.truncated
        top = quick.top_holders(2)
        assert top[:2] == [
            ("module test_census: global PINNED_TENSOR", 1, 8 * MiB),
            ("test_top_holders_put_named_holders_before_the_unsearched_rest() local held", 1, 4 * MiB),
        ]
        assert len(top) == 3 and top[2][0] == NOT_SEARCHED and top[2][1] >= 16 and top[2][2] >= 64 * MiB
        assert [h for h, _, _ in quick.top_holders(50)][-1] == NOT_SEARCHED

        # what grew between two truncated censuses: the named holder first, the unsearched growth after it
        grown = torch.zeros(1 * MiB)
        hidden += [torch.zeros(1 * MiB) for _ in range(16)]
        later = take_census(time_budget_s=1e-9)
        growth = [d for d in later.diff(quick) if d.bytes > 0]
        assert growth[0].holder == "test_top_holders_put_named_holders_before_the_unsearched_rest() local grown"
        assert growth[0].bytes == 4 * MiB
        assert growth[-1].holder == NOT_SEARCHED and growth[-1].bytes >= 64 * MiB

        full = take_census(time_budget_s=BUDGET)  # in time: no unsearched group at all
        assert not full.truncated and NOT_SEARCHED not in [h for h, _, _ in full.top_holders(50)]
    finally:
        PINNED_TENSOR = None
    del held, hidden, grown


def test_census_does_not_keep_frame_locals_alive():
    def step():
        x = torch.randn(1000)
        ref = weakref.ref(x)
        take_census(time_budget_s=BUDGET)
        find_holders([x], time_budget_s=BUDGET)
        del x
        return ref

    assert step()() is None


ODD: list = []


@pytest.mark.filterwarnings("ignore:Sparse CSR tensor support")
def test_census_and_search_survive_odd_tensors():
    ODD[:] = [
        torch.empty(3, device="meta"),
        torch.empty(0),
        torch.randn(4, 4).to_sparse(),
        torch.randn(4, 4).to_sparse_csr(),
        torch.randn(2, 3).t(),  # a view
        torch.tensor(3.0),
        torch.randn(4).view(2, 2)[0],
    ]
    try:
        census = take_census(time_budget_s=BUDGET)
        sparse = [r for r in census.records if r.path and r.path.startswith("module test_census: global ODD[2]")]
        assert sparse  # indices and values storages of the COO tensor
        assert find_holders(ODD, time_budget_s=BUDGET).paths
    finally:
        ODD.clear()
    assert storage_keys(torch.empty(2, device="meta")) == []


def test_iter_tensors_walks_batch_structures():
    @dataclasses.dataclass
    class Batch:
        x: torch.Tensor
        extra: dict

    Pair = collections.namedtuple("Pair", "a b")
    a, b, c, d = (torch.randn(1) for _ in range(4))
    loop: list = [a]
    loop.append(loop)
    batch = {"pair": Pair(a, [b, (c,)]), "dc": Batch(d, {"s": "str", "n": None}), "loop": loop, "mod": nn.Linear(1, 1)}
    found = list(iter_tensors(batch))
    assert sorted(map(id, found)) == sorted(map(id, [a, b, c, d, a]))
    assert list(iter_tensors(None)) == [] and list(iter_tensors(a)) == [a]
