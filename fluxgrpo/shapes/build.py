"""Rebuild the shapes world's shipped weights from their seed: ``python -m fluxgrpo.shapes.build --out DIR``.

Everything is trained on rendered images of the *training* split's captions only (``world.split().train``), on the
CPU, seeded, in four stages:

1. **VAE** (diffusers' ``AutoencoderKL``, FLUX's 16 latent channels and 8× downsampling) as an autoencoder: L1 +
   MSE reconstruction of the sampled posterior, a small KL. Its ``shift_factor`` and ``scaling_factor`` are then
   measured on the training images' latents (their mean and 1/std), as FLUX's own were; then the decoder alone
   trains on, the encoder (and so every latent) frozen, its loss weighed towards the objects' pixels. The VAE sees
   no caption: like FLUX's, it is an autoencoder of the world's images, so it learns from scenes of every caption of
   the grammar (two green objects too, which the training split's captions never draw); trained on the training
   split's scenes alone it decoded such pairs blue (0.80 strict on reconstructions). The transformer and the HPS,
   which read captions, learn from the training split only.
2. **Text encoders**: FLUX's CLIP-L and T5 classes, tiny, with the world's tokenizers (``shapes/tokenizers.py``),
   seeded. FLUX's encoders arrive pretrained; random ones give nearly one pooled vector for every caption, so ours
   train with the transformer (stage 3) and ship as trained, frozen from then on like FLUX's.
3. **Transformer** (``FluxTransformer2DModel``) by rectified flow on the VAE's normalised, packed latents:
   x_σ = (1 − σ)·x0 + σ·ε, target v = ε − x0, σ = FLUX's time shift (3) of a logit-normal/uniform draw, fed
   quantised as the sampler feeds it (``grpo.schedule.model_timesteps``) with a random distilled-guidance value
   (the model is not guidance-distilled, so it learns to ignore it). An EMA of the weights is what ships.
4. **Tiny HPS**: an open_clip CLIP trained contrastively on (image, caption) pairs (the renders) with one hard
   negative caption per image (a colour, shape, count or relation changed), and, as HPSv2 was fine-tuned on people's
   rankings of generated images, with HPSv2's ranking loss on pairs of the base model's own samples of training
   prompts ranked by the rule checker; through HPSv2's own preprocessing; written in HPSv2's layout
   (``HPS_v2.1_compressed.pt`` + ``open_clip_config.json``).

``--quick`` runs every stage a few steps (the tests). The same seed, torch version and thread count give the same
files. ``build.json`` records the plan, the losses and the time of each stage.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

from fluxgrpo.shapes import world
from fluxgrpo.shapes.tokenizers import WORLD_TEXT_LENGTH, build_world_clip_tokenizer, build_world_t5_tokenizer

BUILD_INFO = "build.json"
FLUX_SUBDIR = "flux"
HPS_SUBDIR = "hps"

# FLUX's parts at laptop size. The transformer sees 16 image tokens (a 64² image) and 12 text tokens.
WORLD_TRANSFORMER_CONFIG: dict[str, Any] = {
    "patch_size": 1,
    "in_channels": 64,  # 16 latent channels x 2x2 packing
    "num_layers": 2,
    "num_single_layers": 2,
    "attention_head_dim": 32,
    "num_attention_heads": 4,
    "joint_attention_dim": 32,  # = the T5's d_model
    "pooled_projection_dim": 32,  # = the CLIP's hidden size
    "guidance_embeds": True,
    "axes_dims_rope": (8, 12, 12),  # each even, summing to attention_head_dim
}
WORLD_VAE_CONFIG: dict[str, Any] = {
    "in_channels": 3,
    "out_channels": 3,
    "down_block_types": ("DownEncoderBlock2D",) * 4,
    "up_block_types": ("UpDecoderBlock2D",) * 4,
    "block_out_channels": (8, 16, 32, 32),
    "layers_per_block": 1,
    "latent_channels": 16,
    "norm_num_groups": 4,
    "sample_size": 64,
    "use_quant_conv": False,
    "use_post_quant_conv": False,
}
# open_clip's model-config format, read back by ``rewards/open_clip_model.py``. The vision tower takes the 64²
# images as they are (HPSv2's resize is then the identity); the text tower has open_clip's own vocabulary.
WORLD_HPS_CONFIG: dict[str, Any] = {
    "embed_dim": 32,
    "vision_cfg": {"image_size": 64, "layers": 2, "width": 64, "head_width": 16, "patch_size": 8},
    "text_cfg": {"context_length": 16, "vocab_size": 49408, "width": 32, "heads": 2, "layers": 2},
}


@dataclass(frozen=True)
class BuildPlan:
    """Sizes and lengths of every stage; ``FULL_PLAN`` is what ships, ``QUICK_PLAN`` what the tests run."""

    seed: int = 0
    images: int = 8000  # rendered training images (train-split captions, families weighed evenly)
    vae_images: int = 8000  # rendered images of every caption of the grammar, for the caption-free VAE
    vae_steps: int = 400
    vae_batch: int = 16
    vae_lr: float = 2e-3
    decoder_steps: int = 1200  # the decoder alone afterwards, the encoder frozen
    decoder_lr: float = 1e-3
    # The objects cover ~15 % of an image: unweighted, the loss spends itself on the plain background while an
    # object's colour drifts towards another palette colour. Object pixels (and a 1-px rim) weigh 1 + this.
    decoder_object_weight: float = 8.0
    transformer_steps: int = 8000
    transformer_batch: int = 48
    transformer_lr: float = 1e-3
    ema_decay: float = 0.998
    text_encoders: bool = True  # the CLIP and T5 train with the transformer (see train_transformer)
    hps_steps: int = 400
    hps_batch: int = 96  # distinct captions per step, one image each
    hps_lr: float = 2e-3
    hps_judged_prompts: int = 240  # training prompts whose base samples the checker ranks for HPS's ranking loss
    hps_judged_per_prompt: int = 8
    hps_judged_steps: int = 12  # sampler steps, as the shapes configs evaluate
    hps_pair_batch: int = 64
    threads: int = 2


FULL_PLAN = BuildPlan()
QUICK_PLAN = BuildPlan(
    images=16,
    vae_images=16,
    vae_steps=2,
    vae_batch=2,
    decoder_steps=2,
    transformer_steps=2,
    transformer_batch=4,
    hps_steps=2,
    hps_batch=8,
    hps_judged_prompts=2,
    hps_judged_per_prompt=2,
    hps_judged_steps=2,
    hps_pair_batch=4,
)


_START = time.monotonic()


def _log(message: str) -> None:
    print(f"[{time.monotonic() - _START:7.1f}s] {message}", flush=True)


def training_captions() -> list[str]:
    return list(world.split().train)


def render_dataset(count: int, seed: int, captions: list[str] | None = None) -> tuple[np.ndarray, list[int]]:
    """``count`` images [N, 64, 64, 3] uint8 of ``captions`` (the training captions by default), and each image's
    caption index.

    A family is drawn first, then one of its captions, so the many position captions do not crowd out the rest.
    """
    captions = training_captions() if captions is None else captions
    by_family: dict[str, list[int]] = {}
    for index, text in enumerate(captions):
        by_family.setdefault(world.parse_caption(text).family, []).append(index)
    families = sorted(by_family)
    rng = random.Random(seed)
    images = np.empty((count, 64, 64, 3), dtype=np.uint8)
    indices = []
    for n in range(count):
        index = rng.choice(by_family[rng.choice(families)])
        images[n] = world.render(world.sample_scene(world.parse_caption(captions[index]), rng, 64))
        indices.append(index)
    return images, indices


def _to_pixels(images: np.ndarray) -> Any:
    """uint8 [N, H, W, 3] → float32 [N, 3, H, W] in [-1, 1], the VAE's input range."""
    import torch

    return torch.from_numpy(images).permute(0, 3, 1, 2).float() / 127.5 - 1.0


