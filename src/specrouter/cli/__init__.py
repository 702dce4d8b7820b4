"""`specrouter` command line: one module per command; `main.py` builds the parser."""
