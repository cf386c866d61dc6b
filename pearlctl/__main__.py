"""`python -m pearlctl` is the `pearlctl` command."""

from pearlctl.cli import main

main()