def _warmup_cosine(step: int, total: int, warmup: int) -> float:
    if step < warmup:
        return (step + 1) / warmup
    return 0.5 * (1 + math.cos(math.pi * (step - warmup) / max(1, total - warmup))) * 0.9 + 0.1


def train_vae(images: np.ndarray, plan: BuildPlan) -> tuple[Any, list[float]]:
    import torch
    from diffusers import AutoencoderKL

    torch.manual_seed(plan.seed)
    vae = AutoencoderKL(**WORLD_VAE_CONFIG)
    optimizer = torch.optim.AdamW(vae.parameters(), lr=plan.vae_lr, weight_decay=0.0)
    generator = torch.Generator().manual_seed(plan.seed + 10)
    losses = []
    vae.train()
    for step in range(plan.vae_steps):
        for group in optimizer.param_groups:
            group["lr"] = plan.vae_lr * _warmup_cosine(step, plan.vae_steps, 20)
        batch = _to_pixels(images[torch.randint(len(images), (plan.vae_batch,), generator=generator).numpy()])
        posterior = vae.encode(batch).latent_dist
        latents = posterior.mean + posterior.std * torch.randn(posterior.mean.shape, generator=generator)
        recon = vae.decode(latents).sample
        kl = posterior.kl().mean() / batch[0].numel()
        loss = (recon - batch).abs().mean() + (recon - batch).pow(2).mean() + 1e-4 * kl
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(vae.parameters(), 1.0)
        optimizer.step()
        losses.append(loss.item())
        if step % 20 == 0 or step == plan.vae_steps - 1:
            _log(f"vae step {step}/{plan.vae_steps} loss {loss.item():.4f}")
    return vae.eval().requires_grad_(False), losses


