"""RMSNorm variants both engines know: torch's `nn.RMSNorm` and Hugging Face's per-model copies.

Hugging Face gives every architecture its own RMSNorm class (`LlamaRMSNorm`, `Qwen2RMSNorm`,
…), and both engines dispatch on exact types (a subclass may use its weight differently), so
each class must be registered. The ones listed here compute y = γ ⊙ x / √(mean(x²) + ε) over
the last dimension, ε in `variance_epsilon` — checked against autograd in tests/models/test_llama.py.
Others with that forward are added with `engines.register_rms_norm` (Gemma's, which scales by 1 + γ,
is *not* one of them).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from transformers.models.llama.modeling_llama import LlamaRMSNorm
from transformers.models.qwen2.modeling_qwen2 import Qwen2RMSNorm

HF_RMS_NORMS: tuple[type[nn.Module], ...] = (LlamaRMSNorm, Qwen2RMSNorm)


def rms_eps(module: nn.Module) -> float | None:
    """ε of an RMSNorm: torch's `eps` (None: the input dtype's machine epsilon) or HF's `variance_epsilon`."""
    if isinstance(module, nn.RMSNorm):
        return module.eps
    try:
        return float(module.variance_epsilon)
    except AttributeError:
        raise ValueError(f"{type(module).__name__} has no `variance_epsilon`: not an HF-style RMSNorm; write a layer rule for it") from None


def rms_normalized(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """fp32 x / √(mean(x²) + ε) over the last dimension of x [..., features], features = γ.numel().

    Normalizing the flattened trailing dims equals normalizing over `normalized_shape`. HF
    classes normalize in fp32 whatever the input dtype, as here.
    """
    return F.rms_norm(x.float(), (x.shape[-1],), eps=rms_eps(module))
