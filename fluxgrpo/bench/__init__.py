"""``fluxgrpo bench``: what one GRPO iteration costs (phase by phase, batched vs not), and what each training
algorithm buys per second of training (``--algorithms``).

Modules: ``config`` (the flags as a validated ``BenchConfig``), ``flops`` (FLUX's model FLOPs, what MFU counts),
``models`` (the transformer, VAE and reward being measured), ``harness`` (timing every phase at every batch size
on one rank), ``figures`` (rows, speed-ups and the per-resolution summary), ``run`` (launching it on ``--dies``
workers), ``efficiency`` (the learning-efficiency comparison of algorithms, through the real training loop).

The phase bench on an H200 (one device, bf16 autocast over fp32 weights, FLUX.1-dev's width, 720², 16 steps,
nothing downloaded). fp32 weights, gradients and AdamW's moments take 16 bytes per parameter, so 8 + 16 blocks (5.05 B
parameters) take 75 GiB of the device's ~140 GiB and leave room for autocast's bf16 weight copies (9 GiB), the
activations of micro-batch 2 without checkpointing (≈ 20 GiB at 720², scaled from the saved-tensor count of a
full-width block pair on cpu), the VAE and the ViT-H-14 reward; 19 + 38 blocks would need 177 GiB before any
activation. Each configuration is 128 rollout forwards or 72 trained samples of ≈ 15.7 TFLOP per forward: about
4 minutes at 40–50 % MFU, under 8 at 25 %. A configuration that does not fit is reported as "out of memory".

    fluxgrpo bench --model flux-dev-shaped --blocks 8,16 --resolution 720 --steps 16 \\
        --rollout-batch-sizes 1,2,4,8 --micro-batch-sizes 1,2 --activation-checkpointing both \\
        --dtype bf16 --repeats 2 --json > bench-h200.jsonl

Multi-device (``--dies N``) runs N workers under torchrun with the transformer FSDP2-sharded as in training; every
rank measures its own B trajectories, rank 0's figures are reported and rates are per device.
"""