def object_weights(images: np.ndarray, extra: float) -> Any:
    """[N, 1, H, W] float32: 1 on the background, 1 + ``extra`` on an object's pixels and a 1-px rim around them
    (anti-aliased edges included)."""
    import torch

    background = np.asarray(world.BACKGROUND, dtype=np.int16)
    objects = torch.from_numpy(np.abs(images.astype(np.int16) - background).sum(-1) > 30).float()[:, None]
    return 1 + extra * torch.nn.functional.max_pool2d(objects, 3, stride=1, padding=1)


def finetune_decoder(vae: Any, images: np.ndarray, plan: BuildPlan) -> list[float]:
    """More training for the decoder alone, the encoder frozen (as Stable Diffusion's ft-MSE VAE was): the latents,
    and so the transformer's data, stay as they are while colours and edges sharpen; the objects' pixels weigh more
    (``plan.decoder_object_weight``). In place; the loss per step."""
    import torch

    torch.manual_seed(plan.seed + 4)
    decoder = [*vae.decoder.parameters()]
    optimizer = torch.optim.AdamW(decoder, lr=plan.decoder_lr, weight_decay=0.0)
    generator = torch.Generator().manual_seed(plan.seed + 11)
    losses = []
    vae.requires_grad_(False)
    for parameter in decoder:
        parameter.requires_grad_(True)
    vae.train()
    for step in range(plan.decoder_steps):
        for group in optimizer.param_groups:
            group["lr"] = plan.decoder_lr * _warmup_cosine(step, plan.decoder_steps, 20)
        chosen = images[torch.randint(len(images), (plan.vae_batch,), generator=generator).numpy()]
        batch = _to_pixels(chosen)
        weights = object_weights(chosen, plan.decoder_object_weight)
        with torch.no_grad():
            posterior = vae.encode(batch).latent_dist
            latents = posterior.mean + posterior.std * torch.randn(posterior.mean.shape, generator=generator)
        recon = vae.decode(latents).sample
        error = recon - batch
        loss = ((error.abs() + error.pow(2)) * weights).sum() / (weights.sum() * error.shape[1])
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(decoder, 1.0)
        optimizer.step()
        losses.append(loss.item())
        if step % 20 == 0 or step == plan.decoder_steps - 1:
            _log(f"decoder step {step}/{plan.decoder_steps} loss {loss.item():.4f}")
    vae.eval().requires_grad_(False)
    return losses


