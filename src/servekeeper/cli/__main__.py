"""`python -m servekeeper.cli`: the command line."""

from servekeeper.cli.main import main

main()
