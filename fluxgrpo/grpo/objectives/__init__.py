"""Training objectives behind one seam (``base.Objective``): ``grpo`` (PPO-clip on per-step log-probs), ``nft``
(DiffusionNFT), ``awm`` (Advantage-Weighted Matching) and ``vgrpo`` (V-GRPO) on final samples, ``neighbor`` (Neighbor
GRPO) on the ODE paths of a neighbourhood of initial noises. Each is one folder (``<name>/settings.py``: its
torch-free settings class and catalogue entry; ``<name>/loss.py``: its loss) and one line in ``catalogue.py``
(torch-free), which the config, the settings, the memory model and the guards read; importing this package imports
no torch."""
