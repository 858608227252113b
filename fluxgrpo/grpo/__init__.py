"""The GRPO algorithm for FLUX (DanceGRPO's math) and its peers, as stage functions the training loop calls:

    schedule.sigma_schedule → rollout.sample_trajectories (samplers.py: every SDE/ODE step)
    → (decode, reward) → advantages.group_advantages → update.run_update (objectives/: the loss) → ema

``objectives/`` holds what an update trains on behind one seam (``--objective``, listed in the torch-free
``objectives/catalogue.py``); ``update.run_update`` drives any of them. Nothing here imports the run's packages
(config, training, checkpoint, metrics, models), and importing this package imports nothing (no torch): import the
module you need.

Every function is generic over a module with FluxTransformer2DModel's forward, plain or FSDP2-sharded.
"""
