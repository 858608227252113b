"""The typer CLI: thin commands that parse, validate and call library functions."""
