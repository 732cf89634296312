"""``mindformers-py``: ``run`` recipes, ``convert`` checkpoints, ``show`` presets, ``plan`` layouts, ``preprocess`` data.

``preprocess`` writes text into Megatron's indexed format (``.bin``/``.idx``).

User errors (:class:`MindFormersError`) print as one line on stderr with exit status 2, once per job however many
ranks meet them; an interrupt (Ctrl-C) prints one line in the process that started the ranks (none in the ranks) and
exits with status 130; anything else is a bug and keeps its traceback.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import time

from .errors import MindFormersError


def _cmd_run(args: argparse.Namespace) -> int:
    from .recipes.loader import apply_overrides, load_recipe, parse_overrides

    # The recipe's names and the flags are checked before torch loads: such a mistake answers at once.
    recipe = apply_overrides(load_recipe(args.config), parse_overrides(args.extra))
    from .recipes import run_recipe

    run_recipe(recipe)
    return 0


def _cmd_convert(args: argparse.Namespace) -> int:
    from .convert import convert_checkpoint

    out = convert_checkpoint(args.src, args.dst, to=args.to, merge=args.merge)
    print(f"wrote {out}")
    return 0


def _cmd_show(args: argparse.Namespace) -> int:
    from .auto import AutoConfig

    AutoConfig.show_support_list()
    return 0


def _cmd_plan(args: argparse.Namespace) -> int:
    import json

    from .planner.plan_command import parse_overrides, run_plan

    report = run_plan(args.source, args.devices, args.device, args.devices_per_node, args.global_batch,
                      args.seq_length, parse_overrides(args.set))
    print(json.dumps(report.to_json(), indent=1) if args.json else report.text(args.top))
    return 0


def _cmd_preprocess(args: argparse.Namespace) -> int:
    from .data.megatron.preprocess import load_preprocess_tokenizer, preprocess

    tokenizer = load_preprocess_tokenizer(args.tokenizer or args.tokenizer_model, args.tokenizer_type, args.vocab_file,
                                          args.merge_file)
    result = preprocess(args.input, args.output_prefix, tokenizer, args.json_keys, args.workers, args.append_eod,
                        args.format)
    for prefix in result.prefixes.values():
        print(f"wrote {prefix}.bin and {prefix}.idx")
    print(f"{result.documents} documents, {result.tokens} tokens in {result.seconds:.1f} s "
          f"({result.tokens / max(result.seconds, 1e-9):,.0f} tokens/s)")
    return 0


def _add_preprocess_parser(sub: argparse._SubParsersAction) -> None:
    pre = sub.add_parser("preprocess", help="tokenise text into Megatron's indexed format (.bin/.idx)",
                         description="Tokenise JSONL / Parquet / CSV / text files or a saved datasets folder into "
                         "Megatron's indexed format, with the flags and file names of Megatron-LM's "
                         "tools/preprocess_data.py: writes <output-prefix>_<key>_document.bin/.idx per json key.")
    pre.add_argument("--input", nargs="+", required=True, help="input files or glob patterns (jsonl/json, parquet, csv, "
                     "text: one document per file), or a datasets save_to_disk folder")
    pre.add_argument("--output-prefix", required=True, help="path prefix of the output files")
    pre.add_argument("--json-keys", nargs="+", default=["text"], help="columns to tokenise, one indexed dataset each "
                     "(default: text)")
    pre.add_argument("--workers", type=int, default=1, help="tokenising processes (datasets.map's num_proc)")
    pre.add_argument("--append-eod", action="store_true", help="add the tokenizer's eos token after every document")
    pre.add_argument("--tokenizer", help="a tokenizer folder or hub name (transformers' AutoTokenizer)")
    pre.add_argument("--tokenizer-type", default="HuggingFaceTokenizer",
                     help="Megatron's tokenizer type: HuggingFaceTokenizer (with --tokenizer-model or --tokenizer) or "
                     "GPT2BPETokenizer (with --vocab-file and --merge-file)")
    pre.add_argument("--tokenizer-model", help="Megatron's name for --tokenizer")
    pre.add_argument("--vocab-file", help="GPT2BPETokenizer: the vocabulary (vocab.json)")
    pre.add_argument("--merge-file", help="GPT2BPETokenizer: the merges (merges.txt)")
    pre.add_argument("--format", choices=["json", "parquet", "csv", "text"],
                     help="input format (default: from the extension)")
    pre.set_defaults(func=_cmd_preprocess)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="mindformers-py", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser(
        "run", help="run a task recipe (YAML); override any field with --name value or --section.name value",
        description="Run a task recipe. Overrides: --<training or parallel field> VALUE (e.g. --max_steps 8, "
        "--parallel_mode semi_auto_parallel, --data_parallel 2), --run_mode train|finetune|eval|predict, or a dotted "
        "path --<section>.<field> VALUE (e.g. --model.num_layers 4, --data.block_size 128).",
    )
    run.add_argument("config", help="recipe file, e.g. tasks/gpt/pretrain_tiny.yaml")
    run.set_defaults(func=_cmd_run)
    conv = sub.add_parser("convert", help="convert a checkpoint between our format and HF's")
    conv.add_argument("src", help="source checkpoint folder (ours or HF)")
    conv.add_argument("dst", help="destination folder (written atomically)")
    conv.add_argument("--to", choices=["hf", "mindformers"], default="hf", help="target format")
    conv.add_argument("--merge", action="store_true", help="a peft adapter folder: merge it into its base model and "
                      "write the whole model (without it, the adapter alone is written under transformers' names)")
    conv.set_defaults(func=_cmd_convert)
    show = sub.add_parser("show", help="list model families, presets and loadable HF architectures")
    show.set_defaults(func=_cmd_show)
    plan = sub.add_parser("plan", help="estimate the parallel layouts of a model on N accelerators (starts nothing)",
                          description="Estimate memory per rank, step time and throughput of every data/context/"
                          "tensor/pipeline/expert-parallel layout of a model on N accelerators, and choose one.")
    plan.add_argument("source", help="a recipe (tasks/gpt/pretrain_tiny.yaml), a preset (llama_1b), an HF config.json "
                      "or a checkpoint folder")
    plan.add_argument("--devices", type=int, required=True, help="accelerators in the job")
    plan.add_argument("--device", default="h100_80gb", help="accelerator from the catalog shipped in "
                      "mindformers_py/planner/devices.yaml (default h100_80gb; a wrong name lists them)")
    plan.add_argument("--devices_per_node", type=int, help="accelerators per node (default: the catalog's, 8)")
    plan.add_argument("--global_batch", type=int, help="sequences per optimizer step, the same for every layout "
                      "(default: a recipe's: per-device batch x gradient accumulation x its data_parallel; else one "
                      "per device)")
    plan.add_argument("--seq_length", type=int, help="tokens per sequence (default: the recipe's block_size, else "
                      "the model's context length up to 4096)")
    plan.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE",
                      help="override a device field, e.g. --set memory=96GiB --set inter_node_bandwidth=50e9")
    plan.add_argument("--top", type=int, default=10, help="layouts listed (0: every one that fits)")
    plan.add_argument("--json", action="store_true", help="print every candidate as JSON")
    plan.set_defaults(func=_cmd_plan)
    _add_preprocess_parser(sub)
    return parser


EXIT_OK, EXIT_FAILED, EXIT_USER_ERROR, EXIT_INTERRUPTED = 0, 1, 2, 130
EXIT_CODES = {
    EXIT_OK: "the command did what it was asked",
    EXIT_FAILED: "a rank stopped because another rank of the job failed (the launcher's line names that one), or a "
                 "failure that is not a user error (its traceback is printed)",
    EXIT_USER_ERROR: "a user error, refused before anything is written: one line `error: ...` on stderr naming the "
                     "field, the value and what would be valid (also argparse's usage errors)",
    EXIT_INTERRUPTED: "interrupted (Ctrl-C): every process of the run was stopped, with one line `error: interrupted "
                      "...`; checkpoints already written are complete",
}
"""What ``mindformers-py`` exits with (a multi-process job ends with the exit of the rank that failed)."""

USER_ERROR_GRACE_S = 20.0
"""Seconds a rank that leaves a user error to its node's first rank waits for the launcher to stop it."""


