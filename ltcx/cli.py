"""Command line: LightningCLI (fit, validate, test, predict) plus ``generate``.

    ltcx fit --config configs/gpt.yaml
    ltcx generate --ckpt_path checkpoints/gpt/last.ckpt --prompt "Once upon a time"
"""

from __future__ import annotations

import argparse
import sys

import torch
from lightning.pytorch.cli import LightningCLI

from ltcx.data import TextDataModule
from ltcx.errors import LtcxError
from ltcx.lm import LanguageModel


DESCRIPTION = "ltcx: train and evaluate language models (`ltcx generate --help` samples from a checkpoint)"


class LtcxCLI(LightningCLI):
    def add_arguments_to_parser(self, parser) -> None:
        # The model's vocabulary always matches the data's tokenizer: nobody keeps vocab_size by hand.
        parser.link_arguments("data.padded_vocab_size", "model.backbone.init_args.vocab_size", apply_on="instantiate")

    def before_instantiate_classes(self) -> None:
        config = self.config[self.subcommand] if self.subcommand else self.config
        precision = str(config.trainer.precision)
        wants_gpu = config.trainer.accelerator in ("auto", "cuda", "gpu")
        if "bf16" in precision and wants_gpu and not torch.cuda.is_available():
            # The same YAML trains in bf16 on a GPU and in float32 on a CPU-only machine.
            print(f"ltcx: no CUDA device, so trainer.precision {precision} -> 32-true", file=sys.stderr)
            config.trainer.precision = "32-true"


def cli_main(args: list[str] | None = None) -> LtcxCLI:
    return LtcxCLI(
        LanguageModel,
        TextDataModule,
        save_config_kwargs={"overwrite": True},
        parser_kwargs={"description": DESCRIPTION},
        args=args,
    )


def generate_main(argv: list[str]) -> None:
    """``ltcx generate``: stream a completion of each prompt from a checkpoint to stdout."""
    from ltcx.generation import stream_tokens
    from ltcx.lm import load_language_model
    from ltcx.tokenizers import get_tokenizer

    parser = argparse.ArgumentParser(prog="ltcx generate", description=generate_main.__doc__)
    parser.add_argument("--ckpt_path", required=True, help="checkpoint written by `ltcx fit` (e.g. .../last.ckpt)")
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
    parser.add_argument("--tokenizer", default=None, help="override the tokenizer stored in the checkpoint")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args(argv)

    model, meta = load_language_model(args.ckpt_path, map_location=args.device)
    backbone = model.backbone.to(args.device)
    tokenizer_name = args.tokenizer or meta.get("tokenizer")
    if tokenizer_name is None:
        raise LtcxError("the checkpoint names no tokenizer: pass --tokenizer (e.g. gpt2)")
    tokenizer = get_tokenizer(tokenizer_name)
    generator = torch.Generator(device=args.device)
    if args.seed is not None:
        generator.manual_seed(args.seed)
    else:
        generator.seed()
    stop = None if args.no_stop_at_eot else tokenizer.eot_id
    # Without a prompt, generation starts from the end-of-text token, as at a document boundary in training.
    prompts = [(text, tokenizer.encode(text)) for text in args.prompt] if args.prompt else [("", [tokenizer.eot_id])]
    for prompt, ids in prompts:
        batch = torch.tensor([ids] * args.num_samples, dtype=torch.long, device=args.device)
        rows: list[list[int]] = [[] for _ in range(args.num_samples)]
        printed = 0  # characters of rows[0]'s completion already written
        if args.num_samples == 1:
            sys.stdout.write(prompt)
        for token in stream_tokens(
            backbone, batch, args.max_new_tokens, temperature=args.temperature, top_k=args.top_k,
            top_p=args.top_p, stop_token=stop, vocab_limit=tokenizer.vocab_size, generator=generator,
        ):
            for row, t in zip(rows, token.tolist()):
                if t != stop:
                    row.append(t)
            if args.num_samples == 1:
                # Decode the whole completion and write what is new, holding back a character that is still
                # incomplete (a multi-byte character split over tokens decodes as U+FFFD until its last byte).
                text = tokenizer.decode(rows[0])
                if not text.endswith("\ufffd"):
                    sys.stdout.write(text[printed:])
                    sys.stdout.flush()
                    printed = len(text)
        if args.num_samples == 1:
            sys.stdout.write(tokenizer.decode(rows[0])[printed:] + "\n")
        else:
            for i, row in enumerate(rows):
                sys.stdout.write(f"--- sample {i + 1}\n{prompt}{tokenizer.decode(row)}\n")
        sys.stdout.flush()


def main(argv: list[str] | None = None) -> None:
    """``ltcx`` / ``python run.py``: ``generate`` or a LightningCLI subcommand; user errors as one line."""
    command_line = sys.argv[1:] if argv is None else argv
    try:
        if command_line and command_line[0] == "generate":
            generate_main(command_line[1:])
        else:
            cli_main(argv)  # None: LightningCLI reads sys.argv itself
    except LtcxError as error:
        print(f"ltcx: error: {error}", file=sys.stderr)
        sys.exit(2)