def encode_dataset(vae: Any, images: np.ndarray, batch: int = 256) -> Any:
    """Posterior means [N, 16, 8, 8] of every image (no noise: the data the flow is trained to reach)."""
    import torch

    with torch.no_grad():
        return torch.cat(
            [vae.encode(_to_pixels(images[i : i + batch])).latent_dist.mean for i in range(0, len(images), batch)]
        )


def build_text_encoders(seed: int) -> tuple[Any, Any, Any, Any]:
    """The world's CLIP-L and T5 text encoders (random, seeded, frozen) and their tokenizers."""
    import torch
    from transformers import CLIPTextConfig, CLIPTextModel, T5Config, T5EncoderModel

    clip_tokenizer = build_world_clip_tokenizer()
    t5_tokenizer = build_world_t5_tokenizer()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        clip = CLIPTextModel(
            CLIPTextConfig(
                vocab_size=len(clip_tokenizer),
                hidden_size=32,
                intermediate_size=64,
                num_hidden_layers=2,
                num_attention_heads=4,
                max_position_embeddings=77,
                projection_dim=32,
                hidden_act="quick_gelu",
                bos_token_id=clip_tokenizer.bos_token_id,
                eos_token_id=clip_tokenizer.eos_token_id,
                pad_token_id=clip_tokenizer.pad_token_id,
            )
        )
        t5 = T5EncoderModel(
            T5Config(
                vocab_size=len(t5_tokenizer),
                d_model=32,
                d_kv=8,
                d_ff=64,
                num_layers=2,
                num_heads=4,
                relative_attention_num_buckets=8,
                feed_forward_proj="gated-gelu",
                is_encoder_decoder=False,
                use_cache=False,
                pad_token_id=0,
                eos_token_id=1,
                decoder_start_token_id=0,
            )
        )
    return clip.eval().requires_grad_(False), clip_tokenizer, t5.eval().requires_grad_(False), t5_tokenizer


def draw_sigmas(count: int, generator: Any, shift: float = 3.0) -> Any:
    """σ for flow-matching training: half logit-normal, half uniform, through FLUX's time shift σ = s·u/(1+(s−1)·u).

    The shift is the one the RL sampler's table uses (``grpo.schedule.sigma_schedule``), so the noisy early steps,
    where an image's layout and count are decided, get most of the training."""
    import torch

    u = torch.sigmoid(torch.randn(count, generator=generator))
    uniform = torch.rand(count, generator=generator)
    u = torch.where(torch.rand(count, generator=generator) < 0.5, u, uniform)
    return shift * u / (1 + (shift - 1) * u)


def tokenize_captions(clip_tokenizer: Any, t5_tokenizer: Any, captions: list[str]) -> tuple[Any, Any]:
    """(CLIP ids [n, 77], T5 ids [n, 12]) padded exactly as ``models.flux.encode_prompts`` pads them."""
    from fluxgrpo.models.flux import CLIP_MAX_LENGTH

    clip_ids = clip_tokenizer(
        captions, padding="max_length", max_length=CLIP_MAX_LENGTH, truncation=True, return_tensors="pt"
    ).input_ids
    t5_ids = t5_tokenizer(
        captions, padding="max_length", max_length=WORLD_TEXT_LENGTH, truncation=True, return_tensors="pt"
    ).input_ids
    return clip_ids, t5_ids


