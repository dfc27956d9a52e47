"""``ltcx lm-eval``: lm-evaluation-harness tasks on a checkpoint or an export (the adapter: ``ltcx/eval/harness.py``).

    ltcx lm-eval --ckpt_path checkpoints/gpt --tasks hellaswag,arc_easy --limit 200
    ltcx lm-eval --ckpt_path model/ --tasks my_task --include_path my_tasks/    # tasks in lm_eval's YAML format

``lm_eval`` (``pip install lm_eval``, or ``pip install -e .[eval]``) is imported only here, after the arguments are
parsed. Prints the harness's table and writes its results to ``--out`` (``results.json``).
"""

from __future__ import annotations

import glob
import json
import os
import sys
from pathlib import Path

from ltcx.cli.one_line_errors import command_parser
from ltcx.errors import ConfigError, LtcxError

__all__ = ["lm_eval_main"]

RESULTS_JSON = "results.json"
SEED_MAX = 2**32 - 1  # the harness seeds numpy, whose seeds are 32-bit


def lm_eval_main(argv: list[str]) -> None:
    """``ltcx lm-eval``: run lm-evaluation-harness tasks (multiple choice, perplexity, generation) on a model written
    by `ltcx fit` or `ltcx export`, and write the harness's results to --out."""
    parser = command_parser("lm-eval", lm_eval_main.__doc__)
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
    if args.limit is not None and not (0 < args.limit < 1 or (args.limit >= 1 and args.limit.is_integer())):
        raise ConfigError(
            f"--limit ({args.limit:g}) must be a whole number of examples per task (>= 1) or a fraction in (0, 1)"
        )
    if not 0 <= args.seed <= SEED_MAX:
        raise ConfigError(f"--seed ({args.seed}) must be in 0..{SEED_MAX} (2**32 - 1, numpy's range)")
    _check_out(args.out)
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
    from ltcx.eval.harness import LtcxLM
    from ltcx.lm import LanguageModel
    from ltcx.persist.load import load_model_and_tokenizer

    device = _device(("cuda" if torch.cuda.is_available() else "cpu") if args.device is None else args.device)
    model, _, tokenizer = load_model_and_tokenizer(args.ckpt_path, args.tokenizer, model_class=LanguageModel)
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
    from ltcx.persist.files import atomic_write_text

    path = os.path.join(args.out, RESULTS_JSON)  # --out was checked before evaluating; the disk can still fill up
    atomic_write_text(path, json.dumps(results, indent=2, default=handle_non_serializable),
                      "the results are in the table above; free space and rerun to write them")
    print(f"ltcx: wrote {path}", file=sys.stderr)


def _check_out(out: str) -> None:
    """``--out`` is a folder that exists or can be made, where results.json can be written: checked before the
    evaluation, whose results would otherwise be lost at its end."""
    if os.path.exists(out) and not os.path.isdir(out):
        raise ConfigError(f"--out '{out}' is a file: pass a folder for {RESULTS_JSON} (made if missing)")
    if os.path.isdir(os.path.join(out, RESULTS_JSON)):
        raise ConfigError(f"--out '{out}' holds a folder named {RESULTS_JSON}: move it or pass another --out folder")
    parent = os.path.abspath(out)
    while not os.path.exists(parent):  # the nearest folder that exists: the rest is made
        parent = os.path.dirname(parent)
    if not os.path.isdir(parent):
        raise ConfigError(f"--out '{out}' can not be made: '{parent}' is a file; pass a folder for {RESULTS_JSON}")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise ConfigError(f"--out '{out}': no permission to write in '{parent}'; pass a folder you can write to")


