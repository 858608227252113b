"""Load FLUX.1-dev's parts from a diffusers folder, encode prompts the way FluxPipeline does, decode latents.

The same code serves the real weights and ``fetch-weights --source tiny``: both are diffusers FLUX folders. Every
loader checks the folder first (``weights.layout.check_flux_dir``) so a missing part is one clear error naming
``fluxgrpo fetch-weights`` instead of a diffusers traceback. diffusers is imported only by the loaders that need
it, so encoding prompts (``preprocess``) never pays for it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, cast

import torch
from diffusers import AutoencoderKL, FluxTransformer2DModel
from transformers import CLIPTextModel, CLIPTokenizer, T5EncoderModel, T5Tokenizer

from fluxgrpo.errors import FluxgrpoError, not_usable
from fluxgrpo.safe_load import load_pretrained
from fluxgrpo.weights.layout import check_flux_dir

if TYPE_CHECKING:
    from torch import nn


class _Checkpointable(Protocol):
    """diffusers' ModelMixin switches (kept through a peft wrapper), which ``nn.Module.__getattr__`` cannot type."""

    def enable_gradient_checkpointing(self) -> None: ...
    def disable_gradient_checkpointing(self) -> None: ...


def set_activation_checkpointing(transformer: nn.Module, on: bool) -> None:
    """Activation checkpointing in every block of a diffusers transformer, on or off."""
    model = cast("_Checkpointable", transformer)
    if on:
        model.enable_gradient_checkpointing()
    else:
        model.disable_gradient_checkpointing()


CLIP_MAX_LENGTH = 77  # CLIP-L's context; FluxPipeline truncates the pooled prompt to it


def _refetch(root: Path) -> str:
    return f"re-run `fluxgrpo fetch-weights --flux-dir {root}`"


def require_flux_dir(flux_dir: str | Path) -> Path:
    """The folder, if ``check_flux_dir`` calls it complete; otherwise FluxgrpoError listing what is missing."""
    status = check_flux_dir(flux_dir)
    if not status.complete:
        raise not_usable(f"FLUX weights in {flux_dir}", status.problems, status.fix)
    return Path(flux_dir)


def load_transformer(
    flux_dir: str | Path, dtype: torch.dtype | None = None, device: torch.device | str = "cpu"
) -> FluxTransformer2DModel:
    """The FLUX transformer from ``<flux_dir>/transformer`` in ``dtype`` (default float32) on ``device``."""

    root = require_flux_dir(flux_dir)
    model = load_pretrained(
        lambda: FluxTransformer2DModel.from_pretrained(root, subfolder="transformer", dtype=dtype or torch.float32),
        "the FLUX transformer",
        root / "transformer",
        _refetch(root),
    )
    return model.to(device)


def load_vae(
    flux_dir: str | Path, dtype: torch.dtype | None = None, device: torch.device | str = "cpu"
) -> AutoencoderKL:
    """The VAE from ``<flux_dir>/vae`` in ``dtype`` (default float32) on ``device``, in eval mode."""

    root = require_flux_dir(flux_dir)
    vae = load_pretrained(
        lambda: AutoencoderKL.from_pretrained(root, subfolder="vae", dtype=dtype or torch.float32),
        "the FLUX VAE",
        root / "vae",
        _refetch(root),
    )
    return vae.to(device).eval()


def load_scheduler_config(flux_dir: str | Path) -> dict[str, Any]:
    """The FlowMatchEulerDiscreteScheduler config (shift, dynamic shifting bounds, ...) as a plain dict."""

    root = require_flux_dir(flux_dir)
    path = root / "scheduler" / "scheduler_config.json"
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise FluxgrpoError(f"cannot read {path} ({exc}): run `fluxgrpo fetch-weights --flux-dir {flux_dir}`") from exc


def read_transformer_config(flux_dir: str | Path) -> dict[str, Any]:
    """``transformer/config.json`` as a dict (joint_attention_dim, pooled_projection_dim, ...), without weights."""

    path = Path(flux_dir) / "transformer" / "config.json"
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise FluxgrpoError(f"cannot read {path} ({exc}): run `fluxgrpo fetch-weights --flux-dir {flux_dir}`") from exc


@dataclass
class TextEncoders:
    """FLUX's two text encoders and their tokenizers, in eval mode with gradients off."""

    clip: CLIPTextModel  # pooled output, hidden size P
    clip_tokenizer: CLIPTokenizer  # context 77
    t5: T5EncoderModel  # last_hidden_state, width D
    t5_tokenizer: T5Tokenizer

    @property
    def embed_dim(self) -> int:
        """D, the T5 width (the transformer's joint_attention_dim)."""
        return int(self.t5.config.d_model)

    @property
    def pooled_dim(self) -> int:
        """P, the CLIP pooled width (the transformer's pooled_projection_dim)."""
        return int(self.clip.config.hidden_size)

    @property
    def device(self) -> torch.device:
        return next(self.t5.parameters()).device


