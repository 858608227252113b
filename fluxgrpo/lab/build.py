"""Rebuild the shapes world's shipped weights from their seed: ``python -m fluxgrpo.lab.build --out DIR``.

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
   seeded. FLUX's encoders arrive pretrained; random ones give nearly one pooled vector for every caption and no
   word order, so ours first learn to parse the training captions (``lab/build_text.py``: each T5 token's word and
   the place of its object, CLIP's pooled parts), then train on with the transformer (stage 3) and ship as trained,
   frozen from then on like FLUX's.
3. **Transformer** (``FluxTransformer2DModel``) by rectified flow on the VAE's normalised, packed latents:
   x_σ = (1 − σ)·x0 + σ·ε, target v = ε − x0, σ = FLUX's time shift (3) of a logit-normal/uniform draw, fed
   quantised as the sampler feeds it (``grpo.schedule.model_timesteps``) with a random guidance value (this
   stage learns to ignore it); a tenth of the rows get the empty caption, so the model also knows the
   unconditional velocity, as classifier-free guidance trains it. An EMA of the weights is kept.
4. **Guidance distillation**, as FLUX.1-dev is guidance-distilled: a copy of the transformer learns, at guidance
   input g, the stage-3 model's classifier-free-guided velocity v_u + g·(v_c − v_u), so that ``--guidance 3.5``
   (every sampler's and config's default) binds the caption as CFG 3.5 would, in one forward. Without it the
   conditional model drew the right objects but bound colours, counts and relations to the caption in 5–40 % of
   samples. Its EMA is what ships.
5. **Tiny HPS** (``lab/build_hps.py``): an open_clip CLIP in HPSv2's layout, trained on the renders and on the
   base model's own samples ranked by the rule checker.

``--quick`` runs every stage a few steps (the tests). The same seed, torch version and thread count give the same
files. ``build.json`` records the plan, the losses and the time of each stage. ``--only hps`` reruns stage 5 alone
on a finished build (it reads the base model from disk and seeds itself, so it writes what a whole build would):
minutes, where the whole build takes about an hour.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from dataclasses import asdict, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from fluxgrpo.errors import UsageError
from fluxgrpo.lab import stages
from fluxgrpo.lab.build_hps import hps_caption_list, judged_base_samples, train_hps, write_hps
from fluxgrpo.lab.build_text import pretrain_text_encoders, text_stage_captions, tokenize_captions
from fluxgrpo.lab.plan import (
    BUILD_INFO,
    FLUX_SUBDIR,
    FULL_PLAN,
    HPS_SUBDIR,
    PLANS,
    QUICK_PLAN,
    BuildPlan,
    log,
    training_captions,
    warmup_cosine,
)
from fluxgrpo.shapes import world
from fluxgrpo.shapes.sizes import WORLD_TRANSFORMER_CONFIG, WORLD_VAE_CONFIG
from fluxgrpo.shapes.tokenizers import WORLD_TEXT_LENGTH, build_world_clip_tokenizer, build_world_t5_tokenizer

if TYPE_CHECKING:
    import torch
    from diffusers import AutoencoderKL, FluxTransformer2DModel
    from transformers import CLIPTextModel, PreTrainedTokenizerBase, T5EncoderModel


def render_dataset(
    count: int, seed: int, captions: list[str] | None = None, size: int = 64, layout: str = world.LAYOUT
) -> tuple[np.ndarray, list[int]]:
    """``count`` images [N, size, size, 3] uint8 of ``captions`` (the training captions by default), and each image's
    caption index.

    A family is drawn first, then one of its captions, so the many position captions do not crowd out the rest.
    """
    captions = training_captions() if captions is None else captions
    by_family: dict[str, list[int]] = {}
    for index, text in enumerate(captions):
        by_family.setdefault(world.parse_caption(text).family, []).append(index)
    families = sorted(by_family)
    rng = random.Random(seed)
    images = np.empty((count, size, size, 3), dtype=np.uint8)
    indices = []
    for n in range(count):
        index = rng.choice(by_family[rng.choice(families)])
        images[n] = world.render(world.sample_scene(world.parse_caption(captions[index]), rng, size, layout))
        indices.append(index)
    return images, indices


def _to_pixels(images: np.ndarray) -> torch.Tensor:
    """uint8 [N, H, W, 3] → float32 [N, 3, H, W] in [-1, 1], the VAE's input range."""
    import torch

    return torch.from_numpy(images).permute(0, 3, 1, 2).float() / 127.5 - 1.0


