"""Training objectives behind one seam (``base.Objective``): ``grpo`` (PPO-clip on per-step log-probs), ``nft``
(DiffusionNFT), ``awm`` (Advantage-Weighted Matching) and ``vgrpo`` (V-GRPO) on final samples, ``neighbor`` (Neighbor
GRPO) on the ODE paths of a neighbourhood of initial noises. ``catalogue`` (torch-free) lists them for the config,
the settings, the memory model and the guards; importing this package imports no torch."""
