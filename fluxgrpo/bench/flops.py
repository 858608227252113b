"""Model FLOPs of the FLUX transformer (what MFU counts)
-----------------------------------------------------
Notation: d = heads × head_dim (hidden width), L image tokens ((H/16)·(W/16)), S text tokens, n = L + S, C_in = 64
packed latent channels in, C_out = 64 out, D_t = joint_attention_dim (4096), P = pooled_projection_dim (768),
N_d double blocks, N_s single blocks. A linear layer of shape a→b applied to one token costs 2ab FLOPs (one
multiply and one add per weight); attention over n tokens costs 2n²d for QKᵀ and 2n²d for the weighted sum of V,
4n²d per block, summed over heads (full bidirectional attention, no mask). Element-wise work (norms, RoPE, GELU,
softmax, modulation) is not counted, as MFU conventions do.

Double-stream block (``FluxTransformerBlock``): image and text tokens each go through their *own* weights —
q, k, v (3d²), output projection (d²), MLP d→4d→d (8d²): 12d² parameters per stream, 24d² per block — and
meet in one joint attention over all n tokens. So a token sees 12d² weights: 24·n·d² FLOPs, plus 4n²d for
attention.
Single-stream block (``FluxSingleTransformerBlock``): q, k, v (3d²), MLP-in d→4d (4d²), and one output projection
from the concatenated attention and MLP outputs 5d→d (5d²): 12d² per token again, 24·n·d² + 4n²d per block.
(So "2 × parameters × tokens" would double-count the double blocks: each token uses only half of their weights.)

Per sample (not per token) come the modulations — AdaLayerNormZero d→6d twice per double block, d→3d per single
block, d→2d before the output — and the conditioning embedders (timestep and guidance: 256→d→d each; pooled
text: P→d→d). Per token come the embedders x: C_in→d on L tokens, context: D_t→d on S tokens, and the output
projection d→C_out on L tokens. One forward of one sample therefore costs

    F = (N_d + N_s)·(24·n·d² + 4·n²·d)                              blocks
      + 2·d·(C_in·L + D_t·S + C_out·L)                              token embedders and output projection
      + 2·d²·(12·N_d + 3·N_s + 2)                                   adaLN modulations
      + 2·(g·(256·d + d²) + P·d + d²)      g = 2 with guidance, else 1: conditioning embedders

(``transformer_forward_flops``; the tests check it against a hand count and against torch's FLOP counter.)
A rollout costs B·N·F. A training step costs 3·F per sample (backward = 2 × forward: gradients with respect to
both inputs and weights), the usual model-FLOPs convention; the backward of the first layers computes no input
gradient, so the true count is a hair lower, and activation checkpointing's recomputed forward is hardware work
that MFU deliberately does not count. The update costs 3·B·T·F. For FLUX.1-dev (d = 3072, 19 + 38 blocks) at
720² (L = 2025, S = 512, n = 2537), F ≈ 37.3 TFLOP per image per step: 88% in the 24·n·d² terms, 12% in
attention.

MFU = (model FLOPs / seconds) / peak, per device, against ``runtime.peak.peak_throughput`` (dense bf16 or TF32
datasheet figures, Ascend's cube peak) or ``--peak-tflops``. No peak, no MFU (cpu).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from fluxgrpo.errors import FluxgrpoError

if TYPE_CHECKING:
    from torch import nn


# --------------------------------------------------------------------------------------------- FLOPs and sizes


@dataclass(frozen=True)
class FluxShape:
    """The sizes of a FluxTransformer2DModel that its cost depends on."""

    double_blocks: int  # N_d
    single_blocks: int  # N_s
    hidden: int  # d = heads × head_dim
    head_dim: int
    in_channels: int  # C_in, packed latent channels (64)
    out_channels: int  # C_out
    text_dim: int  # D_t, joint_attention_dim
    pooled_dim: int  # P, pooled_projection_dim
    guidance: bool  # guidance embedder present (FLUX.1-dev)

    @classmethod
    def from_config(cls, config: Any, blocks: tuple[int, int] | None = None) -> FluxShape:
        """From a transformer config (attribute access or dict); ``blocks`` overrides the block counts."""
        get: Callable[..., Any] = (
            config.get if isinstance(config, dict) else (lambda key, default=None: getattr(config, key, default))
        )
        if get("patch_size", 1) != 1:
            raise FluxgrpoError(
                f"the FLOP count assumes FLUX's patch_size 1 (latents packed outside), got {get('patch_size')}"
            )
        heads, head_dim = int(get("num_attention_heads")), int(get("attention_head_dim"))
        double, single = blocks if blocks is not None else (int(get("num_layers")), int(get("num_single_layers")))
        in_channels = int(get("in_channels"))
        return cls(
            double_blocks=double,
            single_blocks=single,
            hidden=heads * head_dim,
            head_dim=head_dim,
            in_channels=in_channels,
            out_channels=int(get("out_channels") or in_channels),
            text_dim=int(get("joint_attention_dim")),
            pooled_dim=int(get("pooled_projection_dim")),
            guidance=bool(get("guidance_embeds")),
        )

    @classmethod
    def from_transformer(cls, transformer: nn.Module) -> FluxShape:
        """From a built model; the block counts are the module lists' lengths (they may have been trimmed)."""
        return cls.from_config(
            transformer.config,
            (len(transformer.transformer_blocks), len(transformer.single_transformer_blocks)),  # type: ignore[arg-type]  # FLUX/diffusers attribute reached through nn.Module.__getattr__
        )

    def parameter_count(self) -> int:
        """Parameters of the transformer with these sizes (weights and biases; q/k RMSNorm scales)."""
        d, hd = self.hidden, self.head_dim

        def linear(fan_in: int, fan_out: int) -> int:
            return fan_in * fan_out + fan_out

        conditioning = (2 if self.guidance else 1) * (linear(256, d) + linear(d, d))
        conditioning += linear(self.pooled_dim, d) + linear(d, d)
        embedders = linear(self.in_channels, d) + linear(self.text_dim, d)
        double = (
            2 * linear(d, 6 * d)  # norm1, norm1_context
            + 8 * linear(d, d)  # q, k, v, out for each stream
            + 4 * hd  # norm_q, norm_k, norm_added_q, norm_added_k
            + 2 * (linear(d, 4 * d) + linear(4 * d, d))  # ff, ff_context
        )
        single = linear(d, 3 * d) + linear(d, 4 * d) + 3 * linear(d, d) + 2 * hd + linear(5 * d, d)
        output = linear(d, 2 * d) + linear(d, self.out_channels)
        return conditioning + embedders + self.double_blocks * double + self.single_blocks * single + output