def train_transformer(
    latents: Any, caption_index: list[int], clip: Any, t5: Any, token_ids: tuple[Any, Any], plan: BuildPlan
) -> tuple[Any, Any, Any, list[float]]:
    """Rectified-flow training of the transformer, and of both text encoders with it (``plan.text_encoders``).

    The encoders learn with the transformer because random ones hand it nearly one pooled vector for every caption
    (cosine ≈ 0.97): FLUX's own encoders arrive pretrained and discriminative, ours must become so. Returns the EMA
    transformer, CLIP and T5 (eval mode, gradients off) and the loss per step.
    """
    import copy

    import torch
    from diffusers import FluxTransformer2DModel

    from fluxgrpo.grpo.latents import image_ids, pack_latents
    from fluxgrpo.grpo.rollout import predict_velocity
    from fluxgrpo.grpo.schedule import model_timesteps
    from fluxgrpo.grpo.types import Conditioning

    torch.manual_seed(plan.seed + 1)
    transformer = FluxTransformer2DModel(**WORLD_TRANSFORMER_CONFIG)
    parts = torch.nn.ModuleDict({"transformer": transformer, "clip": clip, "t5": t5})
    parts.requires_grad_(False)
    transformer.requires_grad_(True)
    if plan.text_encoders:
        clip.requires_grad_(True)
        t5.requires_grad_(True)
    ema = copy.deepcopy(parts).requires_grad_(False)
    trained = [parameter for parameter in parts.parameters() if parameter.requires_grad]
    optimizer = torch.optim.AdamW(trained, lr=plan.transformer_lr, weight_decay=1e-4)
    clip_ids, t5_ids = token_ids
    packed = pack_latents(latents)
    captions = torch.tensor(caption_index)
    img_ids = image_ids(64, 64)
    text_ids = torch.zeros(WORLD_TEXT_LENGTH, 3)
    generator = torch.Generator().manual_seed(plan.seed + 20)
    losses = []
    parts.train()
    if not plan.text_encoders:
        clip.eval()
        t5.eval()
    for step in range(plan.transformer_steps):
        for group in optimizer.param_groups:
            group["lr"] = plan.transformer_lr * _warmup_cosine(step, plan.transformer_steps, 100)
        rows = torch.randint(len(packed), (plan.transformer_batch,), generator=generator)
        x0 = packed[rows]
        noise = torch.randn(x0.shape, generator=generator)
        sigma = draw_sigmas(len(rows), generator)
        noisy = (1 - sigma[:, None, None]) * x0 + sigma[:, None, None] * noise
        guidance = 1 + 4 * torch.rand(len(rows), generator=generator)
        with torch.set_grad_enabled(plan.text_encoders):
            pooled = clip(clip_ids[captions[rows]]).pooler_output
            prompt_embeds = t5(t5_ids[captions[rows]])[0]
        cond = Conditioning(prompt_embeds, pooled, text_ids)
        velocity = predict_velocity(transformer, noisy, cond, model_timesteps(sigma), guidance, img_ids, "cpu")
        loss = (velocity.float() - (noise - x0)).pow(2).mean()
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(trained, 1.0)
        optimizer.step()
        decay = min(plan.ema_decay, (1 + step) / (10 + step))
        with torch.no_grad():
            for kept, live in zip(ema.parameters(), parts.parameters(), strict=True):
                kept.lerp_(live, 1 - decay)
        losses.append(loss.item())
        if step % 100 == 0 or step == plan.transformer_steps - 1:
            _log(f"transformer step {step}/{plan.transformer_steps} loss {loss.item():.4f}")
    ema.eval()
    return ema["transformer"], ema["clip"], ema["t5"], losses


