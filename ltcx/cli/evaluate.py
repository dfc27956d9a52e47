"""``ltcx evaluate``: mean loss by position, up to and past the training length, for one or several models on one text;
with ``--task long_context``, recall past the training length (``ltcx/cli/evaluate_long_context.py``).

    ltcx evaluate --ckpt_path checkpoints/gpt --ckpt_path checkpoints/xlstm --data.path sample --max_len 4x
    ltcx evaluate --task long_context --ckpt_path checkpoints/gpt --ckpt_path checkpoints/xlstm
    ltcx evaluate --task long_context --train cpu --out results/long-context

The computation is ``ltcx/eval/position_loss.py``; this module parses the arguments, loads the models
(``load_model_and_tokenizer``: digests checked, registry classes only), reads the text through ``TextDataModule``
(the validation blocks of the same ``--data.path`` kinds ``fit`` reads) and writes ``position_loss.json`` and
``position_loss.png`` to ``--out``.
"""

from __future__ import annotations

import math
import os
import re
import sys

from ltcx.cli.one_line_errors import command_parser
from ltcx.errors import ConfigError, LtcxError

__all__ = ["evaluate_main"]

RESULTS_JSON, RESULTS_PNG = "position_loss.json", "position_loss.png"
TASKS = ("position_loss", "long_context")


