"""Training objectives behind one seam (``base.Objective``): ``grpo`` (PPO-clip on per-step log-probs), ``nft``
(DiffusionNFT) and ``awm`` (Advantage-Weighted Matching) on final samples. ``catalogue`` (torch-free) lists them
for the config, the settings, the memory model and the guards; importing this package imports no torch."""