class _StderrHandler(logging.StreamHandler):
    """Writes to ``sys.stderr`` as it is when a message comes, not as it was when :func:`main` first ran (a caller
    that runs ``main`` in-process, as the tests do, may have replaced and closed that stream since)."""

    @property
    def stream(self):
        return sys.stderr

    @stream.setter
    def stream(self, _value) -> None:
        pass


def main(argv: list[str] | None = None) -> int:
    """Entry point; returns the exit status (:data:`EXIT_CODES`)."""
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra and args.command != "run":
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    args.extra = extra
    # Our own INFO messages (the auto_parallel planner's table, engine choices) are part of the run's output.
    handler = _StderrHandler()
    handler.setFormatter(logging.Formatter("[mindformers_py] %(message)s"))
    package_logger = logging.getLogger("mindformers_py")
    if not package_logger.handlers:
        package_logger.addHandler(handler)
        package_logger.setLevel(logging.INFO)
    try:
        return args.func(args)
    except MindFormersError as e:
        if not _reports_user_errors():
            # The node's first rank meets the same error and prints it. Leaving at once could let the launcher see
            # this rank fail first and stop the first one before it has printed (CI saw a run end with no error
            # line). The launcher's SIGTERM ends this wait once the first rank has failed; if it does not come, the
            # error is this rank's own, and it says so itself.
            time.sleep(USER_ERROR_GRACE_S)
        if _first_to_report(str(e)):
            print(f"error: {e}", file=sys.stderr)
        return EXIT_USER_ERROR
    except KeyboardInterrupt:
        # Ctrl-C reaches every process of the job: the ranks stop quietly (a checkpoint is written under a temporary
        # name and renamed when complete, so those in place stay whole), the process that started them says so.
        if not os.environ.get("LOCAL_RANK"):
            print("error: interrupted (Ctrl-C); every process of the run was stopped (checkpoints already in "
                  "output_dir are complete: resume_from_checkpoint continues from the latest)", file=sys.stderr)
        else:
            # A rank gets the interrupt twice: from the terminal, and again from the launcher stopping its workers.
            # The second one, landing in the process's exit (multiprocessing's finalizers), printed a traceback;
            # the rank is leaving already, and the launcher can still kill it.
            signal.signal(signal.SIGINT, signal.SIG_IGN)
        return EXIT_INTERRUPTED
    except Exception as e:
        if not _lost_a_peer(e):
            _record_for_launcher(e)
            raise
        # A rank whose collective failed because another rank died: the launcher names that one (and restarts the
        # job with --max_restarts); this rank's traceback would only bury it.
        from .launcher.launch import PEER_GRACE_S

        time.sleep(PEER_GRACE_S)  # the launcher sees the failed rank first (its SIGTERM ends the wait)
        rank = os.environ.get("RANK", "?")
        print(f"error: rank {rank} stopped: {str(e).splitlines()[0] if str(e) else type(e).__name__} (another rank "
              "failed or was stopped; the launcher's message names it)", file=sys.stderr)
        return EXIT_FAILED


