"""``ltcx generate``: stream a completion of each prompt from a checkpoint or an export to stdout."""

from __future__ import annotations

import json
import os
import sys

from ltcx.cli.one_line_errors import command_parser
from ltcx.errors import LtcxError, missing_checkpoint

__all__ = ["generate_main"]

SEED_MAX = 2**64 - 1  # torch.Generator.manual_seed takes 64 bits


def generate_main(argv: list[str]) -> None:
    """``ltcx generate``: stream a completion of each prompt from a checkpoint to stdout."""
    parser = command_parser("generate", generate_main.__doc__)
    parser.add_argument(
        "--ckpt_path", required=True,
        help="checkpoint written by `ltcx fit` (e.g. .../version_0/last.ckpt), a checkpoint folder (its latest run's "
        "last.ckpt) or a folder written by `ltcx export`",
    )
    parser.add_argument(
        "--prompt", action="append",
        help="prompt text; repeat for several prompts, which run as one batch (each sample printed when the batch "
        "ends; a single prompt streams) (none: start a new document)"
    )
    parser.add_argument("--max_new_tokens", type=int, default=200)
    parser.add_argument("--temperature", type=float, default=0.8,
                        help="0 = greedy, as is one too small to scale the logits in float32 (1e-40)")
    parser.add_argument("--top_k", type=int, default=50)
    parser.add_argument("--top_p", type=float, default=None)
    parser.add_argument("--num_samples", type=int, default=1, help="completions per prompt")
    parser.add_argument("--seed", type=int, default=None, help=f"0..{SEED_MAX} (none: a fresh random seed)")
    parser.add_argument(
        "--no_stop_at_eot", action="store_true",
        help="keep going after the end-of-text token (by default a sample ends there, with a notice on stderr)",
    )
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
    if args.seed is not None and not 0 <= args.seed <= SEED_MAX:
        raise LtcxError(f"--seed ({args.seed}) must be in 0..{SEED_MAX} (2**64 - 1, torch's range)")
    if not os.path.exists(args.ckpt_path):
        raise missing_checkpoint(args.ckpt_path)
    # Imported after the arguments are parsed: `ltcx generate --help` and a mistyped flag answer at once.
    import torch

    from ltcx.generation import check_generation_args, pad_prompts, stream_tokens, takes_mask
    from ltcx.lm import LanguageModel
    from ltcx.persist.load import load_model_and_tokenizer

    if args.num_samples < 1:
        raise LtcxError(f"--num_samples ({args.num_samples}) must be >= 1")
    device = _device(("cuda" if torch.cuda.is_available() else "cpu") if args.device is None else args.device)

    model, _, tokenizer = load_model_and_tokenizer(args.ckpt_path, args.tokenizer, map_location=device,
                                                   model_class=LanguageModel)
    backbone = model.backbone.to(device=device, dtype=getattr(torch, args.dtype))
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
    sampling = dict(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, stop_token=stop,
                    vocab_limit=tokenizer.vocab_size, generator=generator)
    if len(prompts) > 1 and takes_mask(backbone):  # one batch of all prompts and samples, printed at its end
        rows = [(prompt, ids, i) for prompt, ids in prompts for i in range(args.num_samples)]
        batch, mask = pad_prompts([ids for _, ids, _ in rows], tokenizer.eot_id, device)
        new = list(stream_tokens(backbone, batch, args.max_new_tokens, mask=mask, **sampling))
        tokens = torch.stack(new, dim=1).tolist() if new else [[] for _ in rows]
        for (prompt, _, i), row in zip(rows, tokens):
            stopped = stop in row
            row = row[:row.index(stop)] if stopped else row
            label = _sample_label(prompt, i, args.num_samples, several_prompts=True)
            sys.stdout.write(f"{label}\n{prompt}{tokenizer.decode(row)}\n")
            sys.stdout.flush()
            if stopped:
                _stopped_notice(label, len(row), args.max_new_tokens)
        return
    for prompt, ids in prompts:
        # Samples run one after another, so each streams as it is produced (a batch could only be shown at its end).
        for i in range(args.num_samples):
            label = _sample_label(prompt, i, args.num_samples, several_prompts=len(prompts) > 1)
            if label:
                sys.stdout.write(label + "\n")
            sys.stdout.write(prompt)
            row: list[int] = []
            printed = 0  # characters of the completion already written
            stopped = False  # at the end-of-text token, before max_new_tokens
            for token in stream_tokens(backbone, torch.tensor([ids], dtype=torch.long, device=device),
                                       args.max_new_tokens, **sampling):
                if int(token) == stop:
                    stopped = True
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
            if stopped:
                _stopped_notice(label, len(row), args.max_new_tokens)


def _stopped_notice(label: str, new_tokens: int, max_new_tokens: int) -> None:
    """Fewer tokens than asked for: say why, once, after the sample (on stderr)."""
    which = f"{label[4:]}: " if label else ""
    print(f"ltcx: {which}stopped at end-of-text after {new_tokens} new tokens (--max_new_tokens {max_new_tokens}); "
          "pass --no_stop_at_eot to continue past it", file=sys.stderr)


def _sample_label(prompt: str, index: int, num_samples: int, several_prompts: bool) -> str:
    """The line above a sample when there are several: ``--- sample 2 of 3, prompt "Once upon"`` (the prompt quoted
    as JSON, cut at 40 characters), so each sample says which prompt it continues; "" for a single sample."""
    shown = json.dumps(prompt if len(prompt) <= 40 else prompt[:37] + "...", ensure_ascii=False)
    if num_samples > 1:
        return f"--- sample {index + 1} of {num_samples}" + (f", prompt {shown}" if prompt else "")
    return f"--- prompt {shown}" if several_prompts else ""


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