def hard_negative(text: str, rng: random.Random) -> str | None:
    """The caption with one claim changed (a colour, a shape, the count or the relation), seen combinations only;
    None when no change stays in the grammar's seen part."""
    caption = world.parse_caption(text)
    options: list[world.Caption] = []
    for i, spec in enumerate(caption.objects):
        for colour in world.COLOURS:
            if spec.colour and colour != spec.colour:
                objects = list(caption.objects)
                objects[i] = world.ObjectSpec(spec.shape, colour)
                options.append(replace(caption, objects=tuple(objects)))
        for shape in world.SHAPES:
            others = {o.shape for j, o in enumerate(caption.objects) if j != i}
            if shape != spec.shape and shape not in others:
                objects = list(caption.objects)
                objects[i] = world.ObjectSpec(shape, spec.colour)
                options.append(replace(caption, objects=tuple(objects)))
    if caption.count is not None:
        options += [replace(caption, count=n) for n in (2, 3) if n != caption.count]
    if caption.relation is not None:
        options += [replace(caption, relation=r) for r in world.RELATIONS if r != caption.relation]
        options.append(replace(caption, objects=caption.objects[::-1]))
    seen = [option for option in options if not world.is_novel(option) and option.text() != text]
    return rng.choice(seen).text() if seen else None


@dataclass(frozen=True)
class JudgedSamples:
    """The base model's own images of training prompts, each scored by the checker: HPS's "human" preferences.

    HPSv2 was fine-tuned on pairs of *generated* images that people ranked; here the rule checker ranks them. Pairs
    are (better, worse) rows of one prompt's group whose checker scores differ."""

    images: np.ndarray  # uint8 [N, 64, 64, 3]
    prompts: list[str]
    scores: list[float]
    pairs: list[tuple[int, int]]


def judged_base_samples(flux_dir: Path, plan: BuildPlan) -> JudgedSamples:
    """``plan.hps_judged_prompts`` training prompts × ``plan.hps_judged_per_prompt`` base samples, checked."""
    from fluxgrpo.shapes.checker import check
    from fluxgrpo.shapes.measure import sample_images

    captions = training_captions()
    prompts = random.Random(plan.seed + 40).sample(captions, min(plan.hps_judged_prompts, len(captions)))
    # Seed 7: apart from the measurement's sampling seeds (0 held-out, 1 training prompts).
    groups = sample_images(flux_dir, prompts, plan.hps_judged_per_prompt, plan.hps_judged_steps, seed=7)
    images: list[np.ndarray] = []
    texts: list[str] = []
    scores: list[float] = []
    pairs: list[tuple[int, int]] = []
    for prompt, group in zip(prompts, groups, strict=True):
        first = len(images)
        for image in group:
            images.append(image)
            texts.append(prompt)
            scores.append(check(image, prompt).score)
        rows = range(first, len(images))
        pairs += [(i, j) for i in rows for j in rows if scores[i] > scores[j]]
    stacked = np.stack(images) if images else np.empty((0, 64, 64, 3), np.uint8)
    return JudgedSamples(stacked, texts, scores, pairs)


