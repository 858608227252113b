"""LoRA on the FLUX transformer, through diffusers' own peft integration (``add_adapter``, ``load_lora_weights``).

``--lora-rank R`` (R > 0) adds rank-R adapters to ``--lora-targets`` and trains only them: the base weights are
frozen in the compute dtype (bf16 on accelerators: no fp32 master, no gradients, no Adam state), the adapters are
fp32, and FSDP2 shards both as for full fine-tuning. Adapters are added on the meta device before sharding, like
the rest of the model (``models/shard_loading.py``); their initial values are drawn afterwards, per tensor, from
a generator seeded by (run seed, tensor name), so they do not depend on the number of dies.

Initialisation is peft's ``"gaussian"`` (Flow-GRPO's choice): A ~ N(0, 1/R²), B = 0, so training starts exactly at
the base model. A checkpoint's adapter is ``pytorch_lora_weights.safetensors`` in diffusers' LoRA format (keys
``transformer.<module>.lora_A.weight``, the peft config in its metadata), which ``FluxPipeline.load_lora_weights``
loads.
"""

from __future__ import annotations

import hashlib
import json
import re
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from diffusers import FluxPipeline
from peft import LoraConfig
from safetensors import safe_open

from fluxgrpo.errors import FluxgrpoError
from fluxgrpo.models.known import LORA_DEFAULT_TARGETS
from fluxgrpo.models.shard_loading import own_rows
from fluxgrpo.paths import give_default_mode

ADAPTER_NAME = "default"  # peft's name for the one adapter
LORA_WEIGHTS_NAME = "pytorch_lora_weights.safetensors"  # diffusers' file name


@dataclass(frozen=True)
class LoraSpec:
    rank: int
    alpha: float
    targets: tuple[str, ...]
    dropout: float

    def peft_config(self) -> Any:
        return LoraConfig(
            r=self.rank,
            lora_alpha=self.alpha,  # type: ignore[arg-type]  # peft annotates int; it scales by alpha / r, a float works
            target_modules=list(self.targets),
            lora_dropout=self.dropout,
            init_lora_weights="gaussian",
        )


def parse_targets(text: str) -> tuple[str, ...]:
    """``"attn.to_q, attn.to_k"`` → ("attn.to_q", "attn.to_k")."""
    return tuple(part.strip() for part in text.split(",") if part.strip())


def is_lora_model(model: torch.nn.Module) -> bool:
    """True when ``model`` carries a peft LoRA adapter (a LoRA run's transformer)."""
    return bool(getattr(model, "peft_config", None))


def add_lora(transformer: torch.nn.Module, spec: LoraSpec, compute_dtype: torch.dtype) -> None:
    """Freeze the (meta-device) transformer in ``compute_dtype`` and add fp32 adapters on ``spec.targets``.

    Raises:
        FluxgrpoError: a target names no module of the transformer.
    """
    names = [name for name, _ in transformer.named_modules()]
    unmatched = [t for t in spec.targets if not any(name == t or name.endswith("." + t) for name in names)]
    if unmatched:
        raise FluxgrpoError(
            f"--lora-targets {','.join(unmatched)} match no module of the FLUX transformer: use module names such as "
            f"{LORA_DEFAULT_TARGETS.split(',')[0]} (the default is {LORA_DEFAULT_TARGETS})"
        )
    transformer.requires_grad_(False)
    for parameter in transformer.parameters():  # not .to(): diffusers warns about casting a whole model
        parameter.data = parameter.data.to(compute_dtype)
    transformer.add_adapter(spec.peft_config(), adapter_name=ADAPTER_NAME)  # type: ignore[operator]  # a peft/diffusers method reached through nn.Module.__getattr__
    for name, parameter in transformer.named_parameters():
        if is_adapter_parameter(name):
            parameter.data = parameter.data.to(torch.float32)


def is_adapter_parameter(name: str) -> bool:
    return ".lora_A." in name or ".lora_B." in name


def base_weight_name(name: str) -> str | None:
    """The name a parameter of the adapted model has in the base model's safetensors; None for an adapter's."""
    if is_adapter_parameter(name):
        return None
    return name.replace(".base_layer.", ".")


def _seed_for(seed: int, name: str) -> int:
    digest = hashlib.sha256(f"fluxgrpo-lora:{seed}:{name}".encode()).digest()
    return int.from_bytes(digest[:8], "big") & (2**63 - 1)


@torch.no_grad()
def init_adapters(transformer: torch.nn.Module, seed: int) -> None:
    """Draw the adapters' initial values (A ~ N(0, 1/r²), B = 0) into their (possibly sharded) storage.

    Each full tensor is drawn on the host from its own generator, and each rank keeps its rows, so the values do
    not depend on the number of dies (an adapter is small: r × width).
    """

    rank = int(transformer.peft_config[ADAPTER_NAME].r)  # type: ignore[index, union-attr]  # set by peft's add_adapter
    for name, parameter in transformer.named_parameters():
        if not is_adapter_parameter(name):
            continue
        if ".lora_A." in name:
            generator = torch.Generator().manual_seed(_seed_for(seed, name))
            full = torch.randn(tuple(parameter.shape), generator=generator, dtype=torch.float32) / rank
        else:
            full = torch.zeros(tuple(parameter.shape), dtype=torch.float32)
        local, first_row = own_rows(parameter)
        rows = local.shape[0] if local.dim() else 0
        local.copy_(full[first_row : first_row + rows] if local.dim() else full)