def _load_tasks(names: list[str], include_path: list[str] | None) -> tuple:
    """``(TaskManager, the requested tasks)``, built (their data read) before the model runs: the top-level tasks and
    groups of ``TaskManager.load``. lm_eval's own tasks are indexed only when a name is not among ``include_path``'s
    (indexing its thousands of YAML files takes a while). A name it does not know (or whose YAML file is malformed),
    a local data file that is missing, or data it cannot read, is one line; with the hub out of reach, data sets are
    read from ``datasets``' cache alone, at once instead of after minutes of retries."""
    from lm_eval.tasks import TaskManager

    def known(manager: TaskManager, name: str) -> bool:
        return name in manager.all_tasks or os.path.isfile(name)

    manager = TaskManager(include_path=include_path, include_defaults=False) if include_path else None
    if manager is not None and not all(known(manager, name) for name in names):
        malformed = _malformed_yaml(include_path, [name for name in names if not known(manager, name)])
        if malformed and malformed[0][2]:  # a file that spells the unknown name: that is the one
            raise _malformed_error(malformed)
    if manager is None or not all(known(manager, name) for name in names):
        manager = TaskManager(include_path=include_path)
    unknown = [name for name in names if not known(manager, name)]
    if unknown:
        malformed = _malformed_yaml(include_path or [], unknown)
        if malformed and malformed[0][2]:
            raise _malformed_error(malformed)
        skipped = (f" (lm_eval skipped the malformed task YAML file '{malformed[0][0]}': {malformed[0][1]})"
                   if malformed else "")
        raise LtcxError(
            f"lm_eval knows no task {', '.join(repr(n) for n in unknown)}: check the name (`lm_eval ls tasks` lists "
            f"them) or pass --include_path a folder holding its YAML file{skipped}"
        )
    try:
        configs = [config for name in names for config in _task_configs(manager, name, set())]
    except LtcxError:
        raise
    except Exception:  # noqa: BLE001 - a config shape this walk does not know: lm_eval's load will say what is wrong
        configs = [{}]
    for config in configs:
        _check_data_files(config)
    offline = None
    if any(_data_base(config) is None for config in configs):  # data on the hub (or a task defined in Python)
        from ltcx.hub import hub_unreachable

        offline = hub_unreachable()
    try:
        if offline:
            from ltcx.hub import cache_only

            with cache_only():
                loaded = manager.load(names)
        else:
            loaded = manager.load(names)
    except Exception as error:  # noqa: BLE001 - a task's data or config: one line, whatever lm_eval raised
        from ltcx.tokenizers import _short_reason

        chain = [error]
        while len(chain) < 32 and (chain[-1].__cause__ or chain[-1].__context__):
            chain.append(chain[-1].__cause__ or chain[-1].__context__)
        offline = offline if any(isinstance(e, ConnectionError) for e in chain) else None  # the cache lacks it
        reason = f"not in datasets' cache and {offline}" if offline else _short_reason(error)
        hint = ("run where the Hugging Face hub is reachable once (datasets caches the data) or use a local task "
                "(--include_path)" if offline else "check the task's YAML file and its dataset_path / data_files")
        raise LtcxError(f"cannot load lm_eval task(s) {', '.join(names)} ({reason}): {hint}") from None
    # Top level: groups in no other group, and tasks in no group (simple_evaluate re-collects their members).
    members = {task for group in loaded["groups"].values() for task in group.child_names}
    top_groups = [group for name, group in loaded["groups"].items() if name not in members]
    in_groups = {task.task_name for group in top_groups for task in group.get_all_tasks()}
    return manager, top_groups + [task for name, task in loaded["tasks"].items() if name not in in_groups]


def _malformed_yaml(folders: list[str], names: list[str]) -> list[tuple[str, str, bool]]:
    """``(file, reason, whether its text names one of names)`` of each YAML file under folders that lm_eval can not
    read (it skips them silently, so their tasks are merely unknown); those naming a requested task first."""
    found = []
    for folder in folders:
        for path in sorted(Path(folder).rglob("*.yaml")):
            if {"__pycache__", ".ipynb_checkpoints"} & set(path.parts):
                continue
            reason, _ = _read_task_yaml(path)
            if reason is not None:
                try:
                    text = path.read_text(errors="replace")
                except OSError:
                    text = ""
                found.append((str(path), reason, any(name in text for name in names)))
    return sorted(found, key=lambda item: not item[2])


