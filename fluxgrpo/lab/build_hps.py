"""Stage 5 of the shapes world's builder: the tiny HPS, an open_clip CLIP in HPSv2's layout.

Trained contrastively on (render, caption) pairs with one hard negative caption per image (a colour, shape, count or
relation changed) and, as HPSv2 was fine-tuned on people's rankings of generated images, with HPSv2's ranking loss on
pairs of the base model's own samples of training prompts ranked by the rule checker; through HPSv2's own
preprocessing; written as ``HPS_v2.1_compressed.pt`` + ``open_clip_config.json``.
"""

from __future__ import annotations

import json
import math
import random
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from fluxgrpo.lab.plan import (
    WORLD_HPS_CONFIG,
    BuildPlan,
    log,
    other_captions_split,
    training_captions,
    warmup_cosine,
)
from fluxgrpo.shapes import world

if TYPE_CHECKING:
    import torch
    from open_clip.model import CLIP


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


def hps_caption_list(plan: BuildPlan) -> list[str]:
    """The captions the tiny HPS learns from (``plan.hps_captions``): the training split, or ("broad") the training
    split and the half of the grammar's other captions that ``plan.agreement_captions`` leaves out."""
    if plan.hps_captions == "broad":
        return [*training_captions(), *other_captions_split()[0]]
    return training_captions()


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
    """``plan.hps_judged_prompts`` prompts of :func:`hps_caption_list` × ``plan.hps_judged_per_prompt`` base samples,
    checked."""
    from fluxgrpo.lab.measure import sample_images
    from fluxgrpo.shapes.checker import check

    captions = hps_caption_list(plan)
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
    images: np.ndarray, caption_index: list[int], captions: list[str], judged: JudgedSamples, plan: BuildPlan
) -> tuple[CLIP, list[float]]:
    """The tiny open_clip CLIP: contrastive (render, caption) training with hard negatives (image ``i`` shows
    ``captions[caption_index[i]]``), plus HPSv2's ranking loss on the judged base samples (the better image of a pair
    gets the higher ``logit_scale · cos``, a softmax over the pair as HPSv2's training computes it). Returns it in
    eval mode."""
    import open_clip
    import torch
    import torch.nn.functional as F
    from open_clip.model import CLIP

    from fluxgrpo.rewards.base import normalize_clip
    from fluxgrpo.rewards.hpsv2 import resize_longest_and_pad
    from fluxgrpo.rewards.open_clip_model import register_open_clip_config

    tokenizer = open_clip.get_tokenizer(register_open_clip_config(WORLD_HPS_CONFIG))
    torch.manual_seed(plan.seed + 2)
    model = CLIP(**json.loads(json.dumps(WORLD_HPS_CONFIG)))
    optimizer = torch.optim.AdamW(model.parameters(), lr=plan.hps_lr, weight_decay=0.0)
    by_caption: dict[int, list[int]] = {}
    for row, index in enumerate(caption_index):
        by_caption.setdefault(index, []).append(row)
    rng = random.Random(plan.seed + 30)
    size = WORLD_HPS_CONFIG["vision_cfg"]["image_size"]

    def prepare(batch: np.ndarray) -> torch.Tensor:  # HPSv2's own preprocessing, on uint8 [n, 64, 64, 3]
        pixels = torch.from_numpy(batch).permute(0, 3, 1, 2).float() / 255.0
        return normalize_clip(resize_longest_and_pad(pixels, size))

    def ranking_loss(
        model: CLIP, tokenizer: Callable[[list[str]], torch.Tensor], judged: JudgedSamples, pairs: list[tuple[int, int]]
    ) -> torch.Tensor:
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
            group["lr"] = plan.hps_lr * warmup_cosine(step, plan.hps_steps, 50)
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
            log(f"hps step {step}/{plan.hps_steps} loss {loss.item():.4f}")
    return model.eval().requires_grad_(False), losses


def write_hps(folder: Path, model: CLIP) -> None:
    import torch

    from fluxgrpo.weights.layout import HPS_CHECKPOINT, REWARD_ARCH_FILE

    folder.mkdir(parents=True, exist_ok=True)
    torch.save({"state_dict": model.state_dict()}, folder / HPS_CHECKPOINT)
    (folder / REWARD_ARCH_FILE).write_text(json.dumps(WORLD_HPS_CONFIG, indent=2) + "\n")
