"""Synthetic scenes, deterministic in their seeds: `scenes` (shape scenes with grounding tasks in the real prompt
grammar, the demo model's data, and fine-tuning data made of them) and `large_scenes` (large and dense scenes for
tiling, clips of moving shapes for video). Used by the demo's training, the evaluation, the examples and the tests;
imports only the host-side data floor below it."""
