"""The `hisparse` command: `hisparse demo | calc`."""

from __future__ import annotations

import os
import sys

COMMANDS = {
    "demo": ("hisparse_jax.demo", "sparse-MLA decoding on an embedded tiny model (no downloads)"),
    "calc": ("hisparse_jax.calc_cli", "running-request capacity: baseline vs HiSparse (the published calculator)"),
}


USAGE = "usage: hisparse {" + ",".join(COMMANDS) + "} [options]"


def main(argv: list[str] | None = None) -> int:
    """Run a subcommand: 0 on success, 2 on a usage error (usage and the error on stderr, as argparse does;
    each subcommand's `main` returns 2 for its own bad arguments instead of raising SystemExit)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in ("-h", "--help"):
        print(USAGE + "\n")
        for name, (_, text) in COMMANDS.items():
            print(f"  {name:<6} {text}")
        return 0
    if not argv or argv[0] not in COMMANDS:
        problem = f"unknown command {argv[0]!r}" if argv else "a command is required"
        print(f"{USAGE}\nhisparse: error: {problem}; choose from {', '.join(COMMANDS)}", file=sys.stderr)
        return 2
    import importlib

    try:
        command = importlib.import_module(COMMANDS[argv[0]][0])
    except ModuleNotFoundError as e:  # `calc` is pure Python; `demo` needs jax, flax and numpy
        if not e.name or e.name.split(".")[0] == "hisparse_jax":
            raise
        print(f"hisparse {argv[0]}: error: it needs {e.name.split('.')[0]!r}, which is not installed (the project's "
              f"dependencies: pip install -e . in its repository)", file=sys.stderr)
        return 1
    try:
        return command.main(argv[1:])
    except BrokenPipeError:  # `hisparse calc --sweep | head`: the reader left; not an error worth a traceback
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # so the exit-time flush stays quiet
        return 0


if __name__ == "__main__":
    sys.exit(main())
