"""dpmuon inside other training frameworks: `dpmuon.integrations.hf.DPTrainer` (Hugging Face Trainer)."""