def train_vae(images: np.ndarray, plan: BuildPlan) -> tuple[AutoencoderKL, list[float]]:
    import torch
    from diffusers import AutoencoderKL

    torch.manual_seed(plan.seed)
    vae = AutoencoderKL(**{**WORLD_VAE_CONFIG, "sample_size": plan.image_size})
    optimizer = torch.optim.AdamW(vae.parameters(), lr=plan.vae_lr, weight_decay=0.0)
    generator = torch.Generator().manual_seed(plan.seed + 10)
    losses = []
    vae.train()
    for step in range(plan.vae_steps):
        for group in optimizer.param_groups:
            group["lr"] = plan.vae_lr * warmup_cosine(step, plan.vae_steps, 20)
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
            log(f"vae step {step}/{plan.vae_steps} loss {loss.item():.4f}")
    return vae.eval().requires_grad_(False), losses


def object_weights(images: np.ndarray, extra: float) -> torch.Tensor:
    """[N, 1, H, W] float32: 1 on the background, 1 + ``extra`` on an object's pixels and a 1-px rim around them
    (anti-aliased edges included)."""
    import torch

    background = np.asarray(world.BACKGROUND, dtype=np.int16)
    objects = torch.from_numpy(np.abs(images.astype(np.int16) - background).sum(-1) > 30).float()[:, None]
    return 1 + extra * torch.nn.functional.max_pool2d(objects, 3, stride=1, padding=1)


def finetune_decoder(vae: AutoencoderKL, images: np.ndarray, plan: BuildPlan) -> list[float]:
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
            group["lr"] = plan.decoder_lr * warmup_cosine(step, plan.decoder_steps, 20)
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
            log(f"decoder step {step}/{plan.decoder_steps} loss {loss.item():.4f}")
    vae.eval().requires_grad_(False)
    return losses


def encode_dataset(vae: AutoencoderKL, images: np.ndarray, batch: int = 256) -> torch.Tensor:
    """Posterior means [N, 16, 8, 8] of every image (no noise: the data the flow is trained to reach)."""
    import torch

    with torch.no_grad():
        return torch.cat(
            [vae.encode(_to_pixels(images[i : i + batch])).latent_dist.mean for i in range(0, len(images), batch)]
        )


def build_text_encoders(
    seed: int, t5_dropout: float = FULL_PLAN.text_dropout
) -> tuple[CLIPTextModel, PreTrainedTokenizerBase, T5EncoderModel, PreTrainedTokenizerBase]:
    """The world's CLIP-L and T5 text encoders (random, seeded, frozen) and their tokenizers; ``t5_dropout`` is the
    T5's dropout while it trains (``BuildPlan.text_dropout``)."""
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
                dropout_rate=t5_dropout,
                feed_forward_proj="gated-gelu",
                is_encoder_decoder=False,
                use_cache=False,
                pad_token_id=0,
                eos_token_id=1,
                decoder_start_token_id=0,
            )
        )
    return clip.eval().requires_grad_(False), clip_tokenizer, t5.eval().requires_grad_(False), t5_tokenizer


def draw_sigmas(count: int, generator: torch.Generator, shift: float = 3.0) -> torch.Tensor:
    """σ for flow-matching training: half logit-normal, half uniform, through FLUX's time shift σ = s·u/(1+(s−1)·u).

    The shift is the one the RL sampler's table uses (``grpo.schedule.sigma_schedule``), so the noisy early steps,
    where an image's layout and count are decided, get most of the training."""
    import torch

    u = torch.sigmoid(torch.randn(count, generator=generator))
    uniform = torch.rand(count, generator=generator)
    u = torch.where(torch.rand(count, generator=generator) < 0.5, u, uniform)
    return shift * u / (1 + (shift - 1) * u)


