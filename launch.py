"""strata_jax command line: train (default), eval, sft, ablate, export.

Work in progress: the trainer lands with the launch issue; for now this prints the usage.
"""

import sys

USAGE = """usage: python launch.py [MODE] --config configs/X.py [--config.key=value ...] [--workdir DIR]
modes: train (default), eval, sft, ablate, export"""


def main(argv: list[str]) -> int:
    print(USAGE)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