def transformer_forward_flops(shape: FluxShape, image_tokens: int, text_tokens: int) -> int:
    """Model FLOPs of one forward of one sample (see the module docstring for the derivation)."""
    d, n = shape.hidden, image_tokens + text_tokens
    blocks = (shape.double_blocks + shape.single_blocks) * (24 * n * d * d + 4 * n * n * d)
    token_linears = (
        2 * d * (shape.in_channels * image_tokens + shape.text_dim * text_tokens + shape.out_channels * image_tokens)
    )
    modulation = 2 * d * d * (12 * shape.double_blocks + 3 * shape.single_blocks + 2)
    embedders = 2 * ((2 if shape.guidance else 1) * (256 * d + d * d) + shape.pooled_dim * d + d * d)
    return blocks + token_linears + modulation + embedders


def rollout_flops(shape: FluxShape, image_tokens: int, text_tokens: int, trajectories: int, steps: int) -> int:
    """B·N forwards."""
    return trajectories * steps * transformer_forward_flops(shape, image_tokens, text_tokens)


def update_flops(shape: FluxShape, image_tokens: int, text_tokens: int, trajectories: int, train_timesteps: int) -> int:
    """B·T forward + backward steps at 3 × forward each (recomputation under checkpointing not counted)."""
    return 3 * trajectories * train_timesteps * transformer_forward_flops(shape, image_tokens, text_tokens)
