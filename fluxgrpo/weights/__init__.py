"""Weights on disk: where each part lives (``layout``), what makes it complete (``manifest``), and the sources
that write them (``tiny`` for the offline random models; the hub sources are separate modules)."""
