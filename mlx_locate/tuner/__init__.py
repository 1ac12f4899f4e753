"""Training code: the demo model's trainer and tokenizer, and fine-tuning."""
