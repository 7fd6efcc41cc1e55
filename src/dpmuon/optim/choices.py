"""The values each named option of the optimizers accepts: read by the settings classes (which
offer and check them, without torch) and by the optimizers that act on them."""

SCHEDULES = ("constant", "linear", "cosine")  # the factors are schedules.py's
MOMENTUM_KINDS = ("heavy_ball", "ema")
NS_NORMALIZATIONS = ("frobenius", "max1")
UPDATE_SCALES = ("adam_rms", "reference", "none")
# DP-MuonBC's s: the noise std of the matrix Newton–Schulz sees (the momentum buffer's), or of
# one step's released gradient — a reading of the paper that corrects far less (β = 0.95: ~10×).
BC_NOISE_STDS = ("buffer", "step")
