"""``ltcx prepare``: the argparse front-end of ``ltcx.data.prepare.prepare`` (imported once the arguments parse)."""

from __future__ import annotations

from ltcx.cli.one_line_errors import command_parser

__all__ = ["prepare_main"]


def prepare_main(argv: list[str]) -> None:
    """``ltcx prepare``: a hub data set or local files into deduplicated token shards (resumable)."""
    parser = command_parser("prepare", prepare_main.__doc__)
    parser.add_argument("--source", default="HuggingFaceFW/fineweb-edu",
                        help="hub data set id, or local .txt/.jsonl/.parquet file, folder or glob, or 'sample'")
    parser.add_argument("--name", default="sample-10BT", help="hub configuration (ignored for local files)")
    parser.add_argument("--split", default="train", help="hub split to prepare for training")
    parser.add_argument(
        "--val_split", default="validation", type=lambda text: None if text.lower() in ("", "none") else text,
        help="the source's validation split, used when it has one (local files: those named val/valid/validation, "
        "else test); none: hold out --val_fraction of the documents instead (local validation files then train)",
    )
    parser.add_argument(
        "--test_split", default="test", type=lambda text: None if text.lower() in ("", "none") else text,
        help="the source's test split, used when it has one (local files: those named test beside validation-named "
        "ones); none: hold out --test_fraction of the documents instead",
    )
    parser.add_argument("--out", required=True, help="output folder: new or empty, or an interrupted one to resume")
    parser.add_argument("--text_column", default="text")
    parser.add_argument("--txt_sample_by", default="paragraph", choices=("line", "paragraph", "document"))
    parser.add_argument("--tokenizer", default="gpt2")
    parser.add_argument("--val_fraction", type=float, default=0.001,
                        help="without a validation split: documents held out, by a hash of the text")
    parser.add_argument("--test_fraction", type=float, default=0.001,
                        help="without a test split: documents held out for ltcx test, by a hash of the text")
    parser.add_argument("--shard_tokens", type=int, default=100_000_000, help="tokens per shard (about)")
    parser.add_argument("--max_tokens", type=int, default=None, help="stop after about this many training tokens")
    parser.add_argument("--num_proc", type=int, default=None, help="tokenizer processes (default: one per CPU)")
    args = parser.parse_args(argv)
    from ltcx.data.prepare import prepare

    prepare(
        args.source, args.out, name=args.name, split=args.split, val_split=args.val_split, test_split=args.test_split,
        text_column=args.text_column, txt_sample_by=args.txt_sample_by, tokenizer=args.tokenizer,
        val_fraction=args.val_fraction, test_fraction=args.test_fraction,
        shard_tokens=args.shard_tokens, max_tokens=args.max_tokens, num_proc=args.num_proc,
    )
