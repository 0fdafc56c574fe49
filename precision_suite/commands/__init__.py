"""The commands of `precision-suite`, one module each: a module declares its command (its name, help
and description), the arguments it takes and how it runs; cli.py is the loop that builds the
parser from them and calls the one the arguments name.

These modules are light: the command line imports them while it parses its arguments, so each
imports its job (in precision_suite.jobs) only when it runs, and `--help` and `--version` answer
without loading torch, xarray or matplotlib. This __init__ imports nothing."""
