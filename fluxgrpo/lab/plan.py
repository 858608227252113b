"""The shapes world builder's plan: the tiny HPS's size and the length of every stage (the FLUX parts' sizes are
``shapes/sizes.py``'s).

Read by the builder's stages (``lab/build.py``: VAE, text encoders, transformer, guidance distillation;
``lab/build_hps.py``: the tiny HPS) and by what they share: the log line, the learning-rate schedule and the
training captions.
"""

from __future__ import annotations

import math
import random
import sys
import time
from dataclasses import dataclass, replace
from typing import Any

from fluxgrpo.shapes import world
from fluxgrpo.shapes.sizes import BUILD_INFO, FLUX_SUBDIR, HPS_SUBDIR

__all__ = ["BUILD_INFO", "FLUX_SUBDIR", "HPS_SUBDIR"]


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
    # The rendered (and generated) images' side: 64 gives the transformer a 4×4 grid of tokens (16 px each), 128 an
    # 8×8 grid, the objects then spanning 2-3 tokens (the checker reads both sizes).
    image_size: int = 64
    # Where the renders place objects (``world.LAYOUTS``): one object to a quadrant since issue 48's rebuild.
    layout: str = "quadrants"
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
    # Half the first world's 8,000: the quadrant world is easier to draw, and a shorter-trained model moved further
    # under fine-tuning on its own samples (fluxgrpo/docs/results/shapes-world.md).
    transformer_steps: int = 4000
    transformer_batch: int = 48
    transformer_lr: float = 1e-3
    ema_decay: float = 0.998
    # A text stage first (``lab/build_text.py``: the encoders learn to parse the captions; 0 skips it, as the builds
    # before 2026-12-06 14:00 did), then the encoders stay as it left them (False) or train on with the transformer
    # (True, as those builds' did: they lost word order and the transformer ignored the relation words).
    text_steps: int = 600
    text_encoders: bool = False
    # T5's dropout while it trains: at transformers' default 0.1 the text stage did not learn word order.
    text_dropout: float = 0.0
    text_batch: int = 64
    text_lr: float = 3e-3
    text_captions: str = "train"  # what the text stage reads: "train" (the training split) or "grammar" (every caption)
    # With "grammar": how many times as often the stage draws a training caption as any other caption of the grammar
    # (1: every caption alike; the parsed-grammar build read novel pairings better but RL on the training captions
    # moved its held-out captions less).
    text_train_weight: int = 1
    # The share of transformer rows trained on the empty caption, as classifier-free guidance trains the
    # unconditional velocity the distillation below reads.
    caption_dropout: float = 0.1
    # Guidance distillation (FLUX.1-dev is guidance-distilled): a copy learns, at guidance input g, the teacher's
    # classifier-free-guided velocity v_u + g·(v_c − v_u), g drawn uniformly from [low, high].
    distill_steps: int = 1500
    distill_lr: float = 3e-4
    distill_guidance_low: float = 1.0
    distill_guidance_high: float = 6.0
    hps_steps: int = 800
    hps_batch: int = 96  # distinct captions per step, one image each
    hps_lr: float = 2e-3
    hps_judged_prompts: int = 240  # training prompts whose base samples the checker ranks for HPS's ranking loss
    hps_judged_per_prompt: int = 8
    hps_judged_steps: int = 12  # sampler steps, as the shapes configs evaluate
    hps_pair_batch: int = 64
    # The captions the tiny HPS learns from (its renders and its judged base samples): "train" (the training split)
    # or "broad" (and half the grammar's other captions: a preference model has seen far more captions than the
    # policy trains on; the other half and the held-out evaluation's stay unseen, ``agreement_captions`` below,
    # where its agreement with the checker is measured).
    hps_captions: str = "train"
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
    text_steps=2,
    text_batch=4,
    distill_steps=2,
    hps_steps=2,
    hps_batch=8,
    hps_judged_prompts=2,
    hps_judged_per_prompt=2,
    hps_judged_steps=2,
    hps_pair_batch=4,
)


# The quadrant world shipped before the text stage (2026-12-06 08:30): its text encoders learnt from the flow loss
# alone, with T5's dropout on, and its transformer ignored the relation words.
QUADRANT_PLAN = replace(FULL_PLAN, text_steps=0, text_encoders=True, text_dropout=0.1)


# Named plans (``--plan``). ``quadrant``: the world shipped before the text stage. ``parsed-grammar``: the text stage
# reads every caption of the grammar, not the training split's alone (a better base that RL moved less). ``free``:
# the first shipped world (objects anywhere, 8,000 flow steps, no text stage). ``grid8``: 128² images so the
# transformer sees its objects on an 8×8 grid of tokens instead of 4×4 (about 2.5 h on 2 cores: build it in sittings
# with --stop-after and --resume).
PLANS = {
    "shipped": FULL_PLAN,
    "quadrant": QUADRANT_PLAN,
    "parsed-grammar": replace(FULL_PLAN, text_captions="grammar"),
    "free": replace(QUADRANT_PLAN, layout="free", transformer_steps=8000),
    "grid8": replace(FULL_PLAN, image_size=128),
}


_START = time.monotonic()


def log(message: str) -> None:
    """Progress to stderr: stdout carries the lab commands' one JSON document."""
    print(f"[{time.monotonic() - _START:7.1f}s] {message}", file=sys.stderr, flush=True)


def training_captions() -> list[str]:
    return list(world.split().train)


AGREEMENT_SEED = 48  # issue 48's: the split of the grammar's other captions between the HPS and its measurement


def other_captions_split() -> tuple[list[str], list[str]]:
    """The grammar's captions outside the training split and the held-out evaluation, shuffled by
    :data:`AGREEMENT_SEED` and halved: (what a "broad" HPS learns from, what no HPS learns from)."""
    kept_apart = {*world.split().train, *world.prompt_set("shapes-heldout")}
    others = sorted(text for text in (c.text() for c in world.all_captions()) if text not in kept_apart)
    random.Random(AGREEMENT_SEED).shuffle(others)
    half = len(others) // 2
    return others[half:], others[:half]


def agreement_captions() -> list[str]:
    """Captions no HPS the builder trains learns from (the held-out evaluation's and half the grammar's other
    captions, about 170): where ``lab.measure --agreement wide`` measures an HPS against the checker (±0.03 on the
    within-caption mean)."""
    return [*world.prompt_set("shapes-heldout"), *other_captions_split()[1]]


def warmup_cosine(step: int, total: int, warmup: int) -> float:
    """The learning-rate factor of every stage: linear warm-up, then cosine down to 0.1."""
    if step < warmup:
        return (step + 1) / warmup
    return 0.5 * (1 + math.cos(math.pi * (step - warmup) / max(1, total - warmup))) * 0.9 + 0.1