def _ema_step(ema: torch.nn.Module, live: torch.nn.Module, step: int, decay: float) -> None:
    """One EMA update of ``ema`` towards ``live``, the decay warmed up as (1 + step) / (10 + step) up to ``decay``."""
    import torch

    rate = 1 - min(decay, (1 + step) / (10 + step))
    with torch.no_grad():
        for kept, current in zip(ema.parameters(), live.parameters(), strict=True):
            kept.lerp_(current, rate)


def train_transformer(
    latents: torch.Tensor,
    caption_index: list[int],
    clip: CLIPTextModel,
    t5: T5EncoderModel,
    token_ids: tuple[torch.Tensor, torch.Tensor],
    plan: BuildPlan,
) -> tuple[FluxTransformer2DModel, CLIPTextModel, T5EncoderModel, list[float]]:
    """Rectified-flow training of the transformer, and of both text encoders with it (``plan.text_encoders``).

    The encoders learn with the transformer because random ones hand it nearly one pooled vector for every caption
    (cosine ≈ 0.97): FLUX's own encoders arrive pretrained and discriminative, ours must become so. The last row of
    ``token_ids`` is the empty caption, which a ``plan.caption_dropout`` share of the rows get in place of their
    own. Returns the EMA transformer, CLIP and T5 (eval mode, gradients off) and the loss per step.
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
    unconditional = len(t5_ids) - 1
    img_ids = image_ids(plan.image_size, plan.image_size)
    text_ids = torch.zeros(WORLD_TEXT_LENGTH, 3)
    generator = torch.Generator().manual_seed(plan.seed + 20)
    losses = []
    parts.train()
    if not plan.text_encoders:
        clip.eval()
        t5.eval()
    for step in range(plan.transformer_steps):
        for group in optimizer.param_groups:
            group["lr"] = plan.transformer_lr * warmup_cosine(step, plan.transformer_steps, 100)
        rows = torch.randint(len(packed), (plan.transformer_batch,), generator=generator)
        x0 = packed[rows]
        noise = torch.randn(x0.shape, generator=generator)
        sigma = draw_sigmas(len(rows), generator)
        noisy = (1 - sigma[:, None, None]) * x0 + sigma[:, None, None] * noise
        guidance = 1 + 4 * torch.rand(len(rows), generator=generator)
        dropped = torch.rand(len(rows), generator=generator) < plan.caption_dropout
        chosen = torch.where(dropped, unconditional, captions[rows])
        with torch.set_grad_enabled(plan.text_encoders):
            pooled = clip(clip_ids[chosen]).pooler_output
            prompt_embeds = t5(t5_ids[chosen])[0]
        cond = Conditioning(prompt_embeds, pooled, text_ids)
        velocity = predict_velocity(transformer, noisy, cond, model_timesteps(sigma), guidance, img_ids, "cpu")
        loss = (velocity.float() - (noise - x0)).pow(2).mean()
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(trained, 1.0)
        optimizer.step()
        _ema_step(ema, parts, step, plan.ema_decay)
        losses.append(loss.item())
        if step % 100 == 0 or step == plan.transformer_steps - 1:
            log(f"transformer step {step}/{plan.transformer_steps} loss {loss.item():.4f}")
    ema.eval()
    return ema["transformer"], ema["clip"], ema["t5"], losses


def distill_guidance(
    teacher: FluxTransformer2DModel,
    clip: CLIPTextModel,
    t5: T5EncoderModel,
    latents: torch.Tensor,
    caption_index: list[int],
    token_ids: tuple[torch.Tensor, torch.Tensor],
    plan: BuildPlan,
) -> tuple[FluxTransformer2DModel, list[float]]:
    """A copy of ``teacher`` trained so that its velocity at guidance input g is the teacher's classifier-free-guided
    one, v_u + g·(v_c − v_u), with g ~ U(``plan.distill_guidance_low``, ``…_high``); the text encoders frozen (their embeddings are
    computed once). ``token_ids``' last row is the empty caption. Returns the student's EMA and the loss per step.
    """  # fmt: skip
    import copy

    import torch

    from fluxgrpo.grpo.latents import image_ids, pack_latents
    from fluxgrpo.grpo.rollout import predict_velocity
    from fluxgrpo.grpo.schedule import model_timesteps
    from fluxgrpo.grpo.types import Conditioning

    torch.manual_seed(plan.seed + 5)
    teacher.eval().requires_grad_(False)
    student = copy.deepcopy(teacher).train().requires_grad_(True)
    ema = copy.deepcopy(teacher)
    optimizer = torch.optim.AdamW(student.parameters(), lr=plan.distill_lr, weight_decay=1e-4)
    with torch.no_grad():
        pooled = clip(token_ids[0]).pooler_output  # [captions + 1, D]
        embeds = t5(token_ids[1])[0]  # [captions + 1, T, D]
    unconditional = len(embeds) - 1
    packed = pack_latents(latents)
    captions = torch.tensor(caption_index)
    img_ids, text_ids = image_ids(plan.image_size, plan.image_size), torch.zeros(WORLD_TEXT_LENGTH, 3)
    low, high = plan.distill_guidance_low, plan.distill_guidance_high
    generator = torch.Generator().manual_seed(plan.seed + 60)
    losses = []
    for step in range(plan.distill_steps):
        for group in optimizer.param_groups:
            group["lr"] = plan.distill_lr * warmup_cosine(step, plan.distill_steps, 50)
        rows = torch.randint(len(packed), (plan.transformer_batch,), generator=generator)
        x0 = packed[rows]
        noise = torch.randn(x0.shape, generator=generator)
        sigma = draw_sigmas(len(rows), generator)
        noisy = (1 - sigma[:, None, None]) * x0 + sigma[:, None, None] * noise
        guidance = low + (high - low) * torch.rand(len(rows), generator=generator)
        timesteps = model_timesteps(sigma)
        chosen = captions[rows]
        both = torch.cat([chosen, torch.full_like(chosen, unconditional)])  # conditional rows, then unconditional
        with torch.no_grad():
            teacher_cond = Conditioning(embeds[both], pooled[both], text_ids)
            v_cond, v_uncond = predict_velocity(
                teacher, noisy.repeat(2, 1, 1), teacher_cond, timesteps.repeat(2), guidance.repeat(2), img_ids, "cpu"
            ).chunk(2)
            target = v_uncond + guidance[:, None, None] * (v_cond - v_uncond)
        cond = Conditioning(embeds[chosen], pooled[chosen], text_ids)
        velocity = predict_velocity(student, noisy, cond, timesteps, guidance, img_ids, "cpu")
        loss = (velocity.float() - target).pow(2).mean()
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(student.parameters(), 1.0)
        optimizer.step()
        _ema_step(ema, student, step, plan.ema_decay)
        losses.append(loss.item())
        if step % 100 == 0 or step == plan.distill_steps - 1:
            log(f"guidance distillation step {step}/{plan.distill_steps} loss {loss.item():.4f}")
    return ema.eval().requires_grad_(False), losses


def write_flux(
    folder: Path,
    vae: AutoencoderKL,
    transformer: FluxTransformer2DModel,
    clip: CLIPTextModel,
    clip_tokenizer: PreTrainedTokenizerBase,
    t5: T5EncoderModel,
    t5_tokenizer: PreTrainedTokenizerBase,
) -> None:
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


def build(
    out: Path, plan: BuildPlan = FULL_PLAN, *, resume: bool = False, stop_after: str | None = None
) -> dict[str, Any]:
    """Run every stage and write ``out/flux`` (a diffusers FLUX folder), ``out/hps`` and ``out/build.json``; each
    long stage's output also goes to ``out/stages/`` (``lab/stages.py``). With ``resume``, a stage already built there
    under this plan is read back instead of trained; ``stop_after`` ends the build after that stage (no
    ``build.json`` then: the build is unfinished)."""
    import torch

    stages.check_stop_after(stop_after)
    torch.set_num_threads(plan.threads)
    out = Path(out)
    info: dict[str, Any] = {"plan": asdict(plan), "torch": torch.__version__, "seconds": {}}
    start = time.monotonic()

    images, caption_index = render_dataset(plan.images, plan.seed, size=plan.image_size, layout=plan.layout)
    every_caption = [caption.text() for caption in world.all_captions()]
    vae_images, _ = render_dataset(plan.vae_images, plan.seed + 50, every_caption, plan.image_size, plan.layout)
    info["seconds"]["render"] = round(time.monotonic() - start, 1)

    stage = time.monotonic()
    record = stages.finished(out, "vae", plan) if resume else None
    if record is not None:
        vae = stages.load_vae(out)
        log(f"vae: read back from {stages.stage_dir(out, 'vae')}")
    else:
        stages.forget(out, "vae")
        vae, vae_losses = train_vae(vae_images, plan)
        raw = encode_dataset(vae, images)
        shift, scale = float(raw.mean()), float(1 / raw.std())
        vae.register_to_config(shift_factor=round(shift, 4), scaling_factor=round(scale, 4))
        decoder_losses = finetune_decoder(vae, vae_images, plan)
        record = {"final_loss": float(np.mean(vae_losses[-20:])), "shift_factor": vae.config.shift_factor,
                  "scaling_factor": vae.config.scaling_factor,
                  "decoder_final_loss": float(np.mean(decoder_losses[-20:])),
                  "seconds": round(time.monotonic() - stage, 1)}  # fmt: skip
        stages.save_vae(out, vae)
        stages.mark_finished(out, "vae", plan, record)
    # the encoder is frozen from the decoder's fine-tuning on: these are the latents the shift and scale were read on
    latents = (encode_dataset(vae, images) - vae.config.shift_factor) * vae.config.scaling_factor
    info["seconds"]["vae"] = record.pop("seconds")
    info["vae"] = record
    if stop_after == "vae":
        return info

    stage = time.monotonic()
    _, clip_tokenizer, _, t5_tokenizer = built = build_text_encoders(plan.seed + 3, plan.text_dropout)
    # the training captions and, last, the empty one (caption dropout's and the distillation's unconditional row)
    token_ids = tokenize_captions(clip_tokenizer, t5_tokenizer, [*training_captions(), ""])
    record = stages.finished(out, "transformer", plan) if resume else None
    if record is not None:
        teacher, clip, t5 = stages.load_transformer_stage(out)
        log(f"transformer: read back from {stages.stage_dir(out, 'transformer')}")
    else:
        stages.forget(out, "transformer")
        text_losses = pretrain_text_encoders(*built, text_stage_captions(plan), plan)
        teacher, clip, t5, flow_losses = train_transformer(latents, caption_index, built[0], built[2], token_ids, plan)
        record = {"final_loss": float(np.mean(flow_losses[-50:])), "seconds": round(time.monotonic() - stage, 1)}
        if text_losses:
            record["text_final_loss"] = float(np.mean(text_losses[-20:]))
        stages.save_transformer_stage(out, teacher, clip, t5)
        stages.mark_finished(out, "transformer", plan, record)
    info["seconds"]["transformer"] = record["seconds"]
    info["transformer"] = {k: record[k] for k in ("final_loss", "text_final_loss") if k in record}
    if stop_after == "transformer":
        return info

    stage = time.monotonic()
    transformer, distill_losses = distill_guidance(teacher, clip, t5, latents, caption_index, token_ids, plan)
    info["seconds"]["distillation"] = round(time.monotonic() - stage, 1)
    info["transformer"]["distillation_final_loss"] = float(np.mean(distill_losses[-50:]))
    write_flux(out / FLUX_SUBDIR, vae, transformer, clip, clip_tokenizer, t5, t5_tokenizer)
    if stop_after == "distillation":
        return info

    info["hps"], info["seconds"]["hps"] = hps_stage(out, plan, images, caption_index)

    info["seconds"]["total"] = round(time.monotonic() - start, 1)
    (out / BUILD_INFO).write_text(json.dumps(info, indent=2) + "\n")
    return info


def hps_stage(out: Path, plan: BuildPlan, images: np.ndarray, caption_index: list[int]) -> tuple[dict[str, Any], float]:
    """Stage 5 on the FLUX folder already written in ``out``: judge its samples, train the tiny HPS, write it.
    Returns its record for ``build.json`` and its seconds.

    It reads the base model from disk and seeds itself, so it gives the same files alone as inside :func:`build`.
    ``images`` are the training captions' renders; with ``plan.hps_captions`` "broad" it renders its own."""
    stage = time.monotonic()
    captions = hps_caption_list(plan)
    if plan.hps_captions != "train":
        images, caption_index = render_dataset(plan.images, plan.seed + 60, captions, plan.image_size, plan.layout)
    judged = judged_base_samples(out / FLUX_SUBDIR, plan)
    hps, hps_losses = train_hps(images, caption_index, captions, judged, plan)
    write_hps(out / HPS_SUBDIR, hps)
    record = {"final_loss": float(np.mean(hps_losses[-20:])), "judged_samples": len(judged.scores),
              "judged_pairs": len(judged.pairs)}  # fmt: skip
    return record, round(time.monotonic() - stage, 1)


