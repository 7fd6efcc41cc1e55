"""dpmuon: differentially private fine-tuning with matrix-orthogonalized momentum.

`dpmuon.privacy` holds the private release (sample → clip → noise → account);
`dpmuon.optim` holds the optimizers, which only post-process the released gradient.
"""

__version__ = "0.1.0"