def adapter_metadata(transformer: torch.nn.Module) -> dict[str, Any]:
    """The adapter's peft config as diffusers stores it beside the weights (rank, alpha, targets...)."""
    config = transformer.peft_config[ADAPTER_NAME].to_dict()  # type: ignore[index, union-attr]  # set by peft's add_adapter
    return {k: (sorted(v) if isinstance(v, set) else v) for k, v in config.items()}


def to_diffusers_keys(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Adapter tensors keyed as peft names them inside the model (``….lora_A.default.weight``) → keyed as
    diffusers' LoRA files hold them, without the adapter name (``….lora_A.weight``)."""
    suffix = f".{ADAPTER_NAME}."
    return {name.replace(suffix, "."): tensor for name, tensor in state.items() if is_adapter_parameter(name)}


def write_lora_file(directory: Path, state: dict[str, torch.Tensor], metadata: dict[str, Any]) -> Path:
    """``directory/pytorch_lora_weights.safetensors`` in diffusers' format, fp32, via FluxPipeline's own saver."""

    directory.mkdir(parents=True, exist_ok=True)
    tensors = {name: tensor.detach().to("cpu", torch.float32).contiguous() for name, tensor in state.items()}
    FluxPipeline.save_lora_weights(
        directory,
        transformer_lora_layers=to_diffusers_keys(tensors),
        weight_name=LORA_WEIGHTS_NAME,
        transformer_lora_adapter_metadata=metadata,
    )

    sort_header_metadata(directory / LORA_WEIGHTS_NAME)
    give_default_mode(directory / LORA_WEIGHTS_NAME)  # safetensors writes 0600; every other output is 0644
    return directory / LORA_WEIGHTS_NAME


def sort_header_metadata(path: Path) -> None:
    """Put a safetensors file's ``__metadata__`` keys in sorted order, in place, so the same adapter is the same
    bytes: safetensors writes them from a hash map, in an order that changes from process to process. The header
    keeps its length (only the order of its keys changes), so no tensor byte moves."""

    with open(path, "r+b") as f:
        (length,) = struct.unpack("<Q", f.read(8))
        raw = f.read(length)
        header = json.loads(raw)
        metadata = header.get("__metadata__")
        if not isinstance(metadata, dict):
            return
        ordered = {
            "__metadata__": dict(sorted(metadata.items())),
            **{k: v for k, v in header.items() if k != "__metadata__"},
        }
        text = json.dumps(ordered, separators=(",", ":"), ensure_ascii=False).encode()
        if len(text) > length:  # not the compact form safetensors writes: leave it as it is
            return
        f.seek(8)
        f.write(text + b" " * (length - len(text)))  # safetensors pads its header with spaces too


def check_adapter_file(path: Path, fix: str) -> int:
    """An adapter file diffusers can load into FLUX's transformer: a readable safetensors file whose keys are all
    ``transformer.….lora_A.weight`` / ``….lora_B.weight`` in pairs and whose values are finite. Returns the number
    of adapted layers.

    Raises:
        FluxgrpoError: one line naming the file (truncated, not safetensors, renamed keys, NaN/inf values).
    """

    try:
        with safe_open(str(path), framework="pt") as f:
            tensors = {key: f.get_tensor(key) for key in f.keys()}  # noqa: SIM118 - safe_open is not a dict
    except Exception as exc:  # SafetensorError, OSError: a truncated or foreign file
        first_line = next((line for line in str(exc).splitlines() if line.strip()), type(exc).__name__)
        raise FluxgrpoError(f"{path} is not a readable adapter file ({first_line}): {fix}") from None
    pattern = re.compile(r"^transformer\.(.+)\.lora_([AB])\.weight$")
    layers: dict[str, set[str]] = {}
    for key in tensors:
        found = pattern.match(key)
        if found is None:
            raise FluxgrpoError(
                f"{path} holds {key!r}, not a FLUX LoRA key (transformer.<module>.lora_A/lora_B.weight): {fix}"
            )
        layers.setdefault(found.group(1), set()).add(found.group(2))
    unpaired = sorted(name for name, halves in layers.items() if halves != {"A", "B"})
    if not layers or unpaired:
        what = (
            f"an unpaired adapter: layer {unpaired[0]!r} has only one of lora_A and lora_B"
            if unpaired
            else "no adapter weights"
        )
        raise FluxgrpoError(f"{path} holds {what}: {fix}")
    bad = sorted(key for key, tensor in tensors.items() if not torch.isfinite(tensor).all())
    if bad:
        raise FluxgrpoError(f"{path} holds non-finite values (NaN or inf) in {bad[0]}: {fix}")
    return len(layers)
