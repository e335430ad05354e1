"""Reading checkpoints through other libraries' interfaces: the read-only zarr-python store that presents a whole
checkpoint, packed arrays included, as one hierarchy (:mod:`.zarrstore`, with its packs in :mod:`.zarrpacks`
and file helpers in :mod:`.zarrfiles`; users import it as :mod:`arraycheckpoint.zarr`). May import every layer
up to and including ``engine``; never torch, jax or tensorstore.
"""