def _record_for_launcher(exc: Exception) -> None:
    """Under a launcher (torchrun, or ours), write the exception to the error file it gave this worker
    (``TORCHELASTIC_ERROR_FILE``, torchelastic's ``@record`` format), so that its report, the job's last line,
    names the error beside the rank; the traceback is printed here as well."""
    if not os.environ.get("TORCHELASTIC_ERROR_FILE"):
        return
    from torch.distributed.elastic.multiprocessing.errors import ErrorHandler

    ErrorHandler().record_exception(exc)


def _lost_a_peer(exc: Exception) -> bool:
    """Whether ``exc`` is a distributed worker's collective failing because another rank went away."""
    if "torch.distributed" not in sys.modules or not os.environ.get("RANK"):
        return False
    from .launcher.launch import lost_a_peer

    return lost_a_peer(exc)


def _first_to_report(message: str) -> bool:
    """Whether this process prints ``message``: a rank of a job this package launched prints a user error only if no
    other rank printed the same one (every rank often meets the same error after they have started; each claims the
    message with a file in the launch's scratch folder, the first one prints it)."""
    import hashlib

    from .launcher.restarts import RESTART_LOG_ENV

    log = os.environ.get(RESTART_LOG_ENV) if os.environ.get("LOCAL_RANK") else None
    if not log or not os.path.isdir(os.path.dirname(log)):
        return True
    claim = os.path.join(os.path.dirname(log), "error-" + hashlib.sha256(message.encode()).hexdigest()[:16])
    try:
        os.close(os.open(claim, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
    except FileExistsError:
        return False
    except OSError:
        return True
    return True


def _reports_user_errors() -> bool:
    """Whether this process prints a user error. Under torchrun every rank checks the same recipe, flags and world
    before any process group exists and fails alike, so the first rank of each node speaks for its node; once the
    ranks have joined a group, an error may be one rank's own and every rank prints its own."""
    if os.environ.get("LOCAL_RANK", "0") == "0":
        return True
    dist = sys.modules.get("torch.distributed")
    return dist is not None and dist.is_available() and dist.is_initialized()
