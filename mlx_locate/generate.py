"""`python -m mlx_locate.generate`, the locate command as the README shows it (`commands/locate.py`)."""

from .commands.locate import command, main

__all__ = ["main"]

if __name__ == "__main__":
    command()
