"""Training code: the demo model's trainer and its synthetic scenes (and fine-tuning)."""
