"""``--objective grpo``: PPO-clip on the SDE's per-step log-probs. ``settings.py`` (torch-free): its catalogue
entry; ``loss.py``: the loss."""
