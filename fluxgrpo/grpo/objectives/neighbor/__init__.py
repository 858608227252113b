"""``--objective neighbor``: Neighbor GRPO. ``settings.py`` (torch-free): its flags and catalogue entry, with the
rollout it needs (a neighbourhood of initial noises, the ODE paths kept); ``loss.py``: the loss and the noise."""
