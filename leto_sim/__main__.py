"""``python -m leto_sim``: the simulator's command line (leto_sim/cli.py)."""
from .cli import main

if __name__ == "__main__":
    main(prog_name="leto_sim")
