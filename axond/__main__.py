"""`python -m axond`: the `axond` command line (for environments where the console script is not on PATH)."""

from axond.cli.main import main

if __name__ == "__main__":
    main(prog_name="axond")
