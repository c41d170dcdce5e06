"""Subcommands of the ``rein`` CLI: one module each, exposing ``register(subparsers)``.

``register`` adds the subcommand's parser and sets ``func`` (args -> exit code)
with ``parser.set_defaults(func=...)``.
"""
