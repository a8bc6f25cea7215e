"""The `hisparse` command: `hisparse demo | calc`."""

from __future__ import annotations

import sys

COMMANDS = {
    "demo": ("hisparse_jax.demo", "sparse-MLA decoding on an embedded tiny model (no downloads)"),
    "calc": ("hisparse_jax.calc", "running-request capacity: baseline vs HiSparse (the published calculator)"),
}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print("usage: hisparse {" + ",".join(COMMANDS) + "} [options]\n")
        for name, (_, text) in COMMANDS.items():
            print(f"  {name:<6} {text}")
        return 0 if argv else 2
    if argv[0] not in COMMANDS:
        print(f"hisparse: unknown command {argv[0]!r}; choose from {', '.join(COMMANDS)}", file=sys.stderr)
        return 2
    import importlib

    return importlib.import_module(COMMANDS[argv[0]][0]).main(argv[1:])


if __name__ == "__main__":
    sys.exit(main())
