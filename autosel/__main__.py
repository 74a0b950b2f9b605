"""`python -m autosel` runs the same command line as the `autosel` script."""

from autosel.cli import main

if __name__ == "__main__":
    main(prog_name="autosel")
