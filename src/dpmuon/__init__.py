"""dpmuon: differentially private fine-tuning with matrix-orthogonalized momentum.

`dpmuon.privacy` holds the private release (sample → clip → noise → account);
`dpmuon.optim` holds the optimizers, which only post-process the released gradient.
`dpmuon.make_private(...)` gives your own model, data and loop the driver's release (facade.py);
`dpmuon.optim.build(...)` an optimizer for it.
"""

import importlib

__version__ = "0.1.0"
__all__ = ["make_private", "optim", "privacy"]


def __getattr__(name: str):
    # Lazy: `import dpmuon` stays light (no torch) until the façade or a subpackage is used.
    if name == "make_private":
        from .facade import make_private

        return make_private
    if name in ("optim", "privacy"):
        return importlib.import_module(f".{name}", __name__)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