def evaluate_main(argv: list[str]) -> None:
    """``ltcx evaluate``: mean next-token loss by position up to ``--max_len`` tokens (e.g. 4x the training length)
    for each ``--ckpt_path`` on the validation text of ``--data.path``; long sequences are fed through the model's
    state in pieces, so memory stays that of one piece. Writes position_loss.json and position_loss.png to --out."""
    parser = command_parser("evaluate", evaluate_main.__doc__)
    parser.add_argument(
        "--task", choices=TASKS, default="position_loss",
        help="position_loss: loss by position on a text (--data.path); long_context: each model's needle or MQAR "
        "accuracy at 1, 2, 4, 8 x its training length (the task its checkpoint trained on), long_context.json, "
        "long_context.png and needle_heatmaps.png (docs/evaluation.md)",
    )
    parser.add_argument(
        "--ckpt_path", action="append", default=[],
        help="checkpoint written by `ltcx fit`, a checkpoint folder (its latest run's last.ckpt) or a folder written "
        "by `ltcx export`; repeat to compare several models (one line each in the plot)",
    )
    parser.add_argument(
        "--data.path", dest="data_path", default=None,
        help="the text, as --data.path of `ltcx fit`: a local .txt/.jsonl/.parquet file or folder, `sample`, a "
        "Hugging Face hub data set id, or a folder prepared by `ltcx prepare`; its validation blocks are scored",
    )
    parser.add_argument("--data.name", dest="data_name", default=None, help="configuration of the hub data set")
    parser.add_argument("--data.text_column", dest="text_column", default="text")
    parser.add_argument(
        "--data.val_split", dest="val_split", default="validation",
        help="the split to score (hub data sets; local files: those named val/validation/test); 'none', or a missing "
        "split, scores the hash hold-out of the training documents",
    )
    parser.add_argument("--data.holdout_fraction", dest="holdout_fraction", type=float, default=0.005)
    parser.add_argument("--data.txt_sample_by", dest="txt_sample_by", default="paragraph",
                        help="one document of a .txt file: line, paragraph or document")
    parser.add_argument(
        "--max_len", default="4x",
        help="positions to score: tokens (2048) or a multiple of each model's training length (4x); a model with a "
        "context limit (learned position embeddings) stops at its limit and says so",
    )
    parser.add_argument("--num_sequences", type=int, default=None,
                        help="sequences to average over (of max_len tokens; long_context: per cell) (default: 8; "
                        "long_context: 32)")
    parser.add_argument("--batch_size", type=int, default=None, help="sequences per forward (default: 4; "
                        "long_context: 8)")
    parser.add_argument(
        "--piece_len", type=int, default=None,
        help="tokens per forward, the state carried between pieces (default: each model's training length); the "
        "memory of one forward grows with batch_size x piece_len x vocabulary",
    )
    parser.add_argument("--bucket_size", type=int, default=None,
                        help="positions per point of the plot and the JSON buckets (default: the longest length / 32)")
    parser.add_argument("--tokenizer", default=None,
                        help="override every model's stored tokenizer (gpt2, bytes, a Hugging Face id or folder)")
    parser.add_argument("--factors", default="1,2,4,8",
                        help="long_context: the lengths to score, as multiples of each model's training length")
    parser.add_argument("--depths", default="0,0.25,0.5,0.75,1",
                        help="long_context: the needle's depths (0: first in the haystack, 1: right before the "
                        "question)")
    parser.add_argument("--seed", type=int, default=1234, help="long_context: the seed of the test sequences")
    parser.add_argument(
        "--train", choices=("cpu",), default=None,
        help="long_context: first train the CPU default (every catalogue architecture's tiny shape and the GPT with "
        "rotary positions, on the needle and on MQAR at length 32, about 30 CPU-minutes) into --out/runs/, then "
        "score those with any --ckpt_path given",
    )
    parser.add_argument("--device", default=None)  # None: cuda if torch sees one, else cpu
    parser.add_argument("--out", default="evaluation",
                        help=f"folder for {RESULTS_JSON} and {RESULTS_PNG} (long_context: its own files)")
    args = parser.parse_args(argv)
    for name in ("num_sequences", "batch_size", "piece_len", "bucket_size"):
        value = getattr(args, name)
        if value is not None and value < 1:
            raise ConfigError(f"--{name} ({value}) must be >= 1")
    if args.task == "long_context":
        from ltcx.cli.evaluate_long_context import long_context_main

        return long_context_main(args)
    if args.train is not None:
        raise ConfigError("--train trains the long-context default: it needs --task long_context")
    missing = [flag for flag, value in (("--ckpt_path", args.ckpt_path), ("--data.path", args.data_path)) if not value]
    if missing:
        raise ConfigError(f"--task position_loss needs {' and '.join(missing)}: name the model(s) and the text to "
                          "score")
    args.num_sequences, args.batch_size = args.num_sequences or 8, args.batch_size or 4
    factor, tokens = _max_len(args.max_len)
    val_split = None if args.val_split.lower() in ("none", "null", "") else args.val_split

    # Imported after the arguments are parsed: `ltcx evaluate --help` and a mistyped flag answer at once.
    import torch

    from ltcx.cli.generate import _device
    from ltcx.eval.position_loss import context_spans, plot_position_loss, position_loss, to_json
    from ltcx.lm import LanguageModel
    from ltcx.persist.files import atomic_write, atomic_write_text
    from ltcx.persist.load import load_model_and_tokenizer

    device = _device(("cuda" if torch.cuda.is_available() else "cpu") if args.device is None else args.device)
    # Every model is loaded and checked before any text is read: a bad path is one line at once.
    runs = []
    for path in args.ckpt_path:
        model, meta, tokenizer = load_model_and_tokenizer(path, args.tokenizer, model_class=LanguageModel)
        backbone = model.backbone
        limit = backbone.max_seq_len
        train_context = meta.get("train_block_size") or limit
        if factor is not None and not train_context:
            raise LtcxError(
                f"'{path}' records no training length (a checkpoint from before it was saved, or a model without a "
                f"context limit exported without it), so --max_len {args.max_len} has no meaning: pass --max_len in "
                "tokens"
            )
        requested = tokens if factor is None else factor * train_context
        evaluated = requested
        if limit is not None and requested > limit:
            evaluated = limit
            print(
                f"ltcx: '{path}' ({type(backbone).__name__}) has a context limit of {limit} tokens (learned position "
                f"embeddings): scored up to {limit}, not {requested}",
                file=sys.stderr,
            )
        _check_memory(args, path, backbone, evaluated, args.piece_len or train_context or evaluated)
        runs.append(dict(path=path, backbone=backbone, tokenizer=tokenizer, train_context=train_context, limit=limit,
                         requested=requested, evaluated=evaluated))

    # One read of the text per tokenizer, as long as its longest model needs; shorter ones score a prefix of it.
    blocks_by_tokenizer: dict[str, torch.Tensor] = {}
    for name in dict.fromkeys(run["tokenizer"].name for run in runs):
        length = max(run["evaluated"] for run in runs if run["tokenizer"].name == name)
        blocks_by_tokenizer[name] = _read_blocks(args, name, length, val_split)

    results = []
    for run in runs:
        blocks = blocks_by_tokenizer[run["tokenizer"].name]
        backbone = run["backbone"].to(device)
        losses = position_loss(
            backbone, [blocks], length=run["evaluated"], batch_size=args.batch_size,
            piece_len=args.piece_len or run["train_context"] or run["evaluated"],
        )
        run["backbone"] = backbone.cpu()  # one model on the device at a time
        results.append(dict(
            label=run["path"], ckpt_path=os.path.abspath(run["path"]), backbone=type(backbone).__name__,
            tokenizer=run["tokenizer"].name, train_context=run["train_context"], context_limit=run["limit"],
            requested_len=run["requested"], evaluated_len=run["evaluated"], num_sequences=int(blocks.shape[0]),
            mean_loss=losses.mean(),
            spans=[dict(start=s, end=e, loss=losses.mean(s, e)) for s, e in context_spans(run["train_context"],
                                                                                          run["evaluated"])],
            losses=losses,
        ))
    bucket_size = args.bucket_size or max(1, max(r["evaluated_len"] for r in results) // 32)
    for result in results:
        result["buckets"] = result.pop("losses").buckets(bucket_size)
    settings = {k: getattr(args, k) for k in ("data_path", "data_name", "text_column", "max_len", "num_sequences",
                                              "batch_size", "piece_len", "txt_sample_by")}
    settings.update(val_split=val_split, bucket_size=bucket_size, device=str(device))
    try:
        os.makedirs(args.out, exist_ok=True)
    except OSError as error:
        raise LtcxError(f"cannot make --out '{args.out}' ({error.strerror or error}): pass a writable folder") from None
    json_path, png_path = os.path.join(args.out, RESULTS_JSON), os.path.join(args.out, RESULTS_PNG)
    atomic_write_text(json_path, to_json(results, settings))
    atomic_write(png_path, lambda temp: plot_position_loss(results, temp, bucket_size))
    for result in results:
        spans = "  ".join(f"[{s['start']}, {s['end']}): {s['loss']:.4f}" for s in result["spans"])
        print(f"{result['label']} ({result['backbone']}, trained on {result['train_context']}): {spans}")
    print(f"ltcx: wrote {json_path} and {png_path}")


def _max_len(text: str) -> tuple[int | None, int | None]:
    """``--max_len``: (a multiple of the training length, None) or (None, tokens)."""
    match = re.fullmatch(r"\s*(\d+)\s*[xX]\s*|\s*(\d+)\s*", text)
    value = int(match.group(1) or match.group(2)) if match else 0
    if value < 1:
        raise ConfigError(f"--max_len '{text}' is neither a number of tokens (2048) nor a multiple of the training "
                          "length (4x) of at least 1")
    return (value, None) if match.group(1) else (None, value)


def _check_memory(args, path: str, backbone, length: int, piece_len: int) -> None:
    """One line naming --max_len (and the most tokens that fit) when scoring ``path``'s model on sequences of
    ``length`` tokens (its batch, its state, the ``--num_sequences`` blocks read) takes more than the memory here,
    before any text is read."""
    from ltcx.eval.long_context import largest_fitting, scoring_bytes
    from ltcx.persist import file_fits

    def need(tokens: int) -> int:
        return scoring_bytes(backbone, tokens, args.batch_size, piece_len) + 8 * args.num_sequences * (tokens + 1)

    limit = file_fits.memory_limit()
    if limit is None or need(length) <= limit:
        return
    most = largest_fitting(need, limit, length - 1)
    raise ConfigError(f"--max_len {args.max_len}: scoring '{path}' on {args.num_sequences} sequences of {length:,} "
                      f"tokens takes about {need(length) / 2**30:,.1f} GiB, more than the {limit / 2**30:,.1f} GiB "
                      f"of memory here: pass --max_len {most} or less (tokens), or lower --num_sequences")


def _read_blocks(args, tokenizer: str, length: int, val_split: str | None):
    """The first ``--num_sequences`` validation blocks of ``length + 1`` tokens of ``--data.path`` [N, length + 1],
    as ``fit`` would read them (``TextDataModule``), each once: a text too short for that many says how many it
    had (the data module cycles a short validation stream, which would count the same text twice here)."""
    import torch

    from ltcx.data.module import TextDataModule

    batches = math.ceil(args.num_sequences / args.batch_size)
    data = TextDataModule(
        path=args.data_path, name=args.data_name, text_column=args.text_column, val_split=val_split,
        tokenizer=tokenizer, block_size=length, batch_size=args.batch_size, val_batches=batches, num_workers=0,
        holdout_fraction=args.holdout_fraction, txt_sample_by=args.txt_sample_by, pad_vocab_to_multiple_of=1,
    )
    blocks, seen = [], set()
    for batch in data.val_dataloader():
        for block in data.on_before_batch_transfer(batch, 0):
            key = block.numpy().tobytes()
            if key not in seen and len(blocks) < args.num_sequences:
                seen.add(key)
                blocks.append(block)
    if len(blocks) < args.num_sequences:
        print(f"ltcx: the text of '{args.data_path}' holds {len(blocks)} distinct sequence(s) of {length + 1} "
              f"{tokenizer} tokens, not --num_sequences {args.num_sequences}: scored those", file=sys.stderr)
    return torch.stack(blocks)

