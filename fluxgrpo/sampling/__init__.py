"""Images from the base FLUX model or a trained checkpoint, reproducible image by image: the library behind
``fluxgrpo sample`` and the in-training evaluation.

Determinism: image j of prompt i starts from its own noise, drawn in float32 on the cpu from a generator seeded
with ``image_seed(S, i, j)``:

    image_seed(S, i, j) = int.from_bytes(sha256(f"fluxgrpo-sample:{S}:{i}:{j}".encode()).digest()[:8], "big")
                          & (2**63 - 1)

so every image depends only on (weights, settings, S, i, j): not on ``--batch-size`` or ``--dies``, and a
base-vs-trained comparison with the same ``--seed`` starts every image from the same noise. Each prompt is encoded
on its own (a batch of one), so its text embedding does not depend on its batch either. (Batched kernels may still
round differently from unbatched ones on some devices; on cpu the pixels are identical.)

Output folder (``--out``):

    <i:04d>_<j:02d>.png   image j of prompt i (the prompt and seed are also in the PNG's text chunks)
    grid.png              contact sheet: one row per prompt, one column per image, tiles downscaled
    index.json            written LAST, atomically: run facts and one entry per image (see ``write_index``)

A folder without ``index.json`` is an incomplete run. Re-running into the same folder first deletes the earlier
run's index, images and grid; a folder holding anything else is refused. With ``--dies N`` prompt ``i`` belongs
to rank ``i % N``; every rank writes its own images (the folder must be on a filesystem every rank sees), and
rank 0 gathers the records and writes the grid and the index once every image is on disk.

The modules: ``request`` (the settings and the job, the per-image seed), ``checkpoints`` (which checkpoint a
``--checkpoint`` names, and that it fits the base model), ``generate`` (the pipeline and the images),
``folder`` (the output folder: its own files, the grid, ``index.json`` written and read back).
"""
