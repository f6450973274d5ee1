"""The ``treecompile inspect`` subcommand: its arguments and the report it prints.

Example::

    treecompile inspect ./qwen3-tiny --mask bitmask --png mask.png

Registered by ``treecompile.cli.main`` as ``add_command(subparsers)``; ``run(args)``
builds the model (:mod:`treecompile.capture.model_loader`), inspects it
(:func:`treecompile.compile.inspection.inspect_model`) and prints the text or JSON report. Nothing
heavy is imported until the command runs.
"""

from __future__ import annotations

import argparse
import json
import sys

from treecompile.compile.inspection import BACKENDS, as_json, inspect_model, render_text
from treecompile.compile.maskview import PNG_CELL
from treecompile.capture.model_loader import DTYPES, MAX_PARAMS, load_model

__all__ = ["add_command", "run"]


def add_command(sub: argparse._SubParsersAction) -> None:
    """Adds the ``inspect`` subcommand to the CLI's subparsers (imports nothing heavy)."""
    from treecompile.cli.args import int_at_least

    p = sub.add_parser(
        "inspect",
        help="show what the passes do to a model: graph diffs, rewrite counts, the tree mask",
        description=(
            "Builds MODEL, compiles it with tree_compile on a small example forest (19 rows) and prints, "
            "per pass, a unified diff of the captured graph's code and the rewrites it counted, then the tree "
            "attention mask of the example. Exits 1 if the model is refused (the message names the op)."
        ),
    )
    p.add_argument(
        "model",
        metavar="MODEL",
        help="a Hugging Face config (a directory with config.json, or the JSON file; built with small random "
        "weights) or module:factory (a callable returning an nn.Module; the current directory is importable)",
    )
    p.add_argument("--mask", choices=("interval", "bitmask"), default="interval", help="tree mask encoding")
    p.add_argument(
        "--lm-head", choices=("gather", "fused"), default="gather",
        help="LM head rewrite, as tree_compile(lm_head=...) (default gather)",
    )
    p.add_argument("--full", action="store_true", help="print whole graphs instead of diffs")
    p.add_argument("--context", type=int_at_least(0), default=2, metavar="N", help="context lines of each diff (default 2)")
    p.add_argument("--json", action="store_true", help="print machine-readable JSON")
    p.add_argument(
        "--png", metavar="PATH", default=None,
        help="also draw the tree mask as a PNG with axes, row labels and a legend (needs the [plot] extra)",
    )
    p.add_argument("--png-cell", type=int_at_least(1), default=PNG_CELL, metavar="PX", help=f"pixels per token (default {PNG_CELL})")
    p.add_argument(
        "--dtype", choices=DTYPES, default=None,
        help="parameter dtype (default: float32 for HF configs, unchanged for factories)",
    )
    p.add_argument(
        "--backend", choices=BACKENDS, default="eager",
        help="lowering after the passes (default eager: the passes are what is shown)",
    )
    p.add_argument(
        "--stream-rows", type=int_at_least(1), default=None, metavar="C",
        help="stream the example in parts of at most C rows (fewer than its 19) and show the part graph: "
        "prefix key/value, conv and state inputs, what it returns for later parts",
    )
    p.add_argument(
        "--allow-large", action="store_true",
        help=f"build HF configs above {MAX_PARAMS / 1e9:.0f}B parameters (refused by default)",
    )
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """``treecompile inspect MODEL``: 0 if the model compiles, 1 if it is refused."""
    if args.png:
        from treecompile.cli.args import check_output_file, require_plot

        # Before the model is built, and never the model's own file.
        args.png = str(check_output_file("--png", args.png, ".png", inputs=[args.model]))
        require_plot("--png")
    model, source = load_model(args.model, dtype=args.dtype, allow_large=args.allow_large)
    insp = inspect_model(model, mask=args.mask, backend=args.backend, source=source, lm_head=args.lm_head,
                         stream_rows=args.stream_rows)
    if args.png:
        from treecompile.cli.plots import mask_figure, save_png

        save_png(mask_figure(insp.batch, insp.mask, cell=args.png_cell), args.png)
    if args.json:
        data = as_json(insp, full=args.full)
        if args.png:
            data["png"] = str(args.png)
        print(json.dumps(data, indent=1, ensure_ascii=False))
    else:
        print(f"treecompile inspect {args.model}")
        print(render_text(insp, full=args.full, context=args.context))
        if args.png:
            print(f"mask picture written to {args.png}")
    if insp.refusal is not None:
        if args.json:
            print(f"treecompile inspect: refused: {insp.refusal}", file=sys.stderr)
        return 1
    return 0
