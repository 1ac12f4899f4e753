"""The LocateAnything paper's evaluation: `formats` (benchmark and answer files), `predict` (a model's answers),
`score` (the one scorer), `report` (tables, plot, comparison) and `synthetic` (the held-out synthetic scenes as a
benchmark). The command over them is `mlx_locate.commands.evaluate` (`mlx-locate-eval`)."""