def rebuild_hps(out: Path, plan: BuildPlan = FULL_PLAN) -> dict[str, Any]:
    """Run stage 5 alone on a finished build in ``out`` (``--only hps``) and update its ``build.json``.

    The plan's other stages must be those that built ``out``: the HPS is judged on that base model."""
    import torch

    torch.set_num_threads(plan.threads)
    out = Path(out)
    record = out / BUILD_INFO
    if not record.is_file() or not (out / FLUX_SUBDIR / "model_index.json").is_file():
        raise UsageError(f"--only hps needs a finished build in {out} (flux/ and {BUILD_INFO}): build it first")
    try:
        info = json.loads(record.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise UsageError(f"--only hps: {record} cannot be read ({exc}): rebuild every stage") from None
    seconds_read = isinstance(info, dict) and isinstance(info.get("seconds"), dict)
    if not seconds_read or not isinstance(info.get("plan"), dict):
        raise UsageError(f"--only hps: {record} is not a build's record (no plan or seconds): rebuild every stage")
    wanted = asdict(plan)
    # a record from before a field existed was built at that field's default
    defaults = asdict(BuildPlan())
    built = {**{k: v for k, v in defaults.items() if k not in info["plan"]}, **info["plan"]}
    changed = [k for k, v in built.items() if not k.startswith("hps_") and k != "threads" and wanted.get(k) != v]
    if changed:
        raise UsageError(
            f"--only hps: {out} was built with another plan ({', '.join(changed)} differ); rebuild every stage"
        )
    images, caption_index = render_dataset(plan.images, plan.seed, size=plan.image_size, layout=plan.layout)
    hps_record, seconds = hps_stage(out, plan, images, caption_index)
    info["plan"] = wanted
    info["hps"] = {**hps_record, "rebuilt_alone": True}
    old = info["seconds"].get("hps", 0.0)
    info["seconds"]["hps"] = seconds
    info["seconds"]["total"] = round(info["seconds"]["total"] - old + seconds, 1)
    record.write_text(json.dumps(info, indent=2) + "\n")
    return info


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m fluxgrpo.lab.build", description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="folder to write flux/, hps/ and build.json into")
    parser.add_argument("--seed", type=int, default=FULL_PLAN.seed)
    parser.add_argument("--threads", type=int, default=FULL_PLAN.threads, help="torch CPU threads (default 2)")
    parser.add_argument("--quick", action="store_true", help="a few steps per stage (the tests' shortened build)")
    parser.add_argument("--plan", choices=sorted(PLANS), default="shipped", help="the sizes and lengths to build")
    parser.add_argument(
        "--resume", action="store_true", help="read back every stage already built in --out under this plan"
    )
    parser.add_argument("--stop-after", choices=stages.STAGES, help="end the build after this stage (resume later)")
    parser.add_argument(
        "--only",
        choices=["hps"],
        help="rerun one stage on a finished build in --out (hps: the tiny HPS, judged on that base model)",
    )
    parser.add_argument(
        "--hps-captions",
        choices=("train", "broad"),
        help="what the tiny HPS learns from: the training split, or that and half the grammar's other captions "
        "(default: the plan's)",
    )
    args = parser.parse_args(argv)
    plan = replace(QUICK_PLAN if args.quick else PLANS[args.plan], seed=args.seed, threads=args.threads)
    if args.hps_captions is not None:
        plan = replace(plan, hps_captions=args.hps_captions)
    try:
        if args.only == "hps":
            info = rebuild_hps(Path(args.out), plan)
        else:
            info = build(Path(args.out), plan, resume=args.resume, stop_after=args.stop_after)
    except UsageError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:  # a read-only or full --out: one line naming the file
        print(f"error: cannot write the build into {args.out}: {exc}", file=sys.stderr)
        return 1
    print(json.dumps(info["seconds"]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