def train_hps(
    images: np.ndarray, caption_index: list[int], judged: JudgedSamples, plan: BuildPlan
) -> tuple[Any, list[float]]:
    """The tiny open_clip CLIP: contrastive (render, caption) training with hard negatives, plus HPSv2's ranking
    loss on the judged base samples (the better image of a pair gets the higher ``logit_scale · cos``, a softmax over
    the pair as HPSv2's training computes it). Returns it in eval mode."""
    import open_clip
    import torch
    import torch.nn.functional as F
    from open_clip.model import CLIP

    from fluxgrpo.rewards.base import normalize_clip
    from fluxgrpo.rewards.hpsv2 import resize_longest_and_pad
    from fluxgrpo.rewards.open_clip_model import register_open_clip_config

    captions = training_captions()
    tokenizer = open_clip.get_tokenizer(register_open_clip_config(WORLD_HPS_CONFIG))
    torch.manual_seed(plan.seed + 2)
    model = CLIP(**json.loads(json.dumps(WORLD_HPS_CONFIG)))
    optimizer = torch.optim.AdamW(model.parameters(), lr=plan.hps_lr, weight_decay=0.0)
    by_caption: dict[int, list[int]] = {}
    for row, index in enumerate(caption_index):
        by_caption.setdefault(index, []).append(row)
    rng = random.Random(plan.seed + 30)
    size = WORLD_HPS_CONFIG["vision_cfg"]["image_size"]

    def prepare(batch: np.ndarray) -> Any:  # HPSv2's own preprocessing, on uint8 [n, 64, 64, 3]
        pixels = torch.from_numpy(batch).permute(0, 3, 1, 2).float() / 255.0
        return normalize_clip(resize_longest_and_pad(pixels, size))

    def ranking_loss(model: Any, tokenizer: Any, judged: JudgedSamples, pairs: list[tuple[int, int]]) -> Any:
        better, worse = [i for i, _ in pairs], [j for _, j in pairs]
        image_features = F.normalize(model.encode_image(prepare(judged.images[better + worse])), dim=-1)
        text_features = F.normalize(model.encode_text(tokenizer([judged.prompts[i] for i in better])), dim=-1)
        scores = model.logit_scale.exp() * (image_features * text_features.repeat(2, 1)).sum(-1)
        logits = torch.stack([scores[: len(pairs)], scores[len(pairs) :]], dim=1)  # [pairs, 2]: better first
        return F.cross_entropy(logits, torch.zeros(len(pairs), dtype=torch.long))

    losses = []
    model.train()
    for step in range(plan.hps_steps):
        for group in optimizer.param_groups:
            group["lr"] = plan.hps_lr * _warmup_cosine(step, plan.hps_steps, 50)
        chosen = rng.sample(sorted(by_caption), min(plan.hps_batch, len(by_caption)))
        rows = [rng.choice(by_caption[index]) for index in chosen]
        texts = [captions[index] for index in chosen]
        negatives = [hard_negative(text, rng) or text for text in texts]
        image_features = F.normalize(model.encode_image(prepare(images[rows])), dim=-1)
        text_features = F.normalize(model.encode_text(tokenizer(texts + negatives)), dim=-1)
        logits = model.logit_scale.exp() * image_features @ text_features.T  # [b, 2b]
        # A hard negative that equals another image's own caption is masked for that image only.
        own = torch.tensor([[t == texts[i] for t in texts + negatives] for i in range(len(texts))])
        own[torch.arange(len(texts)), torch.arange(len(texts))] = False
        logits = logits.masked_fill(own, float("-inf"))
        targets = torch.arange(len(texts))
        loss = (F.cross_entropy(logits, targets) + F.cross_entropy(logits[:, : len(texts)].T, targets)) / 2
        if judged.pairs:
            loss = loss + ranking_loss(model, tokenizer, judged, rng.choices(judged.pairs, k=plan.hps_pair_batch))
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        with torch.no_grad():
            model.logit_scale.clamp_(0, math.log(100))
        losses.append(loss.item())
        if step % 50 == 0 or step == plan.hps_steps - 1:
            _log(f"hps step {step}/{plan.hps_steps} loss {loss.item():.4f}")
    return model.eval().requires_grad_(False), losses


def write_flux(folder: Path, vae: Any, transformer: Any, clip: Any, clip_tokenizer: Any, t5: Any, t5_tokenizer: Any):
    from diffusers import FlowMatchEulerDiscreteScheduler, FluxPipeline

    from fluxgrpo.models.tiny import FLUX_SCHEDULER_CONFIG

    pipeline = FluxPipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(**FLUX_SCHEDULER_CONFIG),
        vae=vae,
        text_encoder=clip,
        tokenizer=clip_tokenizer,
        text_encoder_2=t5,
        tokenizer_2=t5_tokenizer,
        transformer=transformer,
    )
    pipeline.save_pretrained(folder)


