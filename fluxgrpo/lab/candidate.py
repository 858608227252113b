"""A candidate world model, cheap enough to gate a long build: ``python -m fluxgrpo.lab.candidate --out DIR``.

Issue 48 asks for a world the loop can move, measured before the long build is spent. A candidate is the builder's
flow stage alone (``build.train_transformer``: the transformer and the text encoders trained together by rectified
flow on renders of the training captions), shortened, at a chosen image size, on the shipped VAE (an autoencoder of
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
from dataclasses import replace
from pathlib import Path

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
from fluxgrpo.lab.plan import FULL_PLAN, log, training_captions
from fluxgrpo.shapes.shipped import shipped_weights_dir
from fluxgrpo.shapes.sizes import FLUX_SUBDIR


def candidate(
    out: Path, image_size: int, steps: int, images: int, threads: int, seed: int = 0, distill_steps: int = 0
) -> dict[str, float]:
    import torch
    from diffusers import AutoencoderKL

    torch.set_num_threads(threads)
    start = time.monotonic()
    plan = replace(
        FULL_PLAN, seed=seed, image_size=image_size, transformer_steps=steps, images=images, distill_steps=distill_steps
    )
    vae = AutoencoderKL.from_pretrained(shipped_weights_dir() / FLUX_SUBDIR / "vae").eval().requires_grad_(False)
    rendered, caption_index = render_dataset(plan.images, plan.seed, size=image_size)
    latents = (encode_dataset(vae, rendered) - vae.config.shift_factor) * vae.config.scaling_factor
    log(f"candidate at {image_size}²: {len(rendered)} renders encoded to {tuple(latents.shape[1:])} latents")
    clip, clip_tokenizer, t5, t5_tokenizer = build_text_encoders(plan.seed + 3)
    token_ids = tokenize_captions(clip_tokenizer, t5_tokenizer, [*training_captions(), ""])
    transformer, clip, t5, losses = train_transformer(latents, caption_index, clip, t5, token_ids, plan)
    if distill_steps:
        transformer, _ = distill_guidance(transformer, clip, t5, latents, caption_index, token_ids, plan)
    write_flux(Path(out) / FLUX_SUBDIR, vae, transformer, clip, clip_tokenizer, t5, t5_tokenizer)
    record = {"image_size": image_size, "steps": steps, "images": images, "distill_steps": distill_steps,
              "final_loss": float(np.mean(losses[-50:])), "seconds": round(time.monotonic() - start, 1)}  # fmt: skip
    (Path(out) / "candidate.json").write_text(json.dumps(record, indent=2) + "\n")
    return record


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m fluxgrpo.lab.candidate", description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--image-size", type=int, choices=(64, 128), default=64)
    parser.add_argument("--steps", type=int, default=1500, help="flow-matching steps (the full build: 8000)")
    parser.add_argument("--images", type=int, default=4000, help="renders to train on (the full build: 8000)")
    parser.add_argument("--distill-steps", type=int, default=0, help="guidance distillation after (the build: 1500)")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args(argv)
    record = candidate(
        Path(args.out), args.image_size, args.steps, args.images, args.threads, distill_steps=args.distill_steps
    )
    print(json.dumps(record))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
