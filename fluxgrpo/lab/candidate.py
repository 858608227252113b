"""A candidate world model, cheap enough to gate a long build: ``python -m fluxgrpo.lab.candidate --out DIR``.

Issue 48 asks for a world the loop can move, measured before the long build is spent. A candidate is the builder's
text and flow stages alone (``build_text.pretrain_text_encoders``, then ``build.train_transformer``: the transformer
trained by rectified flow on renders of the training captions, the text encoders with it or not), shortened, at a chosen image size, on the shipped VAE (an autoencoder of
the world's images: its reconstructions of 128² renders keep the checker at 1.00 strict, as at 64²), and with no
guidance distillation unless ``--distill-steps`` asks for it (then the builder's own distillation follows, as the
shipped model's did; without it the guidance input is untrained and the candidate samples conditionally). The folder it
writes is a diffusers FLUX folder, so ``python -m fluxgrpo.lab.plasticity --flux-dir DIR/flux`` reads its plasticity
and two candidates built alike compare fairly, while neither is the world a full build ships.
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

import numpy as np

from fluxgrpo.lab.build import (
    build_text_encoders,
    distill_guidance,
    encode_dataset,
    render_dataset,
    tokenize_captions,
    train_transformer,
    write_flux,
)
from fluxgrpo.lab.build_text import pretrain_text_encoders, text_stage_captions
from fluxgrpo.lab.plan import PLANS, BuildPlan, log, training_captions
from fluxgrpo.shapes.shipped import shipped_weights_dir
from fluxgrpo.shapes.sizes import FLUX_SUBDIR


def candidate(out: Path, plan: BuildPlan) -> dict[str, Any]:
    """Train ``plan``'s text and flow stages (and its guidance distillation when ``plan.distill_steps``) on the shipped
    VAE and write a FLUX folder to ``out/flux`` and its record to ``out/candidate.json``."""
    import torch
    from diffusers import AutoencoderKL

    torch.set_num_threads(plan.threads)
    start = time.monotonic()
    vae = AutoencoderKL.from_pretrained(shipped_weights_dir() / FLUX_SUBDIR / "vae").eval().requires_grad_(False)
    rendered, caption_index = render_dataset(plan.images, plan.seed, size=plan.image_size)
    latents = (encode_dataset(vae, rendered) - vae.config.shift_factor) * vae.config.scaling_factor
    log(f"candidate at {plan.image_size}²: {len(rendered)} renders encoded to {tuple(latents.shape[1:])} latents")
    clip, clip_tokenizer, t5, t5_tokenizer = build_text_encoders(plan.seed + 3, plan.text_dropout)
    token_ids = tokenize_captions(clip_tokenizer, t5_tokenizer, [*training_captions(), ""])
    pretrain_text_encoders(clip, clip_tokenizer, t5, t5_tokenizer, text_stage_captions(plan), plan)
    transformer, clip, t5, losses = train_transformer(latents, caption_index, clip, t5, token_ids, plan)
    if plan.distill_steps:
        transformer, _ = distill_guidance(transformer, clip, t5, latents, caption_index, token_ids, plan)
    write_flux(Path(out) / FLUX_SUBDIR, vae, transformer, clip, clip_tokenizer, t5, t5_tokenizer)
    record = {"plan": asdict(plan), "final_loss": float(np.mean(losses[-50:])),
              "seconds": round(time.monotonic() - start, 1)}  # fmt: skip
    (Path(out) / "candidate.json").write_text(json.dumps(record, indent=2) + "\n")
    return record


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m fluxgrpo.lab.candidate", description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--plan", choices=sorted(PLANS), default="shipped", help="the build plan it shortens")
    parser.add_argument("--image-size", type=int, choices=(64, 128), default=64)
    parser.add_argument("--steps", type=int, default=1500, help="flow-matching steps (the full build: 4000)")
    parser.add_argument("--images", type=int, default=4000, help="renders to train on (the full build: 8000)")
    parser.add_argument("--distill-steps", type=int, default=0, help="guidance distillation after (the build: 1500)")
    parser.add_argument(
        "--text-encoders",
        choices=("frozen", "trained"),
        help="after the plan's text stage: kept as they are or trained with the transformer (default: the plan's)",
    )
    parser.add_argument(
        "--text-train-weight",
        type=int,
        help="with a plan whose text stage reads the grammar: a training caption drawn this many times as often",
    )
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args(argv)
    plan = replace(
        PLANS[args.plan],
        image_size=args.image_size,
        transformer_steps=args.steps,
        images=args.images,
        distill_steps=args.distill_steps,
        threads=args.threads,
    )
    if args.text_train_weight is not None:
        plan = replace(plan, text_train_weight=args.text_train_weight)
    if args.text_encoders is not None:
        plan = replace(plan, text_encoders=args.text_encoders == "trained")
    print(json.dumps(candidate(Path(args.out), plan)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
