"""Needle 2 LoRA in PEFT on the torch twin: the LoraConfig upstream's targets need, and adapters on live models.

Files go through convert.v2.lora (`write_peft` / `read_peft`, framework-free); this module is for a
model in memory. peft is imported only when a function here runs (it is an optional dependency).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from convert.errors import CheckpointError
from convert.trees import as_numpy
from convert.v2.lora import LORA_TARGETS, Adapter, from_peft_state, peft_config, peft_tensors, target_modules


def lora_config(rank: int = 16, alpha: float = 32.0, targets: tuple[str, ...] = LORA_TARGETS, dropout: float = 0.0):
    """A peft.LoraConfig for training an adapter upstream can merge: plain LoRA on the main stack's attention
    projections only (`target_modules` is a regex, so mtp_block's projections stay untouched). Upstream's
    defaults are rank 16, alpha 32 (scale 2)."""
    import peft

    return peft.LoraConfig(r=rank, lora_alpha=alpha, target_modules=target_modules(targets), lora_dropout=dropout,
                           bias="none")


def lora_modules(model: nn.Module) -> list[str]:
    """Names of the modules carrying a LoRA adapter (PEFT's LoraLayer) in a PeftModel or a model it wrapped."""
    from peft.tuners.lora import LoraLayer

    return [name for name, module in model.named_modules() if isinstance(module, LoraLayer)]


def peft_model(model: nn.Module, adapter: Adapter):
    """`model` (a needle_torch.v2 SimpleAttentionNetwork) wrapped in a PeftModel carrying `adapter`, in eval mode;
    the same as write_peft + PeftModel.from_pretrained, without the files."""
    import peft

    # no base_model_name_or_path: get_peft_model records the model's own (none) and warns if they differ
    cfg = {k: v for k, v in peft_config(adapter).items() if k not in ("peft_type", "base_model_name_or_path")}
    wrapped = peft.get_peft_model(model, peft.LoraConfig(**cfg))
    state = {k: torch.from_numpy(v.copy()) for k, v in peft_tensors(adapter).items()}
    result = peft.set_peft_model_state_dict(wrapped, state)
    if result.unexpected_keys:
        raise CheckpointError(f"PEFT found no module for {result.unexpected_keys[:3]}; the model is not a "
                              "needle_torch.v2 model of the adapter's shape")
    return wrapped.eval()


def adapter_of(model: Any, base: str | None = None, *, allow_untrained: bool = False) -> Adapter:
    """The upstream adapter a PeftModel (on a needle_torch.v2 model) carries, as `read_peft` reads its files."""
    import peft

    config = model.peft_config[model.active_adapter].to_dict()
    state = peft.get_peft_model_state_dict(model)
    tensors = {k: as_numpy(v) for k, v in state.items()}
    adapter = from_peft_state(tensors, config, "PeftModel", allow_untrained=allow_untrained)
    return adapter if base is None else Adapter(adapter.lora, adapter.scale, adapter.rank, base)


__all__ = ["adapter_of", "lora_config", "lora_modules", "peft_model"]
