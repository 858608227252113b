"""Training checkpoints: an exact resume, written atomically, with a diffusers-format export beside it.

``output_dir/checkpoint-{k}/`` holds the state *after* k iterations (DanceGRPO saves at the start of step
k, one update early, and keeps no optimizer state; see dancegrpo-spec.md §7):

    transformer/        config.json + diffusion_pytorch_model[-0000i-of-0000n].safetensors (+ index json):
                        ``FluxTransformer2DModel.from_pretrained`` loads it; ``sample`` uses it.
    transformer_ema/    the same, with the EMA weights (only when an EMA is kept).
    lora/, lora_ema/    instead of the two above for a LoRA run (--lora-rank): pytorch_lora_weights.safetensors,
                        the adapter in diffusers' format (``FluxPipeline.load_lora_weights`` loads it). The resume
                        state then holds the adapters and their optimizer state only; the frozen base comes from
                        the base model's files.
    state/              torch.distributed.checkpoint (DCP) files for {"model", "optim", "lr_scheduler", "ema"},
                        trainer_state.json, rng_rank{r}.pt for every rank (tensors and plain values only), and
                        checksums_rank{r}.json: the sha256 of each file rank r wrote, verified on resume.
    COMPLETE            written last; JSON facts about the checkpoint (iteration, world size, what it holds).

Atomicity: everything is written into ``checkpoint-{k}.tmp/``; only when every rank has finished does rank 0
write ``COMPLETE`` and rename the folder. A folder with a ``.tmp`` (or ``.trash``) suffix, or without
``COMPLETE``, is never taken for a checkpoint, so an interrupted save (Ctrl-C, a killed worker, a full disk)
never looks complete; its leftovers are removed by the next save. Deletions (keep-last pruning, replacing a
checkpoint of the same iteration) rename the folder to ``.trash`` first, so a half-deleted checkpoint is
never taken for a complete one either.

With more than one process ``output_dir`` must be on a filesystem every rank sees (DCP requires it anyway).

Loading runs no code from the folder: the RNG files are read with ``torch.load(weights_only=True)`` and the DCP
files through ``fluxgrpo.safe_dcp`` (see there), so a checkpoint from someone else is data, not a program.

The package: ``layout`` (names, discovery, --resume, atomic file steps), ``state`` (save / load the exact
resume state), ``export`` (the diffusers folder), ``best`` (``best/``). Import from the module that holds a name.
"""
