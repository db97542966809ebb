"""``MemoryMonitorCallback`` in real ``transformers.Trainer`` runs: a tiny GPT-2 built from a config (no download),
TensorBoard event files written by the Trainer's own ``report_to`` integration read back from disk."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pandas as pd
import pytest
import torch

from helpers import GIB, MIB, free_port, leave_rank, set_rank_environment, tensorboard_scalars, touch_temporary, run_ranks

transformers = pytest.importorskip("transformers")
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments  # noqa: E402

from memcallbacks._base.columns import frame_column
from memcallbacks.transformers import MemoryMonitorCallback  # noqa: E402

KEYS = {"memory/peak_forward_GiB", "memory/peak_backward_GiB", "memory/peak_optimizer_GiB", "memory/peak_step_GiB", "memory/allocated_GiB"}

pytestmark = pytest.mark.usefixtures("fresh_accelerate_state")  # the Trainer builds an Accelerator


class TokenData(torch.utils.data.Dataset):
    def __init__(self, n: int = 64, length: int = 16) -> None:
        self.ids = torch.randint(0, 128, (n, length), generator=torch.Generator().manual_seed(0))

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def tiny_gpt2() -> GPT2LMHeadModel:
    torch.manual_seed(0)
    config = GPT2Config(n_layer=2, n_embd=64, n_head=2, vocab_size=128, n_positions=32, bos_token_id=0, eos_token_id=0)
    return GPT2LMHeadModel(config)


def training_args(tmp_path: Path, **overrides: Any) -> TrainingArguments:
    kwargs: dict[str, Any] = dict(
        output_dir=str(tmp_path / "out"),
        use_cpu=True,
        report_to=["tensorboard"],
        logging_steps=2,
        max_steps=6,
        per_device_train_batch_size=4,
        gradient_accumulation_steps=2,
        save_strategy="no",
        disable_tqdm=True,
        dataloader_num_workers=0,
        learning_rate=1e-3,
    )
    kwargs.update(overrides)
    return TrainingArguments(**kwargs)


def test_trainer_tensorboard_gets_memory_metrics_with_accumulation(tmp_path: Path) -> None:
    monitor = MemoryMonitorCallback(log_keys="all", sample_every_n_steps=1, plot=False)
    trainer = Trainer(model=tiny_gpt2(), args=training_args(tmp_path), train_dataset=TokenData(), callbacks=[monitor])
    # at the front: after the Trainer's flow control (it decides a step evaluates), ahead of the report_to integrations
    assert [type(c).__name__ for c in trainer.callback_handler.callbacks[:3]] == ["DefaultFlowCallback", "MemoryMonitorCallback",
                                                                                "TensorBoardCallback"]
    trainer.train()

    # one row per optimizer step, each of gradient_accumulation_steps micro-batches
    history = pd.read_csv(tmp_path / "out" / "memcallbacks" / "history.csv").rename(columns=frame_column)
    assert list(history["step"]) == [0, 1, 2, 3, 4, 5]
    assert (history["micro_batches"] == 2).all()
    assert (history["optimizer_steps"] == 1).all()
    assert list(history["batch_idx"]) == [0, 2, 4, 6, 8, 10]
    assert history[["peak_forward", "peak_backward", "peak_optimizer"]].notna().all().all()

    # the Trainer's TensorBoardCallback wrote them (it prefixes training keys with train/)
    scalars = tensorboard_scalars(tmp_path / "out")
    by_step = history.set_index("step")
    for key in KEYS:
        points = scalars[f"train/{key}"]
        assert [s for s, _ in points] == [2, 4, 6] == [s for s, _ in scalars["train/loss"]]
    for global_step, value in scalars["train/memory/peak_step_GiB"]:
        assert value == pytest.approx(by_step.loc[global_step - 1, "peak_allocated"] / GIB, rel=1e-6)
    for global_step, value in scalars["train/memory/peak_forward_GiB"]:
        assert value == pytest.approx(by_step.loc[global_step - 1, "peak_forward"] / GIB, rel=1e-6)

    # and the Trainer's own log history holds them next to the loss
    logged = [h for h in trainer.state.log_history if "loss" in h]
    assert [h["step"] for h in logged] == [2, 4, 6]
    assert all(KEYS <= set(h) for h in logged)
    report = json.loads((tmp_path / "out" / "memcallbacks" / "report.json").read_text())
    assert report["framework"] == "transformers" and report["summary"]["steps_recorded"] == 6


@pytest.mark.parametrize("strategy", ["steps", "epoch"])
def test_the_trainers_evaluations_are_rows_of_their_own_logged_with_the_eval_metrics(tmp_path: Path, strategy: str) -> None:
    """The Trainer has no "evaluation starts" event: the step (or epoch) end whose control says it evaluates next
    begins the row, the evaluation's own log closes it, and its memory keys join that log (TensorBoard: eval/...)."""
    args = training_args(tmp_path, eval_strategy=strategy, eval_steps=3, max_steps=6, gradient_accumulation_steps=1,
                         per_device_eval_batch_size=4, num_train_epochs=2)
    data = TokenData(24)  # 6 steps of 4: one epoch, or two with max_steps=6 over 12 samples
    train = TokenData(12) if strategy == "epoch" else data
    trainer = Trainer(model=tiny_gpt2(), args=args, train_dataset=train, eval_dataset=TokenData(8),
                      callbacks=[MemoryMonitorCallback(plot=False)])
    trainer.train()
    folder = tmp_path / "out" / "memcallbacks"
    evals = pd.read_csv(folder / "eval_history.csv")
    assert list(evals["stage"]) == ["validate", "validate"] and list(evals["step"]) == [3, 6], evals
    assert (evals["batches"] == 2).all(), evals  # 8 samples in batches of 4, each counted at the model's forward
    assert (evals["peak_allocated_bytes"] >= evals["allocated_bytes"]).all()
    evaluated = [h for h in trainer.state.log_history if "eval_loss" in h]
    assert [h["step"] for h in evaluated] == [3, 6]
    for record, (_, row) in zip(evaluated, evals.iterrows()):
        assert record["memory/val/peak_step_GiB"] == pytest.approx(row["peak_allocated_bytes"] / GIB, rel=1e-6)
    scalars = tensorboard_scalars(tmp_path / "out")
    assert [s for s, _ in scalars["train/memory/val/peak_step_GiB"]] == [3, 6]
    report = json.loads((folder / "report.json").read_text())
    assert report["summary"]["eval"]["validate"]["runs"] == 2
    assert report["summary"]["steps_recorded"] == 6  # the evaluations never entered training rows


