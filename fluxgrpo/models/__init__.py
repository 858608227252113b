"""Loading FLUX parts and reward models from the standard weights layout, and the tiny-model builder.

Submodules import torch, diffusers, transformers and open_clip; import them where they are used so the CLI stays
fast: ``flux`` (transformer, VAE, text encoders, prompt encoding, latent decoding), ``reward`` (HPSv2 and the
smoke-test reward), ``tiny`` (the tiny random FLUX pipeline and open_clip model behind ``--source tiny``).
"""
