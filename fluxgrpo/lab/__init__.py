"""The top floor's lab: the shapes world's builder (``python -m fluxgrpo.lab.build``) and its measurements
(``python -m fluxgrpo.lab.measure``, ``python -m fluxgrpo.lab.capacity``).

It may import anything below it; nothing in the product imports it (the import-graph test holds that line)."""