def _read_task_yaml(path: Path) -> tuple[str | None, dict | None]:
    """``(None, config)`` of a task or group YAML file as lm_eval reads it (includes resolved, ``!function`` tags
    not), or ``(why it is malformed, None)``: where a YAML error is, a config that is neither task nor group."""
    from lm_eval.tasks._yaml_loader import load_yaml

    try:
        config = load_yaml(path, resolve_func=False, recursive=True)
    except Exception as error:  # noqa: BLE001 - what lm_eval's index skips
        mark = getattr(error, "problem_mark", None)
        if mark is None:
            from ltcx.tokenizers import _short_reason

            return _short_reason(error), None
        where = "" if mark.name in (str(path), "<unicode string>") else f"in {mark.name}, "  # an included file
        return f"{where}line {mark.line + 1}, column {mark.column + 1}: {error.problem}", None  # type: ignore[attr-defined]
    if isinstance(config, dict) and ("task" in config or "group" in config):
        return None, config
    return "it holds neither a task: nor a group: key", None


def _malformed_error(malformed: list[tuple[str, str, bool]]) -> LtcxError:
    path, reason, _ = malformed[0]
    more = f" (and {len(malformed) - 1} more malformed YAML files)" if len(malformed) > 1 else ""
    return LtcxError(f"task YAML file '{path}' is malformed ({reason}){more}: fix it (lm_eval skips a file it can not "
                     "read, and its task is unknown)")


def _task_configs(manager, name: str, seen: set[str]) -> list[dict]:
    """The configs of the tasks ``name`` stands for (a task, a group's members, a tag's tasks), includes resolved;
    ``{}`` for a task defined in Python (its data is not known here)."""
    from lm_eval.tasks._index import Kind

    entry = manager.task_index.get(name)
    if name in seen:
        return []
    seen.add(name)
    if entry is None and os.path.isfile(name):  # --tasks a YAML file's path
        reason, config = _read_task_yaml(Path(name))
        if reason is not None:
            raise _malformed_error([(name, reason, True)])
        return [config] if "task" in config and not isinstance(config["task"], list) else [{}]  # type: ignore[operator,index]
    if entry is None:
        return [{}]
    if entry.kind == Kind.TASK:
        return [entry.cfg or {}]
    if entry.kind == Kind.TAG:
        return [config for other, e in manager.task_index.items() if name in e.tags
                for config in _task_configs(manager, other, seen)]
    if entry.kind != Kind.GROUP:
        return [{}]
    children = (entry.cfg or {}).get("task") or []
    configs = []
    for child in children if isinstance(children, list) else [children]:
        if isinstance(child, str):
            configs += _task_configs(manager, child, seen)
        elif isinstance(child, dict):  # an inline task, or overrides of a registered one
            base = manager.task_index.get(child.get("task")) if isinstance(child.get("task"), str) else None
            configs.append({**((base.cfg or {}) if base is not None else {}), **child})
    return configs


def _data_base(config: dict) -> str | None:
    """The folder a task's local data_files are read from (the current folder for a file format such as json, the
    dataset_path folder), or None for data on the hub."""
    from datasets.packaged_modules import _PACKAGED_DATASETS_MODULES

    path = config.get("dataset_path")
    if not isinstance(path, str):
        return None
    if path in _PACKAGED_DATASETS_MODULES:
        return os.getcwd()
    return path if os.path.isdir(path) or path.startswith(("/", "./", "../", "~")) else None


def _check_data_files(config: dict) -> None:
    """A local data file a task names that does not exist, in one line naming it (not a hint about the hub)."""
    base = _data_base(config)
    if base is None:
        return
    task = config.get("task", "?")
    if not os.path.exists(os.path.expanduser(base)):
        raise LtcxError(f"lm_eval task '{task}' reads its data from '{base}' (dataset_path), which does not exist: "
                        "fix dataset_path in its YAML file")
    kwargs = config.get("dataset_kwargs")
    files = kwargs.get("data_files") if isinstance(kwargs, dict) else None
    patterns = files.values() if isinstance(files, dict) else [files]
    for pattern in (p for item in patterns for p in (item if isinstance(item, list) else [item])):
        if not isinstance(pattern, str) or "://" in pattern:
            continue
        path = os.path.join(os.path.expanduser(base), os.path.expanduser(pattern))
        if not (glob.glob(path) if glob.has_magic(path) else os.path.exists(path)):
            raise LtcxError(f"lm_eval task '{task}' reads data file '{path}', which does not exist: fix data_files "
                            "(dataset_kwargs) in its YAML file, or write the file")
