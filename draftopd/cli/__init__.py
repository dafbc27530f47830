"""The `draftopd` command line: one entry, one subcommand per job, one module per group of jobs.

Each group's module (train, evaluate, convert, cluster, bench) adds its commands' parsers beside their handlers;
this one builds the parser, lists the commands by job in `draftopd --help`, and turns bad input (a missing file,
a malformed prompt line, a config typo, a drafter that does not fit the target) into one line on stderr and exit
status 2.
"""

from __future__ import annotations

import argparse
import sys

from draftopd.cli import bench, cluster, convert, evaluate, serve, train
from draftopd.cli.common import Parser
from draftopd.config import ConfigError
from draftopd.data.eval_sets import EvalSetError
from draftopd.data.prompts import PromptError
from draftopd.eval.diagnose import DiagnoseError
from draftopd.loading import LoadError

__all__ = ["build_parser", "main"]

USER_ERRORS = (
    ConfigError,
    DiagnoseError,
    EvalSetError,
    PromptError,
    LoadError,
    FileNotFoundError,
    FileExistsError,
    IsADirectoryError,
    PermissionError,
)

# `draftopd --help` lists the commands under these headings, in this order (`export` also prints the `vllm serve` /
# SGLang command for what it wrote; `serve` is vLLM's server with draftopd's recording hook and learner).
GROUPS = {
    "train": ("train", "plan", "ui"),
    "evaluate": ("eval", "generate", "diagnose", "rejections"),
    "inspect and convert": ("export", "inspect", "prepare-data", "make-toy-target", "make-toy-draft-lm"),
    "serve": ("serve", "rollback"),
    "cluster": ("cluster",),
    "benchmarks": ("bench",),
}
MODULES = (train, evaluate, convert, serve, cluster, bench)


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(
        prog="draftopd",
        description="Train speculative-decoding drafters (SFT, then Draft-OPD) and serve them with vLLM or SGLang.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND", help="one of those below")
    for module in MODULES:
        module.register(sub)
    parser.epilog = _grouped_commands(sub.choices) + "\n\n`draftopd COMMAND --help` shows a command's flags."
    return parser


def _grouped_commands(parsers: dict[str, argparse.ArgumentParser]) -> str:
    listed = [name for names in GROUPS.values() for name in names]
    assert sorted(listed) == sorted(parsers), "every command belongs to one group of draftopd --help"
    width = max(map(len, listed)) + 2
    lines = []
    for title, names in GROUPS.items():
        lines.append(f"{title}:")
        lines += [f"  {name:<{width}}{parsers[name].get_default('summary')}" for name in names]
    return "\n".join(lines)


def _quiet_model_loading() -> None:
    """Our own progress bars cover long work; the per-file bars of model loading are noise (and would split an
    error message over several lines)."""
    try:
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
    except ImportError:
        pass


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    _quiet_model_loading()
    try:
        rc = args.handler(args)
    except USER_ERRORS as exc:
        print(f"draftopd {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except RuntimeError as exc:
        if type(exc).__name__ != "TrainingError":  # only the driver's deliberate stops are shown this way
            raise
        print(f"draftopd {args.command}: stopped: {exc} (continue with run.resume=true)", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"draftopd {args.command}: interrupted", file=sys.stderr)
        return 130
    return rc or 0


if __name__ == "__main__":
    sys.exit(main())
