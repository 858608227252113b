"""An exponential moving average of the trainable weights that lives where the weights live.

DanceGRPO gathered the full fp32 model to rank 0's host memory for every EMA update (about 95 GB of host
RAM for FLUX.1-dev). Here each rank keeps the EMA of its own parameter shards only: for an FSDP2
(``fully_shard``) model the EMA tensors are DTensors with the parameters' placements, updated locally with
no communication. Only ``full_state_dict`` (export) gathers, one tensor at a time, to rank 0.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import distribute_tensor

from fluxgrpo.errors import FluxgrpoError
from fluxgrpo.runtime.dist import reshard_sharded_modules

# Wrappers that insert a path segment into parameter names; EMA keys use the unwrapped (diffusers) names.
_WRAPPER_SEGMENTS = ("_checkpoint_wrapped_module.", "_fsdp_wrapped_module.", "_orig_mod.")


def _canonical_name(name: str) -> str:
    for segment in _WRAPPER_SEGMENTS:
        name = name.replace(segment, "")
    return name


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """The rank-local data of a DTensor (a view: writing to it writes the DTensor), or the tensor itself."""
    to_local = getattr(tensor, "to_local", None)
    return to_local() if callable(to_local) else tensor


def _trainable_parameters(model: nn.Module) -> dict[str, nn.Parameter]:
    reshard_sharded_modules(model)
    return {_canonical_name(name): parameter for name, parameter in model.named_parameters() if parameter.requires_grad}


class ShardedEMA:
    """EMA ← decay·EMA + (1−decay)·θ for every trainable parameter, kept in fp32 beside each local shard.

    Works on plain modules and FSDP2 modules alike. ``update``, ``state_dict`` and ``swap_into`` are local
    (no collectives); ``full_state_dict`` is a collective under FSDP2.
    """

    def __init__(self, model: nn.Module, decay: float) -> None:
        if not 0 <= decay < 1:
            raise ValueError(f"EMA decay must be in [0, 1), got {decay}")
        self.decay = float(decay)
        with torch.no_grad():
            self._shadow: dict[str, torch.Tensor] = {
                name: parameter.detach().to(torch.float32, copy=True)
                for name, parameter in _trainable_parameters(model).items()
            }

    def _matched(self, model: nn.Module) -> list[tuple[torch.Tensor, nn.Parameter]]:
        parameters = _trainable_parameters(model)
        if parameters.keys() != self._shadow.keys():
            missing = sorted(self._shadow.keys() - parameters.keys())[:3]
            extra = sorted(parameters.keys() - self._shadow.keys())[:3]
            raise FluxgrpoError(
                f"the model's trainable parameters no longer match the EMA's (missing {missing}, new {extra}): "
                "build the EMA from the model being trained"
            )
        return [(self._shadow[name], parameter) for name, parameter in parameters.items()]

    @torch.no_grad()
    def update(self, model: nn.Module) -> None:
        """One EMA step towards the model's current weights (call after each optimizer step)."""
        pairs = self._matched(model)
        shadows = [_local(shadow) for shadow, _ in pairs]
        weights = [_local(parameter).to(torch.float32) for _, parameter in pairs]
        torch._foreach_lerp_(shadows, weights, 1.0 - self.decay)

    def state_dict(self) -> dict[str, torch.Tensor]:
        """Parameter name → EMA tensor (DTensor under FSDP2): the live tensors, ready for DCP."""
        return dict(self._shadow)

    @torch.no_grad()
    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Copy saved EMA values in place. Accepts sharded (DTensor) values (local) or full plain tensors, which
        are distributed to the EMA's placements (a collective under FSDP2)."""
        if state.keys() != self._shadow.keys():
            missing = sorted(self._shadow.keys() - state.keys())[:3]
            extra = sorted(state.keys() - self._shadow.keys())[:3]
            raise FluxgrpoError(
                f"the EMA state does not match the model (missing {missing}, unexpected {extra}): resume with the "
                "model configuration the checkpoint was trained with"
            )
        for name, shadow in self._shadow.items():
            value = state[name]
            placements = getattr(shadow, "placements", None)
            if placements is not None and getattr(value, "placements", None) is None:
                value = distribute_tensor(value.to(shadow.device), shadow.device_mesh, placements)  # type: ignore[attr-defined]  # the shadow is a DTensor when placements are set
            _local(shadow).copy_(_local(value))

    def full_state_dict(self, rank0_only: bool = True) -> dict[str, torch.Tensor]:
        """Parameter name → full fp32 CPU tensor, for export.

        Under FSDP2 this is a collective (call it on every rank). Tensors are gathered one at a time and, with
        ``rank0_only``, kept on rank 0 only (other ranks get ``{}``): a full copy per rank would cost
        ranks × 47.6 GB of host memory for FLUX.1-dev on one node.
        """

        keep = not rank0_only or not dist.is_initialized() or dist.get_rank() == 0
        out = {}
        for name, shadow in self._shadow.items():
            full_tensor = getattr(shadow, "full_tensor", None)
            full = full_tensor() if callable(full_tensor) else shadow
            if keep:
                out[name] = full.detach().to("cpu", copy=True)
        return out

    @contextlib.contextmanager
    def swap_into(self, model: nn.Module) -> Iterator[nn.Module]:
        """Temporarily load the EMA weights into ``model`` (e.g. to sample); the trained weights come back
        on exit, even on error. Costs one extra copy of this rank's shards while inside."""
        pairs = self._matched(model)
        with torch.no_grad():
            backups = [_local(parameter).clone() for _, parameter in pairs]
            for shadow, parameter in pairs:
                _local(parameter).copy_(_local(shadow))
        try:
            yield model
        finally:
            reshard_sharded_modules(model)
            with torch.no_grad():
                for backup, (_, parameter) in zip(backups, pairs, strict=True):
                    _local(parameter).copy_(backup)