def test_each_of_a_dict_of_eval_datasets_is_a_whole_row(tmp_path: Path) -> None:
    """``eval_dataset={"a": ..., "b": ...}``: the Trainer evaluates them one after the other, with no event
    before the second one's first batch. Each is a row of its own with every batch counted, its keys join
    its own log record, and the row begun in case a third followed leaves nothing behind."""
    args = training_args(tmp_path, eval_strategy="steps", eval_steps=3, max_steps=6, gradient_accumulation_steps=1,
                         per_device_eval_batch_size=4)
    trainer = Trainer(model=tiny_gpt2(), args=args, train_dataset=TokenData(24),
                      eval_dataset={"a": TokenData(8), "b": TokenData(12)}, callbacks=[MemoryMonitorCallback(plot=False)])
    trainer.train()
    folder = tmp_path / "out" / "memcallbacks"
    evals = pd.read_csv(folder / "eval_history.csv")
    assert list(evals["step"]) == [3, 3, 6, 6], evals
    assert list(evals["batches"]) == [2, 3, 2, 3], evals  # b's first batch too (12 samples in batches of 4)
    for name in ("a", "b"):
        records = [h for h in trainer.state.log_history if f"eval_{name}_loss" in h]
        assert [h["step"] for h in records] == [3, 6]
        assert all(h["memory/val/peak_step_GiB"] > 0 for h in records), records
    report = json.loads((folder / "report.json").read_text())
    assert report["summary"]["eval"]["validate"]["runs"] == 4
    assert report["summary"]["steps_recorded"] == 6


def test_log_every_n_steps_makes_the_trainer_log_those_steps(tmp_path: Path) -> None:
    monitor = MemoryMonitorCallback(log_keys="all", log_every_n_steps=2, write_files=False)
    args = training_args(tmp_path, logging_steps=3, gradient_accumulation_steps=1, max_steps=4)
    trainer = Trainer(model=tiny_gpt2(), args=args, train_dataset=TokenData(), callbacks=[monitor])
    trainer.train()
    scalars = tensorboard_scalars(tmp_path / "out")
    assert [s for s, _ in scalars["train/memory/peak_step_GiB"]] == [2, 4]
    assert [s for s, _ in scalars["train/loss"]] == [2, 3, 4]  # the Trainer's own steps are kept
    assert {1, 3} <= set(monitor.history["step"])  # logged steps are sampled (at defaults the first steps too: they measure the cost)


class Recorder(TrainerCallback):
    """Keeps every ``logs`` dict it sees, as an integration callback would."""

    def __init__(self) -> None:
        self.logs: list[dict[str, Any]] = []

    def on_log(self, args: Any, state: Any, control: Any, logs: dict[str, Any] | None = None, **kwargs: Any) -> None:
        self.logs.append(dict(logs or {}))


def test_added_after_init_still_reaches_earlier_callbacks(tmp_path: Path) -> None:
    recorder = Recorder()
    args = training_args(tmp_path, report_to=[], gradient_accumulation_steps=1, max_steps=2, logging_steps=1)
    trainer = Trainer(model=tiny_gpt2(), args=args, train_dataset=TokenData(), callbacks=[recorder])
    monitor = MemoryMonitorCallback(log_keys="all", write_files=False)
    trainer.add_callback(monitor)  # after the recorder; moved to the front when training begins
    trainer.train()
    assert trainer.callback_handler.callbacks[1] is monitor  # after the Trainer's DefaultFlowCallback, before the recorder
    steps = [r for r in recorder.logs if "loss" in r]
    assert len(steps) == 2 and all("memory/peak_step_GiB" in r for r in steps)
    assert monitor.max_allocated > 0


