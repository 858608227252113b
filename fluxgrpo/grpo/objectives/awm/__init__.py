"""``--objective awm``: Advantage-Weighted Matching. ``settings.py`` (torch-free): its flags and catalogue entry;
``loss.py``: the loss."""
