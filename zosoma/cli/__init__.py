"""The command line (the `zosoma` command): one module per command, the group in main.

Parses options, calls the library and renders what it returns. May import every other part of
zosoma; nothing in the library imports it.
"""
