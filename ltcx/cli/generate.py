"""``ltcx generate``: stream a completion of each prompt from a checkpoint or an export to stdout."""

from __future__ import annotations

import argparse
import os
import sys

from ltcx.errors import LtcxError

__all__ = ["generate_main"]


def generate_main(argv: list[str]) -> None:
    """``ltcx generate``: stream a completion of each prompt from a checkpoint to stdout."""
    parser = argparse.ArgumentParser(prog="ltcx generate", description=generate_main.__doc__)
    parser.add_argument(
        "--ckpt_path", required=True,
        help="checkpoint written by `ltcx fit` (e.g. .../version_0/last.ckpt), a checkpoint folder (its latest run's "
        "last.ckpt) or a folder written by `ltcx export`",
    )
    parser.add_argument(
        "--prompt", action="append", help="prompt text; repeat for several prompts (none: start a new document)"
    )
    parser.add_argument("--max_new_tokens", type=int, default=200)
    parser.add_argument("--temperature", type=float, default=0.8, help="0 = greedy")
    parser.add_argument("--top_k", type=int, default=50)
    parser.add_argument("--top_p", type=float, default=None)
    parser.add_argument("--num_samples", type=int, default=1, help="completions per prompt")
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--no_stop_at_eot", action="store_true", help="keep going after the end-of-text token")
    parser.add_argument(
        "--tokenizer", default=None,
        help="override the tokenizer stored in the checkpoint (gpt2, bytes, a Hugging Face id or local folder; a "
        "folder the checkpoint names is only loaded when given here)",
    )
    parser.add_argument("--device", default=None)  # None: cuda if torch sees one, else cpu
    parser.add_argument(
        "--dtype", choices=["float32", "bfloat16"], default="float32",
        help="the weights' type while sampling (bfloat16: half the memory and bytes read per token; on a GPU)",
    )
    args = parser.parse_args(argv)
    # Imported after the arguments are parsed: `ltcx generate --help` and a mistyped flag answer at once.
    import torch

    from ltcx.generation import check_generation_args, stream_tokens
    from ltcx.persist import EXPORT_CONFIG, load_language_model
    from ltcx.tokenizers import get_tokenizer, stored_tokenizer_name, vocab_fits

    if args.num_samples < 1:
        raise LtcxError(f"--num_samples ({args.num_samples}) must be >= 1")
    device = _device(("cuda" if torch.cuda.is_available() else "cpu") if args.device is None else args.device)

    model, meta = load_language_model(args.ckpt_path, map_location=device)
    backbone = model.backbone.to(device=device, dtype=getattr(torch, args.dtype))
    stored = meta.get("tokenizer")
    exported = os.path.isfile(os.path.join(args.ckpt_path, EXPORT_CONFIG))
    source = f"exported model '{args.ckpt_path}'" if exported else f"checkpoint '{args.ckpt_path}'"
    tokenizer_name = args.tokenizer or stored_tokenizer_name(
        stored, f"{source} names tokenizer",
        "ltcx loads no tokenizer folder a file names; if you trust it, pass --tokenizer FOLDER yourself",
    )
    if tokenizer_name is None:
        raise LtcxError("the checkpoint names no tokenizer: pass --tokenizer (e.g. gpt2)")
    tokenizer = get_tokenizer(tokenizer_name)
    model_vocab = meta.get("backbone_config", {}).get("vocab_size")
    if model_vocab is not None and not vocab_fits(tokenizer.vocab_size, model_vocab):
        if args.tokenizer in (None, stored):
            fix = f"{source} names another tokenizer than its model's: pass the --tokenizer it was trained with"
        elif stored is not None:
            fix = f"it was trained with tokenizer {stored!r}: pass that --tokenizer"
        else:
            fix = "pass the --tokenizer it was trained with"
        raise LtcxError(
            f"tokenizer {tokenizer_name!r} ({tokenizer.vocab_size} ids) does not fit the model's vocabulary of "
            f"{model_vocab}: {fix}"
        )
    generator = torch.Generator(device=device)
    if args.seed is not None:
        generator.manual_seed(args.seed)
    else:
        generator.seed()
    stop = None if args.no_stop_at_eot else tokenizer.eot_id
    # Without a prompt, generation starts from the end-of-text token, as at a document boundary in training.
    prompts = [(text, tokenizer.encode(text)) for text in args.prompt] if args.prompt else [("", [tokenizer.eot_id])]
    for _, ids in prompts:  # every prompt is checked before anything is printed
        check_generation_args(backbone, len(ids), args.max_new_tokens, args.temperature, args.top_k, args.top_p)
    for prompt, ids in prompts:
        # Samples run one after another, so each streams as it is produced (a batch could only be shown at its end).
        for i in range(args.num_samples):
            if args.num_samples > 1:
                sys.stdout.write(f"--- sample {i + 1}\n")
            sys.stdout.write(prompt)
            row: list[int] = []
            printed = 0  # characters of the completion already written
            for token in stream_tokens(
                backbone, torch.tensor([ids], dtype=torch.long, device=device), args.max_new_tokens,
                temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, stop_token=stop,
                vocab_limit=tokenizer.vocab_size, generator=generator,
            ):
                if int(token) == stop:
                    break
                row.append(int(token))
                # Decode the whole completion and write what is new, holding back a character that is still
                # incomplete (a multi-byte character split over tokens decodes as U+FFFD until its last byte).
                text = tokenizer.decode(row)
                if not text.endswith("\ufffd"):
                    sys.stdout.write(text[printed:])
                    sys.stdout.flush()
                    printed = len(text)
            sys.stdout.write(tokenizer.decode(row)[printed:] + "\n")
            sys.stdout.flush()


def _device(name: str):
    """``--device`` as a torch device that exists on this machine, else one line naming what does."""
    import torch

    try:
        device = torch.device(name)
    except RuntimeError:
        raise LtcxError(f"--device '{name}' is not a device name: use cpu or cuda (cuda:N)") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise LtcxError(f"--device {name}: this machine has no usable CUDA device (torch sees none); use --device cpu")
    if device.type == "cuda" and device.index is not None and device.index >= torch.cuda.device_count():
        raise LtcxError(f"--device {name}: there are only {torch.cuda.device_count()} CUDA devices")
    return device