def test_hooks_removed_after_training_and_repeated_train(tmp_path: Path) -> None:
    monitor = MemoryMonitorCallback(write_files=False)
    model = tiny_gpt2()
    args = training_args(tmp_path, report_to=[], gradient_accumulation_steps=1, max_steps=2, logging_steps=1)
    trainer = Trainer(model=model, args=args, train_dataset=TokenData(), callbacks=[monitor])
    trainer.train()
    assert not model._forward_pre_hooks and not model._forward_hooks
    first = monitor.monitor
    trainer.train()
    assert monitor.monitor is not first and len(monitor.history) == 2
    monitor.close()
    monitor.close()


def test_oom_recorded_by_record_exception(tmp_path: Path) -> None:
    class OomAtStep(TrainerCallback):
        def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            if state.global_step == 1:
                raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 4.00 GiB (simulated)")

    monitor = MemoryMonitorCallback(plot=False, output_dir=str(tmp_path / "mem"))
    model = tiny_gpt2()
    args = training_args(tmp_path, report_to=[], gradient_accumulation_steps=1, max_steps=3)
    trainer = Trainer(model=model, args=args, train_dataset=TokenData(), callbacks=[OomAtStep(), monitor])
    with pytest.raises(torch.OutOfMemoryError):
        try:
            trainer.train()
        except torch.OutOfMemoryError as exc:
            monitor.record_exception(exc)
            raise
    report = json.loads((tmp_path / "mem" / "report.json").read_text())
    assert [(e["kind"], e["step"]) for e in report["events"]] == [("oom", 1)]
    assert not model._forward_hooks


def test_arguments() -> None:
    with pytest.raises(TypeError, match=r"MemoryMonitorCallback\(\) got unexpected keyword argument"):
        MemoryMonitorCallback(log_every=3)
    with pytest.raises(ValueError, match="MonitorConfig.sample_every_n_steps=0"):
        MemoryMonitorCallback(sample_every_n_steps=0)
    idle = MemoryMonitorCallback()
    assert idle.history.empty and idle.files == {} and "no training" in idle.format_report()
    idle.close()


# ---------------------------------------------------------------------- two processes
RANK_TEMP_MIB = 96


def _rank_main(rank: int, world_size: int, port: int, out: str) -> None:
    """One rank of a 2-process Trainer run (DDP over gloo); rank 1's forward allocates a large temporary."""
    set_rank_environment(rank, world_size, port)
    model = tiny_gpt2()
    if rank == 1:
        def temporary(module: Any, args: Any) -> None:  # returns None: the hook leaves the inputs alone
            touch_temporary(RANK_TEMP_MIB)

        model.register_forward_pre_hook(temporary)
    monitor = MemoryMonitorCallback(log_keys="all", sample_every_n_steps=1, plot=False, advanced={"cpu_mmap_threshold": 1 << 20})
    args = training_args(Path(out), gradient_accumulation_steps=1, max_steps=3, logging_steps=1)
    trainer = Trainer(model=model, args=args, train_dataset=TokenData(), callbacks=[monitor])
    assert trainer.args.world_size == world_size
    trainer.train()
    leave_rank()  # before the DDP model is freed: see helpers.leave_rank


@pytest.mark.slow
def test_two_processes_log_max_over_ranks(tmp_path: Path) -> None:
    import torch._dynamo  # noqa: F401  - imported by every optimizer's __init__; forked ranks inherit it

    # fork: the ranks inherit the imports; they run single-threaded
    run_ranks(_rank_main, (2, free_port(), str(tmp_path)))

    mem = tmp_path / "out" / "memcallbacks"
    ranks = [pd.read_csv(mem / f"history.rank{r}.csv").rename(columns=frame_column).set_index("step") for r in (0, 1)]
    assert [list(h.index) for h in ranks] == [[0, 1, 2], [0, 1, 2]]
    scalars = tensorboard_scalars(tmp_path / "out")  # rank zero's TensorBoardCallback
    points = scalars["train/memory/peak_step_GiB"]
    assert [s for s, _ in points] == [1, 2, 3]
    for global_step, value in points:
        per_rank = [h.loc[global_step - 1, "peak_allocated"] for h in ranks]
        assert value == pytest.approx(max(per_rank) / GIB, rel=1e-6)
        assert (per_rank[1] - per_rank[0]) / MIB >= 0.5 * RANK_TEMP_MIB
    assert {v for _, v in scalars["train/memory/peak_step_rank"]} == {1.0}
    combined = json.loads((mem / "report.json").read_text())
    assert [r["rank"] for r in combined["ranks"]] == [0, 1]
