"""memcallbacks.preflight: predictions against the real step's exact CPU allocations, and its guarantees."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from memcallbacks.estimate import estimate
from memcallbacks.preflight import PreflightError, max_batch_size, measure_step, predict
from memcallbacks.preflight.allocator import cublas_workspace_bytes, reserved_bytes, round_cuda
from preflight_zoo import CASES

TOLERANCE = 0.05


@pytest.mark.parametrize("key", list(CASES))
def test_prediction_within_5_percent_of_the_real_step(key: str, one_thread: None) -> None:
    torch.manual_seed(0)
    case = CASES[key](1)
    p = predict(case.model, case.batch, case.optimizer, forward_fn=case.forward_fn, precision=case.precision)
    measured = measure_step(case.model, case.batch, case.optimizer, case.forward_fn, autocast_dtype=case.autocast_dtype)
    for phase, peak in p.phase_peaks().items():
        assert abs(peak / measured[phase] - 1) <= TOLERANCE, (phase, peak, measured)
    assert p.peak_bytes == max(p.phase_peaks().values())
    # every phase counts what is always alive: params and optimizer state
    for cats in p.breakdown.values():
        assert cats["params"] > 0 and cats["optimizer_state"] > 0
    assert p.top_modules and p.activation_bytes >= p.top_modules[0][1] > 0


def test_predict_leaves_model_optimizer_batch_and_rng_unchanged() -> None:
    torch.manual_seed(0)
    case = CASES["encoder"](1)  # dropout: the fake step draws random masks
    loss = case.forward_fn(case.model, case.batch)
    loss.backward()
    case.optimizer.step()  # optimizer state present; grads left in place
    params = copy.deepcopy(case.model.state_dict())
    grads = {n: p.grad.clone() for n, p in case.model.named_parameters()}
    opt_state = copy.deepcopy(case.optimizer.state_dict())
    batch = case.batch.clone()
    rng = torch.get_rng_state()
    predict(case.model, case.batch, case.optimizer, forward_fn=case.forward_fn)
    assert torch.equal(torch.get_rng_state(), rng)
    assert torch.equal(case.batch, batch)
    for name, value in case.model.state_dict().items():
        assert torch.equal(value, params[name]), name
    for name, p in case.model.named_parameters():
        assert torch.equal(p.grad, grads[name]), name
    after = case.optimizer.state_dict()
    for key, state in opt_state["state"].items():
        for k, v in state.items():
            assert torch.equal(after["state"][key][k], v)
    assert case.model.training and not any(isinstance(p, torch._subclasses.FakeTensor) for p in case.model.parameters())


def test_tensors_a_module_keeps_in_containers_are_faked_not_copied() -> None:
    # a leak's list of kept outputs (and a dict cache) on the model: the fake copy must copy none of their data
    # (at an OOM, copying the leak for real is what ran out of memory a second time), and leave them unchanged
    class Keeper(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(64, 64)
            self.kept = [torch.ones(1 << 20) for _ in range(8)]  # 32 MiB of real tensors
            self.cache = {"a": (torch.ones(1 << 20),)}

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            out = self.fc(x)
            self.kept.append(out)  # the replay appends to the copy's list, not this one
            return out.sum()

    model = Keeper()
    kept = list(model.kept)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as prof:
        pred = predict(model, torch.randn(4, 64), forward_fn=lambda m, b: m(b))
    copied = sum(e.cpu_memory_usage for e in prof.events() if e.cpu_memory_usage > 0)
    assert copied < 1 << 20, copied  # nothing near a kept tensor's 4 MiB was allocated for real
    assert model.kept == kept and len(model.kept) == 8 and pred.peak_bytes > 0


def test_meta_model_predicts_like_the_real_one() -> None:
    torch.manual_seed(0)
    real = CASES["gpt2"](1)
    with torch.device("meta"):  # built on meta, as a model too big for RAM would be (weights tied as usual)
        meta = type(real.model)(real.model.config)
    meta_batch = {k: torch.empty_like(v, device="meta") for k, v in real.batch.items()}
    a = predict(real.model, real.batch, "adamw")
    b = predict(meta, meta_batch, "adamw")
    assert a.phase_peaks() == b.phase_peaks() and a.start_bytes == b.start_bytes


def test_first_step_has_no_optimizer_state_until_the_step() -> None:
    case = CASES["mlp"](1)
    p = predict(case.model, case.batch, case.optimizer, forward_fn=case.forward_fn)
    first = p.first_step
    assert first is not None
    state = p.breakdown["forward"]["optimizer_state"]
    params = list(case.model.parameters())
    assert state == 2 * sum(q.numel() * 4 for q in params) + 4 * len(params)  # AdamW: exp_avg, exp_avg_sq, step
    assert first.breakdown["forward"]["optimizer_state"] == 0
    assert p.start_bytes - first.start_bytes == state
    text = str(p)
    assert "backward" in text and "top modules" in text and "first step" in text
    d = p.to_dict()
    assert d["peak_bytes"] == p.peak_bytes and d["first_step"]["peak_bytes"] == first.peak_bytes


def test_errors_name_the_op() -> None:
    class ItemNet(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(4, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            y = self.lin(x)
            return y * 2 if y.sum().item() > 0 else y

    class NonzeroNet(ItemNet):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.lin(x)[x.nonzero(as_tuple=True)]

    with pytest.raises(PreflightError, match=r"_local_scalar_dense.*\.item\(\)") as info:
        predict(ItemNet(), torch.randn(2, 4), "sgd")
    assert "forward" in str(info.value) and info.value.op
    with pytest.raises(PreflightError, match="nonzero"):
        predict(NonzeroNet(), torch.randn(2, 4), "sgd")
    with pytest.raises(ValueError, match="precision"):
        predict(ItemNet(), torch.randn(2, 4), precision="fp8")
    with pytest.raises(ValueError, match="forward_fn"):
        predict(ItemNet(), object())


def test_bf16_true_halves_the_model_states() -> None:
    case = CASES["mlp"](1)
    fp32 = predict(case.model, case.batch, "adamw", forward_fn=case.forward_fn)
    bf16 = predict(case.model, case.batch, "adamw", forward_fn=case.forward_fn, precision="bf16-true")
    assert bf16.breakdown["forward"]["params"] * 2 == fp32.breakdown["forward"]["params"]


def test_sharded_model_states_agree_with_estimate() -> None:
    case = CASES["mlp"](2)
    for strategy in ("ddp", "fsdp2"):
        p = predict(case.model, case.batch, case.optimizer, forward_fn=case.forward_fn, strategy=strategy, world_size=2)
        est = estimate(case.model, optimizer=case.optimizer, strategy=strategy, world_size=2)
        assert p.breakdown["backward"]["model_states"] == est.device_backward_peak
        assert p.world_size == 2 and p.strategy == strategy
    single = predict(case.model, case.batch, case.optimizer, forward_fn=case.forward_fn)
    sharded = predict(case.model, case.batch, case.optimizer, forward_fn=case.forward_fn, strategy="fsdp2", world_size=2)
    assert sharded.peak_bytes < single.peak_bytes
    # single device: the fake model states are the estimate's
    est = estimate(case.model, optimizer=case.optimizer)
    cats = single.breakdown["forward"]
    assert cats["params"] == est.device_params and cats["optimizer_state"] == est.device_optimizer + est.host_optimizer


def test_cuda_target_rounds_blocks_and_adds_the_workspace() -> None:
    assert [round_cuda(n) for n in (0, 1, 512, 513)] == [0, 512, 512, 1024]
    assert cublas_workspace_bytes(config=":4096:8") == 32 << 20
    # one 3 MiB block: a 20 MiB segment; one 100 KiB block: a 2 MiB one; reuse after free adds nothing
    assert reserved_bytes([(0, 1), (1, 1), (0, -1), (0, 1)], [3 << 20, 100 << 10]) == (20 << 20) + (2 << 20)
    case = CASES["mlp"](1)
    cpu = predict(case.model, case.batch, "adamw", forward_fn=case.forward_fn, device="cpu")
    cuda = predict(case.model, case.batch, "adamw", forward_fn=case.forward_fn, device="cuda")
    # steady step: the forward thread's workspace and the autograd device thread's (docs/preflight.md)
    assert cuda.device == "cuda" and cuda.breakdown["forward"]["workspace"] == 2 * cublas_workspace_bytes()
    assert cuda.first_step.breakdown["forward"]["workspace"] == cublas_workspace_bytes()
    for phase, peak in cpu.phase_peaks().items():
        assert cuda.phase_peaks()[phase] >= peak + cublas_workspace_bytes()


def test_max_batch_size_finds_the_largest_fitting_batch() -> None:
    model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 10))

    def make_batch(n: int) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.empty(n, 64, device="meta"), torch.empty(n, dtype=torch.long, device="meta")

    def peak(n: int) -> int:
        return predict(model, make_batch(n), "adamw", loss_fn=F.cross_entropy).peak_bytes

    capacity = peak(37) + 1
    fit = max_batch_size(model, make_batch, capacity, "adamw", loss_fn=F.cross_entropy)
    assert fit.batch_size >= 37 and fit.peak_bytes <= capacity < peak(fit.batch_size + 1)
    assert str(fit).startswith(f"batch size {fit.batch_size} fits")
    none = max_batch_size(model, make_batch, 1000, "adamw", loss_fn=F.cross_entropy)
    assert none.batch_size == 0 and none.peak_bytes > 1000
    # a second search over sizes the first predicted makes no prediction again (the OOM explanation's)
    made: list[int] = []
    again = max_batch_size(model, lambda n: made.append(n) or make_batch(n), capacity, "adamw", known=fit.predictions,
                           loss_fn=F.cross_entropy)
    assert (again.batch_size, again.tried) == (fit.batch_size, fit.tried) and made == []
    with pytest.raises(ValueError, match="capacity_bytes"):
        max_batch_size(model, make_batch, 0)
