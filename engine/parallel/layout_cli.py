"""`cpserve layout`: show which prefill CP rank owns which new tokens, and its work.

``--lengths`` counts each request's new tokens, ``--cached`` each request's cached prefix
(default: none); the printed tokens are indices into the batch's flattened new tokens. With
``--json`` the command prints exactly one object:
``{"ranks": [{"rank": 0, "tokens": [...], "pairs": N}, ...]}``.
"""

from __future__ import annotations

import argparse
import json

from engine.parallel.layout import STRATEGIES, BatchLayout, split_batch


def build_parser_layout(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Add the ``layout`` subcommand; its handler is ``args.func`` (``run_layout``)."""
    parser = subparsers.add_parser(
        "layout",
        help="which prefill CP rank owns which new tokens",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--strategy", required=True, choices=STRATEGIES)
    parser.add_argument("--cp", required=True, type=_positive_int, help="CP group size C (>= 1)")
    parser.add_argument(
        "--lengths", required=True, type=_int_list, help="new tokens per request, e.g. 5,3"
    )
    parser.add_argument(
        "--cached", type=_int_list, default=None, help="cached prefix per request (default: 0s)"
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.set_defaults(func=run_layout, layout_parser=parser)
    return parser


def run_layout(args: argparse.Namespace) -> int:
    """Print the layout described by ``args``; returns the exit status (0)."""
    cached = args.cached if args.cached is not None else [0] * len(args.lengths)
    if len(cached) != len(args.lengths):
        _fail(
            args,
            f"--cached has {len(cached)} values but --lengths has {len(args.lengths)}; "
            "give one cached length per request",
        )
    layout = split_batch(args.lengths, cached, args.cp, args.strategy)
    if args.json:
        print(json.dumps(layout_to_json(layout)))
    else:
        _print_table(layout)
    return 0


def layout_to_json(layout: BatchLayout) -> dict:
    """The ``--json`` object: per rank its flattened tokens and causal pairs."""
    return {
        "ranks": [
            {"rank": r.rank, "tokens": list(r.token_indices), "pairs": r.pairs}
            for r in layout.ranks
        ]
    }


def _print_table(layout: BatchLayout) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(
        title=f"{layout.strategy} prefill, cp={layout.cp}, "
        f"lengths={list(layout.new_lengths)}, cached={list(layout.cached_lengths)}"
    )
    for column in ("rank", "tokens", "count", "pairs"):
        table.add_column(column, justify="left" if column == "tokens" else "right")
    for rank in layout.ranks:
        table.add_row(
            str(rank.rank), _runs(rank.token_indices), str(rank.num_tokens), str(rank.pairs)
        )
    pairs = [r.pairs for r in layout.ranks]
    table.caption = (
        f"padded all-gather buffer: {layout.max_tokens_per_rank} tokens/rank; "
        f"pairs max/min: {_ratio(max(pairs), min(pairs))}"
    )
    Console(soft_wrap=False).print(table)


def _runs(tokens: tuple[int, ...]) -> str:
    """``0,1,2,3,7,9,10`` -> ``0-3,7,9,10``: runs of three or more collapse to a range."""
    parts: list[str] = []
    start = 0
    for k in range(1, len(tokens) + 1):
        if k == len(tokens) or tokens[k] != tokens[k - 1] + 1:
            run = tokens[start:k]
            parts.append(f"{run[0]}-{run[-1]}" if len(run) >= 3 else ",".join(map(str, run)))
            start = k
    return ",".join(parts) or "-"


def _ratio(high: int, low: int) -> str:
    return f"{high / low:.3f}" if low else "inf" if high else "1.000"


def _fail(args: argparse.Namespace, message: str) -> None:
    parser = getattr(args, "layout_parser", None)
    if parser is None:
        raise SystemExit(f"cpserve layout: error: {message}")
    parser.error(message)


def _int_list(text: str) -> list[int]:
    try:
        values = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}")
    if not values:
        raise argparse.ArgumentTypeError("expected at least one integer")
    if any(v < 0 for v in values):
        raise argparse.ArgumentTypeError(f"values must be >= 0, got {text!r}")
    return values


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}")
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value
