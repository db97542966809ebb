"""What FSDP wraps / ZeRO-3 gathers (units, layers) in a model, and which torch wrapper it is in."""

from __future__ import annotations

from collections.abc import Sequence

from torch import nn

from memcallbacks.estimate.tables import fail, canonical_strategy

__all__ = ["find_layers"]


def unwrap(model: nn.Module) -> nn.Module:
    inner = getattr(model, "module", None)
    if isinstance(inner, nn.Module) and type(model).__name__ in ("DistributedDataParallel", "DataParallel"):
        return inner
    return model


def _class_matches(module: nn.Module, wanted: Sequence[type | str]) -> bool:
    names = {c.__name__ for c in type(module).__mro__}
    return any((isinstance(w, str) and w in names) or (isinstance(w, type) and isinstance(module, w)) for w in wanted)


def find_layers(
    model: nn.Module,
    *,
    layer_cls: type | str | Sequence[type | str] | None = None,
    layer_names: Sequence[str] | None = None,
) -> list[str]:
    """Names of the modules treated as FSDP units ("layers"), as :func:`estimate` would choose them.

    With ``layer_cls`` (classes or class names) or ``layer_names`` those are used. Otherwise, in
    order: modules that are already ``fully_shard``-ed (FSDP2, the root excluded); classes named by
    the model's ``_no_split_modules`` (what Transformers/Accelerate wrap by default, e.g.
    ``LlamaDecoderLayer``); the children of the ``nn.ModuleList`` holding the most parameters (the
    repeated blocks torchtitan shards one by one); else the direct children that hold parameters.
    Parameters outside every unit form the root unit.
    """
    func = "find_layers"
    model = unwrap(model)
    named = dict(model.named_modules())
    if layer_names is not None:
        missing = [n for n in layer_names if n not in named]
        if missing:
            sample = ", ".join(repr(n) for n in list(named)[1:6])
            raise fail(func, "layer_names", missing, f"are not modules of the model; pass names from model.named_modules() (e.g. {sample}).")
        return list(layer_names)
    if layer_cls is not None:
        wanted = [layer_cls] if isinstance(layer_cls, (type, str)) else list(layer_cls)
        found = [n for n, m in named.items() if n and _class_matches(m, wanted)]
        if not found:
            raise fail(func, "layer_cls", layer_cls, "matches no submodule of the model; pass a class (or class name) the model contains.")
        return found
    # by class name: importing torch.distributed.fsdp costs seconds and this must stay cheap
    sharded = [n for n, m in named.items() if n and is_fsdp2(m)]
    if sharded:
        return sharded
    no_split = getattr(model, "_no_split_modules", None)
    if no_split:
        found = [n for n, m in named.items() if n and type(m).__name__ in set(no_split)]
        if found:
            return found
    lists = [(n, m) for n, m in named.items() if isinstance(m, nn.ModuleList)]
    best: tuple[int, str, nn.ModuleList] | None = None
    for name, mlist in lists:
        size = sum(p.numel() for p in mlist.parameters())
        if size and (best is None or size > best[0]):
            best = (size, name, mlist)
    if best is not None:
        _, name, mlist = best
        return [f"{name}.{child}" for child, m in mlist.named_children() if any(True for _ in m.parameters())]
    return [n for n, m in model.named_children() if any(True for _ in m.parameters())]


def wrap_units(model: nn.Module, names: Sequence[str] | None) -> tuple[list[int], int, dict[int, int]]:
    """Unit sizes, root size and param-id -> unit index. ``names=None``: ZeRO-3's per-module units."""
    unit_of: dict[int, int] = {}
    sizes: list[int] = []
    if names is None:  # DeepSpeed gathers each module's own (recurse=False) parameters
        for module in model.modules():
            own = [p for p in module.parameters(recurse=False) if id(p) not in unit_of]
            if own:
                for p in own:
                    unit_of[id(p)] = len(sizes)
                sizes.append(sum(p.numel() for p in own))
        return sizes, 0, unit_of
    named = dict(model.named_modules())
    # innermost first, so a unit nested inside another keeps its own parameters (as FSDP does)
    for name in sorted(names, key=lambda n: -n.count(".") if n else 0):
        index = len(sizes)
        size = 0
        for p in named[name].parameters():
            if id(p) not in unit_of:
                unit_of[id(p)] = index
                size += p.numel()
        sizes.append(size)
    root = sum(p.numel() for p in model.parameters() if id(p) not in unit_of)
    return sizes, root, unit_of



# ----------------------------------------------------------------------------------------------
# strategy detection


def detect_strategy(model: nn.Module) -> str:
    """The strategy of torch's wrapper around ``model``: DDP wraps the model, FSDP1/FSDP2 wrap submodules."""
    if type(model).__name__ == "DistributedDataParallel":
        return canonical_strategy("DistributedDataParallel")
    for module in model.modules():
        if type(module).__name__ == "FullyShardedDataParallel":
            return canonical_strategy("FullyShardedDataParallel")
        if is_fsdp2(module):
            return canonical_strategy("FSDPModule")
    return "single"


def is_fsdp2(module: nn.Module) -> bool:
    return any(c.__name__ == "FSDPModule" for c in type(module).__mro__)
