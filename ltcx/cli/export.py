"""``ltcx export``: a checkpoint's model as a weights-only folder."""

from __future__ import annotations

import os

from ltcx.cli.one_line_errors import command_parser
from ltcx.errors import missing_checkpoint

__all__ = ["export_main"]


def export_main(argv: list[str]) -> None:
    """``ltcx export``: a checkpoint's model as a weights-only folder (model.safetensors + config.json) to share
    without pickles; ``LanguageModel.from_pretrained(folder)`` and ``ltcx generate --ckpt_path folder`` read it."""
    parser = command_parser("export", export_main.__doc__)
    parser.add_argument("--ckpt_path", required=True, help="checkpoint written by `ltcx fit`, or its checkpoint folder")
    parser.add_argument("--out", required=True, help="a new folder to write")
    parser.add_argument(
        "--tokenizer", default=None,
        help="the tokenizer name to record instead of the checkpoint's: gpt2, bytes or a Hugging Face hub id (the "
        "folder holds no tokenizer, and a folder name is never recorded)",
    )
    parser.add_argument(
        "--format", choices=["ltcx", "hf", "gpt2"], default="ltcx",
        help="ltcx: ltcx's own folder; hf: a transformers folder for every architecture (`import ltcx.hf`, then "
        "AutoModelForCausalLM / AutoTokenizer.from_pretrained), with the tokenizer's files and a model card; gpt2: "
        "a GPT as GPT2LMHeadModel, which transformers loads without ltcx",
    )
    parser.add_argument("--license", default=None, help="--format hf/gpt2: the model card's license (a hub license id)")
    args = parser.parse_args(argv)
    if not os.path.exists(args.ckpt_path):
        raise missing_checkpoint(args.ckpt_path)
    from ltcx.lm import LanguageModel  # after parsing: --help and a mistyped flag answer at once
    from ltcx.persist.export import export_model

    if args.format != "ltcx":
        from ltcx.persist.hf_export import export_hf

        out = export_hf(args.ckpt_path, args.out, tokenizer=args.tokenizer, model_class=LanguageModel,
                        layout=args.format, license=args.license)
        print(f"ltcx: exported to {out}/ ({', '.join(sorted(p.name for p in out.iterdir()))})")
        return
    out = export_model(args.ckpt_path, args.out, tokenizer=args.tokenizer, model_class=LanguageModel)
    print(f"ltcx: exported to {out}/ ({', '.join(sorted(p.name for p in out.iterdir()))})")
