"""``mindformers-py`` command line: ``run`` a task recipe, ``convert`` checkpoints, ``show`` presets, ``demo``.

User errors (:class:`MindFormersError`) print as one line on stderr with exit status 2; anything else is a bug
and keeps its traceback.
"""

from __future__ import annotations

import argparse
import sys

from .errors import MindFormersError


def _cmd_convert(args: argparse.Namespace) -> int:
    from .convert import convert_checkpoint

    out = convert_checkpoint(args.src, args.dst, to=args.to)
    print(f"wrote {out}")
    return 0


def _cmd_show(args: argparse.Namespace) -> int:
    from .auto import AutoConfig

    AutoConfig.show_support_list()
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="mindformers-py", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    conv = sub.add_parser("convert", help="convert a checkpoint between our format and HF's")
    conv.add_argument("src", help="source checkpoint folder (ours or HF)")
    conv.add_argument("dst", help="destination folder (written atomically)")
    conv.add_argument("--to", choices=["hf", "mindformers"], default="hf", help="target format")
    conv.set_defaults(func=_cmd_convert)
    show = sub.add_parser("show", help="list model families, presets and loadable HF architectures")
    show.set_defaults(func=_cmd_show)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point; returns the exit status (0 ok, 2 user error)."""
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra and args.command != "run":
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    args.extra = extra
    try:
        return args.func(args)
    except MindFormersError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
