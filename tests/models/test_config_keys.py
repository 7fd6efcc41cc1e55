"""Dropout probabilities and context length read from any model's own config (no family table):
the rule on the families docs/models.md lists, and what it leaves alone."""

from __future__ import annotations

import pytest
from transformers import (
    BertConfig,
    Gemma2Config,
    GemmaConfig,
    GPT2Config,
    GPTNeoXConfig,
    LlamaConfig,
    MistralConfig,
    Olmo2Config,
    OPTConfig,
    Phi3Config,
    PretrainedConfig,
    Qwen2Config,
    Qwen3Config,
)

from dpmuon.models.architectures import config_context_length, dropout_keys, dropout_overrides

ATTENTION_ONLY = ("attention_dropout",)
EXPECTED = {
    LlamaConfig: (ATTENTION_ONLY, 2048),
    Qwen2Config: (ATTENTION_ONLY, 32768),
    Qwen3Config: (ATTENTION_ONLY, 32768),
    MistralConfig: (ATTENTION_ONLY, 131072),
    GemmaConfig: (ATTENTION_ONLY, 8192),
    Gemma2Config: (ATTENTION_ONLY, 8192),
    Olmo2Config: (ATTENTION_ONLY, 2048),
    OPTConfig: (("dropout", "attention_dropout"), 2048),  # not `layerdrop`
    Phi3Config: (("resid_pdrop", "embd_pdrop", "attention_dropout"), 4096),
    GPTNeoXConfig: (("attention_dropout", "hidden_dropout", "classifier_dropout"), 2048),
    GPT2Config: (("resid_pdrop", "embd_pdrop", "attn_pdrop", "summary_first_dropout"), 1024),  # via n_positions
    BertConfig: (("hidden_dropout_prob", "attention_probs_dropout_prob"), 512),  # the `_prob` form; classifier_dropout=None left alone
}


@pytest.mark.parametrize("config_class", list(EXPECTED), ids=lambda c: c.__name__)
def test_dropout_keys_and_context_length_come_from_the_config(config_class):
    config = config_class()
    keys, context = EXPECTED[config_class]
    assert set(dropout_keys(config)) == set(keys)
    assert config_context_length(config) == context
    assert dropout_overrides(config, 0.3) == dict.fromkeys(keys, 0.3)


def test_keys_must_name_a_dropout_probability_with_a_probability_value():
    config = PretrainedConfig(
        attention_dropout=0.1,  # yes
        ffn_dropout_rate=0.2,  # yes: `_rate` suffix
        emb_dropout_p=0.0,  # yes: `_p` suffix
        layerdrop=0.1,  # LayerDrop skips whole layers: not a dropout probability
        drop_path_rate=0.1,  # stochastic depth
        use_dropout=True,  # a switch, not a probability
        hidden_dropout=2.0,  # not in [0, 1]
        classifier_dropout=None,
        dropout_impl="fused",
    )
    assert set(dropout_keys(config)) == {"attention_dropout", "ffn_dropout_rate", "emb_dropout_p"}


def test_a_dropout_for_a_config_without_any_is_refused_but_zero_and_null_are_fine():
    config = PretrainedConfig()
    with pytest.raises(ValueError, match=r"model.dropout=0.1 .* no dropout probability.*model.dropout=null"):
        dropout_overrides(config, 0.1)
    assert dropout_overrides(config, 0.0) == {} and dropout_overrides(config, None) == {}
    with pytest.raises(ValueError, match="names no context length"):
        config_context_length(config)
