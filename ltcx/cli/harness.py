"""``ltcx lm-eval``: lm-evaluation-harness tasks on a checkpoint or an export (the adapter: ``ltcx/harness.py``).

    ltcx lm-eval --ckpt_path checkpoints/gpt --tasks hellaswag,arc_easy --limit 200
    ltcx lm-eval --ckpt_path model/ --tasks my_task --include_path my_tasks/    # tasks in lm_eval's YAML format

``lm_eval`` (``pip install lm_eval``, or ``pip install -e .[eval]``) is imported only here, after the arguments are
parsed. Prints the harness's table and writes its results to ``--out`` (``results.json``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from ltcx.errors import ConfigError, LtcxError

__all__ = ["harness_main"]

RESULTS_JSON = "results.json"


def harness_main(argv: list[str]) -> None:
    """``ltcx lm-eval``: run lm-evaluation-harness tasks (multiple choice, perplexity, generation) on a model written
    by `ltcx fit` or `ltcx export`, and write the harness's results to --out."""
    parser = argparse.ArgumentParser(prog="ltcx lm-eval", description=harness_main.__doc__)
    parser.add_argument(
        "--ckpt_path", required=True,
        help="checkpoint written by `ltcx fit`, a checkpoint folder (its latest run's last.ckpt) or a folder written "
        "by `ltcx export`",
    )
    parser.add_argument(
        "--tasks", action="append", required=True,
        help="task, group or tag names lm_eval knows, or paths of task YAML files; comma-separated or repeated",
    )
    parser.add_argument("--include_path", action="append", default=None,
                        help="a folder of task YAML files (lm_eval's format) to add to the known tasks; repeatable")
    parser.add_argument("--num_fewshot", type=int, default=None, help="few-shot examples (default: each task's)")
    parser.add_argument("--limit", type=float, default=None,
                        help="examples per task (a number below 1: that fraction); for quick checks")
    parser.add_argument("--batch_size", type=int, default=8, help="sequences per forward")
    parser.add_argument("--piece_len", type=int, default=None,
                        help="tokens per forward, the state carried between pieces (default: whole sequences)")
    parser.add_argument("--bootstrap_iters", type=int, default=100000,
                        help="bootstrap resamples for the standard errors of metrics without a closed form (0: none)")
    parser.add_argument("--seed", type=int, default=1234, help="seed of the few-shot sampling and any sampling")
    parser.add_argument("--tokenizer", default=None,
                        help="override the stored tokenizer (gpt2, bytes, a Hugging Face id or local folder)")
    parser.add_argument("--device", default=None)  # None: cuda if torch sees one, else cpu
    parser.add_argument("--out", default="lm_eval", help=f"folder for {RESULTS_JSON}")
    args = parser.parse_args(argv)
    tasks = [name.strip() for value in args.tasks for name in value.split(",") if name.strip()]
    if not tasks:
        raise ConfigError("--tasks names no task: pass task names, e.g. --tasks hellaswag,arc_easy")
    for name in ("batch_size", "piece_len"):
        value = getattr(args, name)
        if value is not None and value < 1:
            raise ConfigError(f"--{name} ({value}) must be >= 1")
    if args.num_fewshot is not None and args.num_fewshot < 0:
        raise ConfigError(f"--num_fewshot ({args.num_fewshot}) must be >= 0")
    if args.limit is not None and not args.limit > 0:
        raise ConfigError(f"--limit ({args.limit}) must be > 0")
    for folder in args.include_path or []:
        if not os.path.isdir(folder):
            raise LtcxError(f"--include_path '{folder}' is not a folder: pass a folder of task YAML files")

    try:
        import lm_eval  # noqa: F401 - the optional dependency, checked before the model is loaded
    except ImportError:
        raise LtcxError(
            "ltcx lm-eval needs the lm_eval package: pip install lm_eval==0.4.13 (or pip install -e .[eval])"
        ) from None
    import torch

    from ltcx.cli.generate import _device
    from ltcx.harness import LtcxLM
    from ltcx.persist.load import load_model_and_tokenizer

    device = _device(("cuda" if torch.cuda.is_available() else "cpu") if args.device is None else args.device)
    model, _, tokenizer = load_model_and_tokenizer(args.ckpt_path, args.tokenizer)
    manager, loaded = _load_tasks(tasks, args.include_path)
    lm = LtcxLM(model.backbone, tokenizer, batch_size=args.batch_size, device=device, piece_len=args.piece_len,
                name=args.ckpt_path)

    from lm_eval import simple_evaluate
    from lm_eval.utils import handle_non_serializable, make_table

    results = simple_evaluate(
        model=lm, tasks=loaded, task_manager=manager, num_fewshot=args.num_fewshot, limit=args.limit,
        bootstrap_iters=args.bootstrap_iters, log_samples=False, random_seed=args.seed, numpy_random_seed=args.seed,
        torch_random_seed=args.seed, fewshot_random_seed=args.seed,
    )
    print(make_table(results))
    if results.get("groups"):
        print(make_table(results, "groups"))
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, RESULTS_JSON)
    temp = f"{path}.tmp-{os.getpid()}"
    with open(temp, "w") as f:
        json.dump(results, f, indent=2, default=handle_non_serializable)
    os.replace(temp, path)
    print(f"ltcx: wrote {path}", file=sys.stderr)


def _load_tasks(names: list[str], include_path: list[str] | None) -> tuple:
    """``(TaskManager, the requested tasks)``, built (their data read) before the model runs: the top-level tasks and
    groups of ``TaskManager.load``. lm_eval's own tasks are indexed only when a name is not among ``include_path``'s
    (indexing its thousands of YAML files takes a while). A name it does not know, or data it cannot read, is one
    line."""
    from lm_eval.tasks import TaskManager

    def known(manager: TaskManager, name: str) -> bool:
        return name in manager.all_tasks or os.path.isfile(name)

    manager = TaskManager(include_path=include_path, include_defaults=False) if include_path else None
    if manager is None or not all(known(manager, name) for name in names):
        manager = TaskManager(include_path=include_path)
    unknown = [name for name in names if not known(manager, name)]
    if unknown:
        raise LtcxError(
            f"lm_eval knows no task {', '.join(repr(n) for n in unknown)}: check the name (`lm_eval ls tasks` lists "
            "them) or pass --include_path a folder holding its YAML file"
        )
    try:
        loaded = manager.load(names)
    except Exception as error:  # noqa: BLE001 - a task's data or config: one line, whatever lm_eval raised
        from ltcx.hub import hub_unreachable
        from ltcx.tokenizers import _short_reason

        offline = hub_unreachable()
        hint = (f"the Hugging Face hub is unreachable ({offline}) and most of lm_eval's tasks read their data from it; "
                "run where it is reachable once (datasets caches it) or use a local task (--include_path)"
                if offline else "check the task's YAML file and its dataset_path / data_files")
        raise LtcxError(f"cannot load lm_eval task(s) {', '.join(names)} ({_short_reason(error)}): {hint}") from None
    # Top level: groups in no other group, and tasks in no group (simple_evaluate re-collects their members).
    members = {task for group in loaded["groups"].values() for task in group.child_names}
    top_groups = [group for name, group in loaded["groups"].items() if name not in members]
    in_groups = {task.task_name for group in top_groups for task in group.get_all_tasks()}
    return manager, top_groups + [task for name, task in loaded["tasks"].items() if name not in in_groups]
