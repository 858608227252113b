"""``--objective vgrpo``: V-GRPO. ``settings.py`` (torch-free): its flags and catalogue entry; ``loss.py``: the
loss."""