def load_text_encoders(
    flux_dir: str | Path, dtype: torch.dtype | None = None, device: torch.device | str = "cpu"
) -> TextEncoders:
    """CLIP (``text_encoder``, ``tokenizer``) and T5 (``text_encoder_2``, ``tokenizer_2``) from a FLUX folder."""

    root = require_flux_dir(flux_dir)
    dtype = dtype or torch.float32
    fix = _refetch(root)
    clip = load_pretrained(
        lambda: CLIPTextModel.from_pretrained(root / "text_encoder", dtype=dtype), "CLIP", root / "text_encoder", fix
    )
    t5 = load_pretrained(
        lambda: T5EncoderModel.from_pretrained(root / "text_encoder_2", dtype=dtype), "T5", root / "text_encoder_2", fix
    )
    clip = clip.to(device).eval().requires_grad_(False)
    t5 = t5.to(device).eval().requires_grad_(False)
    clip_tokenizer = load_pretrained(
        lambda: CLIPTokenizer.from_pretrained(root / "tokenizer"), "the CLIP tokenizer", root / "tokenizer", fix
    )
    t5_tokenizer = load_pretrained(
        lambda: T5Tokenizer.from_pretrained(root / "tokenizer_2"), "the T5 tokenizer", root / "tokenizer_2", fix
    )
    return TextEncoders(clip=clip, clip_tokenizer=clip_tokenizer, t5=t5, t5_tokenizer=t5_tokenizer)


@dataclass
class EncodedPrompts:
    """Text conditioning for a batch of B prompts, as FLUX consumes it."""

    prompt_embeds: torch.Tensor  # [B, S, D] T5 last_hidden_state, S = max_sequence_length, padded and unmasked
    pooled: torch.Tensor  # [B, P] CLIP pooled output of the prompt truncated to 77 tokens
    truncated: list[bool]  # [B] True where the prompt had more than S T5 tokens and was cut


def t5_token_counts(encoders: TextEncoders, prompts: list[str]) -> list[int]:
    """T5 tokens per prompt including the end token, before any truncation."""
    ids = encoders.t5_tokenizer(prompts, add_special_tokens=True, truncation=False, verbose=False)["input_ids"]
    return [len(row) for row in ids]


def encode_prompts(encoders: TextEncoders, prompts: list[str], max_sequence_length: int = 512) -> EncodedPrompts:
    """Encode prompts exactly as ``FluxPipeline.encode_prompt(prompt, prompt_2=prompt)`` does.

    CLIP: padded/truncated to 77 tokens, ``pooler_output``. T5: padded to ``max_sequence_length`` ("max_length"),
    truncated, no attention mask (FLUX was trained on unmasked padded T5 outputs), ``last_hidden_state``. Outputs
    are in the dtype the encoders produced; run this under the runtime's autocast for mixed precision.
    """

    device = encoders.device
    clip_ids = encoders.clip_tokenizer(
        prompts, padding="max_length", max_length=CLIP_MAX_LENGTH, truncation=True, return_tensors="pt"
    ).input_ids
    t5_ids = encoders.t5_tokenizer(
        prompts, padding="max_length", max_length=max_sequence_length, truncation=True, return_tensors="pt"
    ).input_ids
    truncated = [count > max_sequence_length for count in t5_token_counts(encoders, prompts)]
    with torch.no_grad():
        pooled = encoders.clip(clip_ids.to(device), output_hidden_states=False).pooler_output
        prompt_embeds = encoders.t5(t5_ids.to(device), output_hidden_states=False)[0]
    return EncodedPrompts(prompt_embeds=prompt_embeds, pooled=pooled, truncated=truncated)


def decode_latents(vae: AutoencoderKL, latents: torch.Tensor) -> torch.Tensor:
    """Unpacked latents [B, 16, H/8, W/8] → images [B, 3, H, W] float32 in [0, 1].

    Undoes the latent normalisation with the VAE's own ``scaling_factor`` and ``shift_factor`` (FLUX.1-dev:
    0.3611 and 0.1159, the constants DanceGRPO hard-codes), decodes, and maps [-1, 1] to [0, 1] with clamping,
    as diffusers' image post-processing does.
    """
    config = vae.config
    shift = config.shift_factor if config.shift_factor is not None else 0.0
    scaled = latents.to(vae.dtype) / config.scaling_factor + shift
    decoded = vae.decode(scaled, return_dict=False)[0]
    return (decoded.float() / 2 + 0.5).clamp(0, 1)