def write_hps(folder: Path, model: Any) -> None:
    import torch

    from fluxgrpo.weights.layout import HPS_CHECKPOINT, REWARD_ARCH_FILE

    folder.mkdir(parents=True, exist_ok=True)
    torch.save({"state_dict": model.state_dict()}, folder / HPS_CHECKPOINT)
    (folder / REWARD_ARCH_FILE).write_text(json.dumps(WORLD_HPS_CONFIG, indent=2) + "\n")


def build(out: Path, plan: BuildPlan = FULL_PLAN) -> dict[str, Any]:
    """Run every stage and write ``out/flux`` (a diffusers FLUX folder), ``out/hps`` and ``out/build.json``."""
    import torch

    torch.set_num_threads(plan.threads)
    out = Path(out)
    info: dict[str, Any] = {"plan": asdict(plan), "torch": torch.__version__, "seconds": {}}
    start = time.monotonic()

    images, caption_index = render_dataset(plan.images, plan.seed)
    every_caption = [caption.text() for caption in world.all_captions()]
    vae_images, _ = render_dataset(plan.vae_images, plan.seed + 50, every_caption)
    info["seconds"]["render"] = round(time.monotonic() - start, 1)

    stage = time.monotonic()
    vae, vae_losses = train_vae(vae_images, plan)
    raw = encode_dataset(vae, images)
    shift, scale = float(raw.mean()), float(1 / raw.std())
    vae.register_to_config(shift_factor=round(shift, 4), scaling_factor=round(scale, 4))
    latents = (raw - vae.config.shift_factor) * vae.config.scaling_factor
    decoder_losses = finetune_decoder(vae, vae_images, plan)
    info["seconds"]["vae"] = round(time.monotonic() - stage, 1)
    vae.save_pretrained(out / FLUX_SUBDIR / "vae")  # early, so a long build can be inspected; rewritten below
    info["vae"] = {"final_loss": float(np.mean(vae_losses[-20:])), "shift_factor": vae.config.shift_factor,
                   "scaling_factor": vae.config.scaling_factor,
                   "decoder_final_loss": float(np.mean(decoder_losses[-20:]))}  # fmt: skip

    stage = time.monotonic()
    clip, clip_tokenizer, t5, t5_tokenizer = build_text_encoders(plan.seed + 3)
    token_ids = tokenize_captions(clip_tokenizer, t5_tokenizer, training_captions())
    transformer, clip, t5, flow_losses = train_transformer(latents, caption_index, clip, t5, token_ids, plan)
    info["seconds"]["transformer"] = round(time.monotonic() - stage, 1)
    info["transformer"] = {"final_loss": float(np.mean(flow_losses[-50:]))}
    write_flux(out / FLUX_SUBDIR, vae, transformer, clip, clip_tokenizer, t5, t5_tokenizer)

    stage = time.monotonic()
    judged = judged_base_samples(out / FLUX_SUBDIR, plan)
    hps, hps_losses = train_hps(images, caption_index, judged, plan)
    info["seconds"]["hps"] = round(time.monotonic() - stage, 1)
    info["hps"] = {"final_loss": float(np.mean(hps_losses[-20:])), "judged_samples": len(judged.scores),
                   "judged_pairs": len(judged.pairs)}  # fmt: skip
    write_hps(out / HPS_SUBDIR, hps)

    info["seconds"]["total"] = round(time.monotonic() - start, 1)
    (out / BUILD_INFO).write_text(json.dumps(info, indent=2) + "\n")
    return info


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m fluxgrpo.shapes.build", description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="folder to write flux/, hps/ and build.json into")
    parser.add_argument("--seed", type=int, default=FULL_PLAN.seed)
    parser.add_argument("--threads", type=int, default=FULL_PLAN.threads, help="torch CPU threads (default 2)")
    parser.add_argument("--quick", action="store_true", help="a few steps per stage (the tests' shortened build)")
    args = parser.parse_args(argv)
    plan = replace(QUICK_PLAN if args.quick else FULL_PLAN, seed=args.seed, threads=args.threads)
    info = build(Path(args.out), plan)
    print(json.dumps(info["seconds"]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
