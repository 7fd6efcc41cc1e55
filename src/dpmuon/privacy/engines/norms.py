"""RMSNorm variants both engines know: torch's `nn.RMSNorm` and Hugging Face's per-model copies.

Hugging Face gives every architecture its own RMSNorm class (`LlamaRMSNorm`, `Qwen2RMSNorm`,
…), and both engines dispatch on exact types (a subclass may use its weight differently), so
each class must be registered. Two forwards occur, both over the last dimension with
x̂ = x / √(mean(x²) + ε):

- `HF_RMS_NORMS`: y = γ ⊙ x̂, ε in `variance_epsilon` (Llama's; OLMo2 casts after the product
  rather than before it, the same maths).
- `HF_OFFSET_RMS_NORMS`: y = (1 + γ) ⊙ x̂, ε in `eps` (Gemma's, stored as the offset from 1).

Either way ∂y_t/∂γ = x̂_t, so example i's gradient of γ is Σ_t b_t ⊙ x̂_t and one rule serves both.
Each class's forward is checked against this maths in tests/privacy/engines/test_hf_layer_rules.py,
so a transformers release that changes one is caught. Others with the first forward are added with
`engines.register_rms_norm`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from transformers.models.gemma.modeling_gemma import GemmaRMSNorm
from transformers.models.gemma2.modeling_gemma2 import Gemma2RMSNorm
from transformers.models.llama.modeling_llama import LlamaRMSNorm
from transformers.models.mistral.modeling_mistral import MistralRMSNorm
from transformers.models.olmo2.modeling_olmo2 import Olmo2RMSNorm
from transformers.models.phi3.modeling_phi3 import Phi3RMSNorm
from transformers.models.qwen2.modeling_qwen2 import Qwen2RMSNorm
from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm

HF_RMS_NORMS: tuple[type[nn.Module], ...] = (LlamaRMSNorm, Qwen2RMSNorm, Qwen3RMSNorm, MistralRMSNorm, Olmo2RMSNorm, Phi3RMSNorm)
HF_OFFSET_RMS_NORMS: tuple[type[nn.Module], ...] = (GemmaRMSNorm, Gemma2RMSNorm)


def rms_eps(module: nn.Module) -> float | None:
    """ε of an RMSNorm: torch's `eps` (None: the input dtype's machine epsilon), HF's `variance_epsilon`
    or, for the offset (Gemma) classes, `eps`."""
    if isinstance(module, nn.RMSNorm):
        return module.eps
    for attribute in ("variance_epsilon", "eps"):
        if hasattr(module, attribute):
            return float(getattr(module, attribute))
    raise ValueError(f"{type(module).__name__} has neither `variance_epsilon` nor `eps`: not an HF-style RMSNorm; write a layer rule for it")


def rms_normalized(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """fp32 x / √(mean(x²) + ε) over the last dimension of x [..., features], features = γ.numel().

    Normalizing the flattened trailing dims equals normalizing over `normalized_shape`. HF
    classes normalize in fp32 whatever the input dtype, as here.
    """
    return F.rms_norm(x.float(), (x.shape[-1],), eps=rms_eps(module))
